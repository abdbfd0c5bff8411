"""`q4k quantize IN.gguf OUT.gguf --type Q4_K_M`: write a quantized copy of a GGUF model."""

from __future__ import annotations

import argparse
import sys
import time

from actors.cli.common import ExamplesHelpFormatter, add_logging_flags, configure_logging_from
from actors.model.gguf.quantize_file import FILE_TYPES, quantize_file


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="quantize a GGUF model (F32/F16/BF16 or already quantized) with a llama.cpp recipe",
        description="Write OUTPUT, a copy of the GGUF model INPUT with its matrices quantized "
        "by llama.cpp's per-tensor recipe for --type (norms and other 1-D tensors stay "
        "float). Metadata is kept; general.file_type is updated. A progress bar shows on a "
        "terminal.",
        epilog="examples (INPUT as llama.cpp's convert_hf_to_gguf.py writes it, say):\n"
        "  q4k quantize model-f16.gguf model-q4_k_m.gguf\n"
        "  q4k quantize model-f16.gguf model-q8_0.gguf --type Q8_0\n"
        "then `q4k inspect model-q4_k_m.gguf` shows its tensor types, and "
        "`q4k generate PROMPT --model model-q4_k_m.gguf` runs it.",
        formatter_class=ExamplesHelpFormatter,
    )
    parser.add_argument("input", metavar="INPUT", help="source GGUF file")
    parser.add_argument("output", metavar="OUTPUT", help="GGUF file to write")
    parser.add_argument(
        "--type",
        default="Q4_K_M",
        metavar="TYPE",
        help=f"file type: {', '.join(FILE_TYPES)} (default Q4_K_M)",
    )
    add_logging_flags(parser)
    parser.set_defaults(handler=_quantize)


def _quantize(args: argparse.Namespace) -> int:
    configure_logging_from(args)
    start = time.perf_counter()
    mix = quantize_file(args.input, args.output, args.type.upper())
    summary = ", ".join(f"{count} {type_name}" for type_name, count in sorted(mix.items()))
    print(
        f"wrote {args.output} ({args.type.upper()}): {summary} tensors "
        f"in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    return 0
