"""benchmarks/synthetic_gguf.py: the Llama-3-8B-shaped Q4_K_M model the GPU benchmark uses."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import actors
from actors.model.arch import spec_from_gguf
from actors.model.gguf.quants import dequantize
from actors.model.gguf.reader import open_gguf

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "synthetic_gguf.py"


@pytest.fixture(scope="module")
def synthetic() -> ModuleType:
    spec = importlib.util.spec_from_file_location("synthetic_gguf", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_two_layers_at_full_width_have_llama3_8b_shapes_and_q4_k_m_types(
    synthetic: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "llama3-8b-2layers.gguf"
    mix = synthetic.write_synthetic_gguf(path, synthetic.LlamaShape(layers=2, vocab=512))
    assert mix == {"Q4_K": 13, "Q6_K": 3, "F32": 5}
    with open_gguf(path) as gguf:
        spec = spec_from_gguf(gguf)
        assert (spec.arch, spec.n_layers, spec.d_model, spec.n_heads, spec.n_kv_heads) == (
            "llama", 2, 4096, 32, 8)
        assert (spec.head_dim, spec.ffn_dim, spec.context_length, spec.vocab_size) == (
            128, 14336, 8192, 512)
        assert spec.rope_base == 500000.0 and spec.rms_eps == pytest.approx(1e-5)
        # llama.cpp's use_more_bits picks layer 1 of 2 for Q6_K attn_v / ffn_down.
        types = {info.name: info.type_name for info in gguf}
        assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
        assert types["blk.1.ffn_down.weight"] == "Q6_K" and types["output.weight"] == "Q6_K"
        assert types["token_embd.weight"] == "Q4_K"
        for info in gguf:
            rows = min(info.shape[0], 64) if len(info.shape) == 2 else 1
            raw = gguf.raw(info.name).reshape(-1)[: rows * info.row_bytes]
            values = dequantize(raw, info.type_name, (rows, info.shape[-1]))
            assert np.isfinite(values).all(), info.name
            assert np.abs(values).max() < 0.1 or info.type_name == "F32", info.name
            assert info.type_name == "F32" or values.std() > 1e-3, info.name


def test_a_narrow_version_loads_and_runs_on_the_cpu(synthetic: ModuleType,
                                                     tmp_path: Path) -> None:
    path = tmp_path / "narrow.gguf"
    shape = synthetic.LlamaShape(layers=2, d_model=256, heads=4, kv_heads=2, ffn=512, vocab=512,
                                 context=128)
    synthetic.write_synthetic_gguf(path, shape, seed=3)
    model = actors.load_model(path)
    assert model.spec.kv_dim == shape.kv_dim == 128
    logits = model.logits([1, 2, 3, 500])
    assert logits.shape == (4, 512) and np.isfinite(logits).all()


def test_blocks_are_written_directly_with_scales_in_range(synthetic: ModuleType) -> None:
    rng = np.random.default_rng(0)
    blocks = synthetic.random_blocks(rng, "Q4_K", 1000)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    assert blocks.shape == (1000, 144) and blocks.dtype == np.uint8
    assert (d >= 9.9e-6).all() and (d <= 5.1e-5).all()
    assert len(np.unique(blocks[:, 16:])) == 256  # the quants are random bytes
