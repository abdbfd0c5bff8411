"""benchmarks/grow_gguf.py: a shrunk model grown back to full shape for the device benchmark
(gemma-3-270m from ../shared/cuda/models/gemma3-shrunk.gguf); tested on the tiny llama."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from actors.model.gguf.reader import open_gguf
from actors.model.loaded import load_model
from benchmarks import grow_gguf
from tests.conftest import TINY_MODELS


def tensor_bytes(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    with open_gguf(path) as gguf:
        return {name: (info.type_name, tuple(info.shape), gguf.raw(name).tobytes())
                for name, info in gguf.tensors.items()}


def test_layers_and_vocabulary_repeat_in_order(tmp_path: Path) -> None:
    source, grown = TINY_MODELS["llama-q4k-tiny"], tmp_path / "grown.gguf"
    small = load_model(source).spec
    layers, vocab = small.n_layers + 2, small.vocab_size + 70
    assert grow_gguf.grow(source, grown, layers, vocab)["layers"] == layers
    model = load_model(grown)
    assert (model.spec.n_layers, model.spec.vocab_size) == (layers, vocab)
    before, after = tensor_bytes(source), tensor_bytes(grown)
    for layer in range(layers):
        for name, (type_name, shape, data) in before.items():
            if name.startswith("blk.0."):
                copied = after[name.replace("blk.0.", f"blk.{layer}.")]
                origin = before[name.replace("blk.0.", f"blk.{layer % small.n_layers}.")]
                assert copied == origin, (layer, name)
    embedding = after["token_embd.weight"][2]
    row = len(before["token_embd.weight"][2]) // small.vocab_size
    assert embedding[: small.vocab_size * row] == before["token_embd.weight"][2]
    assert embedding[small.vocab_size * row :] == before["token_embd.weight"][2][: 70 * row]
    # The grown model runs: the placeholder tokens are ordinary ids past the real vocabulary.
    logits = model.logits([1, 5, vocab - 1])
    assert logits.shape == (3, vocab) and np.isfinite(logits).all()
    assert model.tokenizer.vocab_size == vocab


def test_a_vocabulary_below_the_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="below the file's"):
        grow_gguf.grow(TINY_MODELS["llama-q4k-tiny"], tmp_path / "x.gguf", 3, 10)
