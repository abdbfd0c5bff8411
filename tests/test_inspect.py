"""`q4k inspect` as a user runs it: a subprocess, its figures checked against a recount made
with gguf's own reader, and its errors one line long."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

from tests.conftest import TINY_MODELS

TINY = TINY_MODELS["llama-q4k-tiny"]


def q4k_inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )


def inspect_json(path: Path | None) -> dict[str, Any]:
    done = q4k_inspect(*([str(path)] if path else []), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def recount(path: Path) -> dict[str, Any]:
    """The figures inspect should report, counted independently with gguf.GGUFReader."""
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    arch = fields["general.architecture"]
    heads = fields[f"{arch}.attention.head_count"]
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = fields.get(
        f"{arch}.attention.key_length", fields[f"{arch}.embedding_length"] // heads
    )
    mix: dict[str, dict[str, int]] = {}
    for tensor in reader.tensors:
        share = mix.setdefault(tensor.tensor_type.name, {"count": 0, "bytes": 0})
        share["count"] += 1
        share["bytes"] += int(tensor.n_bytes)
    parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    return {
        "file_bytes": path.stat().st_size,
        "gguf_version": fields["GGUF.version"],
        "tensor_count": len(reader.tensors),
        "metadata_count": sum(not key.startswith("GGUF.") for key in fields),
        "architecture": arch,
        "context_length": fields[f"{arch}.context_length"],
        "tokenizer": {
            "model": fields["tokenizer.ggml.model"],
            "pre": fields["tokenizer.ggml.pre"],
            "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        },
        "chat_template": "tokenizer.chat_template" in fields,
        "tensor_types": mix,
        "parameter_count": parameters,
        "weight_bytes": sum(share["bytes"] for share in mix.values()),
        "weight_bytes_f32": 4 * parameters,
        "kv_bytes_per_token": 2 * fields[f"{arch}.block_count"] * kv_heads * head_dim * 4,
    }


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_json_figures_match_a_recount(name: str) -> None:
    path = TINY_MODELS[name]
    report = inspect_json(path)
    expected = recount(path)
    assert {key: report[key] for key in expected} == expected
    reader = gguf.GGUFReader(path)
    arch = expected["architecture"]
    hyper = report["hyperparameters"]
    assert hyper["n_layers"] == reader.fields[f"{arch}.block_count"].contents()
    assert hyper["d_model"] == reader.fields[f"{arch}.embedding_length"].contents()
    assert hyper["ffn_dim"] == reader.fields[f"{arch}.feed_forward_length"].contents()
    assert hyper["vocab_size"] == expected["tokenizer"]["vocab_size"]
    assert report["path"] == str(path)


def test_json_keys_are_stable() -> None:
    report = inspect_json(TINY)
    assert list(report) == [
        "path", "file_bytes", "gguf_version", "tensor_count", "metadata_count", "name",
        "architecture", "hyperparameters", "context_length", "features", "tokenizer",
        "chat_template",
        "tensor_types", "parameter_count", "weight_bytes", "weight_bytes_f32",
        "kv_bytes_per_token",
    ]
    assert all(key.islower() and " " not in key for key in report["hyperparameters"])


def test_default_model_when_no_path(gemma3_model_path: Path, smollm2_model_path: Path) -> None:
    report = inspect_json(None)
    assert report["path"] == str(gemma3_model_path)
    assert report["architecture"] == "gemma3"
    assert report["hyperparameters"]["sliding_window"] == 512
    assert report["chat_template"] is False
    assert inspect_json(smollm2_model_path)["chat_template"] is True


def test_table_shows_the_figures() -> None:
    done = q4k_inspect(str(TINY))
    assert done.returncode == 0, done.stderr
    expected = recount(TINY)
    rows = {line.split("  ")[0]: line for line in done.stdout.splitlines()}
    assert "llama" in rows["architecture"]
    assert "gpt2" in rows["tokenizer"] and "1,024 tokens" in rows["tokenizer"]
    assert f"{expected['parameter_count']:,}" in rows["parameters"]
    assert f"({expected['weight_bytes']:,} B) in the file" in rows["weights"]
    assert f"({expected['kv_bytes_per_token']:,} B) per token" in rows["KV cache"]
    assert "no" in rows["chat template"]
    lines = done.stdout.splitlines()
    for type_name, share in expected["tensor_types"].items():
        assert any(type_name in line and f"{share['bytes']:,} B" in line for line in lines)


def assert_one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode != 0
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("q4k inspect: error: ")
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_corrupted_copy(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.gguf"
    data = bytearray(TINY.read_bytes())
    data[8:16] = (1 << 62).to_bytes(8, "little")  # the tensor count
    path.write_bytes(data)
    assert_one_line_error(q4k_inspect(str(path), "--json"), str(path), "tensors")


def test_truncated_copy(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(TINY.read_bytes()[:5000])
    assert_one_line_error(q4k_inspect(str(path)), "truncated")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    assert_one_line_error(q4k_inspect(str(tmp_path / "none.gguf")), "no such model file")
    assert_one_line_error(q4k_inspect(str(tmp_path)), "is a directory")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    shutil.copyfile(TINY, path)
    data = bytearray(path.read_bytes())
    at = data.index(b"\x05\x00\x00\x00\x00\x00\x00\x00llama")  # general.architecture's value
    data[at + 8 : at + 13] = b"llava"
    path.write_bytes(data)
    assert_one_line_error(q4k_inspect(str(path)), "'llava' is not supported")
