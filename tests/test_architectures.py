"""The architectures beyond plain llama, as read from their files: Qwen3, Llama 3.x's
`rope_freqs`, Gemma 3 with linear RoPE scaling, Phi-3's fused tensors; the scaling this engine
does not run refused by name; and each new model served by the engine end to end.

Their numerics against transformers and llama.cpp are in test_forward_reference.py (CPU) and
test_cuda_backend_emulated.py (the CUDA backend); this file checks the reading itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.engine import Engine
from actors.errors import ModelFormatError, UnsupportedModelError
from actors.model.arch import ModelSpec, architecture_features, spec_from_gguf
from actors.model.gguf.reader import GGUFFile, TensorInfo, open_gguf
from actors.model.loaded import OpenedModel, load_model
from actors.model.tensors import ROPE_FACTORS, ModelTensors
from actors.params import SamplingParams
from tests.conftest import REFERENCE_DIR, TINY_MODELS

NEW_MODELS = ("qwen3-q4k-tiny", "llama3-q4k-tiny", "gemma3-scaled-q4k-tiny", "phi3-q4k-tiny")


def opened_with(name: str, changes: dict[str, Any] | None = None,
                dropped: tuple[str, ...] = ()) -> GGUFFile:
    """A tiny model's file, its metadata changed in memory (the file is untouched)."""
    gguf = open_gguf(TINY_MODELS[name])
    gguf.metadata = {key: value for key, value in gguf.metadata.items() if key not in dropped}
    gguf.metadata.update(changes or {})
    return gguf


def spec_with(name: str, changes: dict[str, Any] | None = None,
              dropped: tuple[str, ...] = ()) -> ModelSpec:
    with opened_with(name, changes, dropped) as gguf:
        return spec_from_gguf(gguf)


def test_qwen3_spec() -> None:
    spec = spec_with("qwen3-q4k-tiny")
    assert spec.arch == "qwen3" and spec.rope_neox and spec.qk_norm and spec.tied_output
    assert not spec.qkv_bias and not spec.post_norms
    # head_dim from attention.key_length, not d_model / n_heads.
    assert (spec.d_model, spec.n_heads, spec.head_dim, spec.q_dim) == (256, 4, 128, 512)
    assert spec.query_scale == pytest.approx(1 / math.sqrt(128))


def test_phi3_fused_tensors_are_presented_as_row_ranges_of_the_file() -> None:
    with open_gguf(TINY_MODELS["phi3-q4k-tiny"]) as gguf:
        spec = spec_from_gguf(gguf)
        assert spec.rope_neox and spec.fused_qkv and spec.fused_gate_up
        assert spec.sliding_window == 0  # as llama.cpp, which keeps Phi-3's window off
        tensors = ModelTensors(gguf, spec)
        for layer in range(spec.n_layers):
            p = f"blk.{layer}."
            qkv, up = gguf.raw(p + "attn_qkv.weight"), gguf.raw(p + "ffn_up.weight")
            q, k, v = (tensors.raw(f"{p}attn_{part}.weight") for part in "qkv")
            assert (q.shape[0], k.shape[0], v.shape[0]) == (spec.q_dim, spec.kv_dim, spec.kv_dim)
            np.testing.assert_array_equal(np.concatenate([q, k, v]), qkv)
            gate, up_half = tensors.raw(p + "ffn_gate.weight"), tensors.raw(p + "ffn_up.weight")
            assert gate.shape[0] == up_half.shape[0] == spec.ffn_dim
            np.testing.assert_array_equal(np.concatenate([gate, up_half]), up)
            # Views into the mapped file, not copies.
            assert not q.flags.owndata and not gate.flags.owndata
        assert not any(info.name.endswith(("attn_qkv.weight",)) for info in tensors)
        # Every byte of the file's tensors is presented once.
        assert sum(info.n_bytes for info in tensors) == sum(info.n_bytes for info in gguf)


