"""`q4k inspect [MODEL] [--json]`: what a GGUF model file holds, without loading its weights."""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table
from rich.text import Text

from actors.cli.common import console
from actors.model.arch import architecture_features
from actors.model.gguf.inventory import Inventory, inventory
from actors.model.gguf.reader import open_gguf
from actors.model.packaged import DEFAULT_MODEL, resolve_model

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="show a model file's architecture, tokenizer, tensor types and memory",
        description="Read a GGUF file's header (the weights are mapped, not read) and report "
        "its architecture, hyperparameters, tokenizer, chat template, tensor type mix, weight "
        "memory and KV cache bytes per token.",
    )
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a GGUF model file, or a packaged model's name (`q4k models` lists "
                        f"them; default: {DEFAULT_MODEL})")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with stable snake_case keys")
    parser.set_defaults(handler=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    with open_gguf(resolve_model(args.model)) as model:
        report = inventory(model)
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        _print_tables(report)
    return 0


def _size(n_bytes: int) -> str:
    """`n_bytes` in the largest binary unit that keeps the figure >= 1."""
    value, unit = float(n_bytes), _UNITS[0]
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{n_bytes:,} B" if unit == "B" else f"{value:,.1f} {unit} ({n_bytes:,} B)"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _print_tables(report: Inventory) -> None:
    spec = report.spec
    out = console()
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    rows = [
        ("file", str(report.path)),
        ("name", report.name or "-"),
        ("size", f"{_size(report.file_bytes)}, GGUF v{report.gguf_version}, "
                 f"{report.tensor_count} tensors, {report.metadata_count} metadata keys"),
        ("architecture", spec.arch),
        ("layers", str(spec.n_layers)),
        ("d_model / ffn", f"{spec.d_model} / {spec.ffn_dim}"),
        ("heads / kv heads", f"{spec.n_heads} / {spec.n_kv_heads} (head_dim {spec.head_dim})"),
        ("rope", f"base {spec.rope_base:g}, {spec.rope_dim} dims, "
                 f"{'neox' if spec.rope_neox else 'norm'}"),
        ("rms eps", f"{spec.rms_eps:g}"),
        ("context length", f"{spec.context_length:,}"),
        ("features", "; ".join(architecture_features(spec))),
        ("tokenizer", f"{report.tokenizer_model or '-'} (pre {report.tokenizer_pre or '-'}), "
                      f"{_count(report.tokenizer_vocab_size)} tokens; embedding rows "
                      f"{spec.vocab_size:,}"),
        ("chat template", "yes" if report.has_chat_template else "no"),
        ("parameters", f"{report.parameter_count:,}"),
        ("weights", f"{_size(report.weight_bytes)} in the file, "
                    f"{_size(report.weight_bytes_f32)} as float32"),
        ("KV cache", f"{_size(report.kv_bytes_per_token)} per token (float32)"),
    ]
    for field, value in rows:
        # Every value holds text from the file (a name, a tokenizer): never rich markup.
        summary.add_row(field, Text(value))
    out.print(summary)

    mix = Table(title="tensor types", title_justify="left")
    for header in ("type", "tensors", "bytes", "share"):
        mix.add_column(header, justify="left" if header == "type" else "right")
    for type_name, share in report.tensor_types.items():
        fraction = share.n_bytes / report.weight_bytes if report.weight_bytes else 0.0
        mix.add_row(Text(type_name), str(share.count), _size(share.n_bytes), f"{fraction:.1%}")
    out.print(mix)