def test_phi3_fused_rows_that_contradict_the_heads_are_refused() -> None:
    with opened_with("phi3-q4k-tiny", {"phi3.attention.head_count_kv": 1}) as gguf:
        with pytest.raises(ModelFormatError, match="fused tensor 'blk.0.attn_qkv.weight' has "
                                                   "512 rows.*384"):
            OpenedModel(gguf, spec_from_gguf(gguf), 0.0)


def test_llama3_rope_freqs_divide_the_frequencies() -> None:
    with open_gguf(TINY_MODELS["llama3-q4k-tiny"]) as gguf:
        spec = spec_from_gguf(gguf)
        assert spec.rope_freqs and spec.rope_linear_factor == 1.0 and not spec.rope_neox
        model = load_model(TINY_MODELS["llama3-q4k-tiny"])
        np.testing.assert_array_equal(
            model.weights.rope_freq_factors,
            gguf.raw(ROPE_FACTORS).view(np.float32))
        assert model.weights.rope_freq_factors.max() > 1  # Llama 3.1's low frequencies


def test_scaled_gemma3_reads_its_layers_as_llama_cpp() -> None:
    spec = spec_with("gemma3-scaled-q4k-tiny")
    assert spec.rope_linear_factor == 8.0 and spec.rope_base == 1e6
    assert spec.sliding_window == 64 and spec.rope_base_local == 10000.0
    assert spec.sliding_layers == (True,) * 5 + (False,)
    assert [spec.is_sliding(layer) for layer in range(6)] == list(spec.sliding_layers)
    assert spec.query_scale == pytest.approx(1 / math.sqrt(128))
    # Only the global layers are scaled: the factor table the forward divides them by.
    tensors = load_model(TINY_MODELS["gemma3-scaled-q4k-tiny"]).weights.rope_freq_factors
    np.testing.assert_array_equal(tensors, np.full(spec.rope_dim // 2, 8.0, np.float32))


@pytest.mark.parametrize(("pattern", "sliding"), [
    (3, (True, True, False, True, True, False)),
    (0, (True,) * 6),
    ([False, True, True, False, True, True], (False, True, True, False, True, True)),
])
def test_gemma3_window_pattern_from_the_file(pattern: object,
                                             sliding: tuple[bool, ...]) -> None:
    spec = spec_with("gemma3-scaled-q4k-tiny",
                     {"gemma3.attention.sliding_window_pattern": pattern})
    assert spec.sliding_layers == sliding


def test_gemma3_pattern_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ModelFormatError, match="sliding_window_pattern.*6 booleans"):
        spec_with("gemma3-scaled-q4k-tiny",
                  {"gemma3.attention.sliding_window_pattern": [True, False]})


def test_gemma3_sliding_base_and_27b_query_scale() -> None:
    spec = spec_with("gemma3-scaled-q4k-tiny", {"gemma3.rope.freq_base_swa": 20000.0,
                                                 "gemma3.block_count": 62})
    assert spec.rope_base_local == 20000.0
    # Gemma 3 27B: queries scaled by 1/sqrt(d_model / n_heads) = 1/sqrt(64), not head_dim.
    assert spec.query_scale == pytest.approx(1 / math.sqrt(256 / 4))


def test_unscaled_gemma3_has_no_factor_table() -> None:
    spec = spec_with("gemma3-scaled-q4k-tiny", dropped=("gemma3.rope.scaling.type",
                                                        "gemma3.rope.scaling.factor"))
    assert spec.rope_linear_factor == 1.0
    with opened_with("gemma3-scaled-q4k-tiny", dropped=("gemma3.rope.scaling.type",
                                                        "gemma3.rope.scaling.factor")) as gguf:
        assert ROPE_FACTORS not in ModelTensors(gguf, spec)


def test_linear_scaling_without_a_type_and_with_rope_freqs_multiplies() -> None:
    """llama.cpp takes a factor without a type as linear; on a file with rope_freqs the two
    divide the frequencies together."""
    with opened_with("llama3-q4k-tiny", {"llama.rope.scaling.factor": 2.0}) as gguf:
        spec = spec_from_gguf(gguf)
        assert spec.rope_linear_factor == 2.0
        folded = ModelTensors(gguf, spec).raw(ROPE_FACTORS).view(np.float32)
        np.testing.assert_array_equal(folded, gguf.raw(ROPE_FACTORS).view(np.float32) * 2)


@pytest.mark.parametrize(("changes", "message"), [
    ({"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0},
     "RoPE scaling 'yarn' \\(factor 4\\) is not supported"),
    ({"qwen3.rope.scaling.type": "longrope", "qwen3.rope.scaling.factor": 32.0},
     "RoPE scaling 'longrope'"),
    ({"qwen3.rope.scaling.type": "linear", "qwen3.rope.scaling.factor": 2.0,
      "qwen3.rope.scaling.attn_factor": 1.2}, "attention factor"),
    ({"qwen3.final_logit_softcapping": 30.0}, "soft-capping"),
])
def test_scaling_we_do_not_run_is_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        spec_with("qwen3-q4k-tiny", changes)


def test_longrope_factor_tensors_are_refused() -> None:
    with opened_with("phi3-q4k-tiny") as gguf:
        embd = gguf.tensors["output_norm.weight"]
        gguf.tensors["rope_factors_long.weight"] = TensorInfo(
            "rope_factors_long.weight", "F32", 0, (32,), embd.offset, 128)
        with pytest.raises(UnsupportedModelError, match="LongRoPE.*rope_factors_long"):
            spec_from_gguf(gguf)


@pytest.mark.parametrize(("name", "expected"), [
    ("qwen3-q4k-tiny", ["RoPE neox (halves), base 1,000,000", "per-head q/k RMSNorm",
                        "output tied to the token embedding"]),
    ("llama3-q4k-tiny", ["RoPE norm (adjacent pairs), base 500,000",
                         "Llama 3 per-frequency RoPE factors (rope_freqs)"]),
    ("gemma3-scaled-q4k-tiny", ["linear RoPE scaling x8 on the global layers",
                                "sliding window of 64 tokens on 5 of 6 layers (RoPE base "
                                "10,000 there, unscaled)"]),
    ("phi3-q4k-tiny", ["fused attn_qkv (split at load)",
                       "fused gate+up in ffn_up (split at load)"]),
])
def test_features_name_what_the_file_holds(name: str, expected: list[str]) -> None:
    features = architecture_features(spec_with(name))
    assert all(feature in features for feature in expected), features


# --- the engine end to end ---------------------------------------------------------------

GEMMA3_TEMPLATE = REFERENCE_DIR / "chat-templates" / "google-gemma-3-it.json"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def _template_for(name: str) -> str | None:
    """The model's own template; the scaled Gemma 3 has none, so Gemma 3's published one."""
    if name != "gemma3-scaled-q4k-tiny":
        return None
    import json

    return json.loads(Path(GEMMA3_TEMPLATE).read_text())["template"]


@pytest.mark.anyio
@pytest.mark.parametrize("name", NEW_MODELS)
async def test_engine_chats_with_each_new_model_as_its_cpu_forward(name: str) -> None:
    """A chat through the engine's actors: the prompt rendered by the model's template with
    its special tokens as single ids, and a greedy answer that is the forward's argmax at
    every step (teacher-forced over prompt + answer)."""
    model = load_model(TINY_MODELS[name])
    messages = [{"role": "user", "content": "Say something about the sea."}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    async with Engine.open(model) as engine:
        template = _template_for(name)
        chunks = [chunk async for chunk in engine.chat(messages, params, template)]
        rendered = engine.chat_template(template).render(messages)
    answer = [chunk.token_id for chunk in chunks if chunk.token_id is not None]
    assert len(answer) == 12 and chunks[-1].finish_reason == "length"
    prompt = model.tokenizer.encode(rendered, parse_special=True, add_bos=False)
    bos = model.tokenizer.bos_id
    if model.tokenizer.vocab.add_bos and (not prompt or prompt[0] != bos):
        prompt = [bos, *prompt]
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    # The template's turn markers are special tokens, parsed as one id each.
    assert len(prompt) < len(model.tokenizer.encode(rendered, add_bos=False))
    logits = model.logits(prompt + answer[:-1])
    assert answer == logits[len(prompt) - 1:].argmax(axis=1).tolist()
