"""The CUDA backend's host side, without a device: the launches a step makes (checked against
each architecture's quirks and against the kernels' own compiled signatures), the packing of
step and row inputs, the candidate-count rule of top_candidates (a numpy twin against the
contract and actors.model.candidates), graph eligibility, KV sizing, the weight upload layout
and the registry's reasons."""

from __future__ import annotations

import builtins
import dataclasses
import math
import re
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from actors.compute import cuda_launches as launches
from actors.compute import cuda_memory as memory
from actors.compute import cuda_packing as packing
from actors.compute import cuda_plan as plan
from actors.compute import cuda_weights
from actors.compute.backends import CudaFactory
from actors.errors import ComputeError, InvalidRequest
from actors.model.arch import ModelSpec, spec_from_gguf
from actors.model.candidates import (
    RowInputs,
    apply_penalties,
    apply_token_masks,
    mask_words,
    top_candidates,
)
from actors.model.gguf.quants import dequantize
from actors.model.gguf.reader import GGUFFile, open_gguf
from actors.model.step import StepItem, plan_step
from tests.conftest import TINY_MODELS, gemma3_path, smollm2_path
from tests.cuda_emulator import PTX_TYPE, ptx_signatures
from tests.cuda_samples import (
    penalties_twin,
    planar_names,
    random_row_inputs,
    top_candidates_twin,
)

BLOCK = 16


def _open(path: Path) -> GGUFFile:
    return open_gguf(path)


@pytest.fixture(scope="module")
def models() -> Iterator[dict[str, GGUFFile]]:
    files = {"llama": _open(smollm2_path()), "qwen2": _open(TINY_MODELS["qwen2-q4k-tiny"]),
             "gemma3": _open(gemma3_path()), "llama-tiny": _open(TINY_MODELS["llama-q4k-tiny"])}
    yield files
    for gguf in files.values():
        gguf.close()


def _plan(spec: ModelSpec, items: list[StepItem], num_blocks: int = 64):
    return plan_step(items, spec, num_blocks, BLOCK)


def _calls(gguf: GGUFFile, items: list[StepItem]) -> tuple[ModelSpec, list[launches.KernelCall]]:
    spec = spec_from_gguf(gguf)
    step = _plan(spec, items)
    shape = launches.step_shape(step, 8, launches.split_keys_for(spec.context_length),
                                spec.context_length)
    return spec, launches.forward_calls(spec, launches.tensor_layouts(gguf), shape,
                                        launches.TILE_INPUT)


def _layer_slices(calls: list[launches.KernelCall]) -> list[list[launches.KernelCall]]:
    """The calls of each layer: from one norm on the attention input to the next."""
    starts = [i for i, call in enumerate(calls) if call.kernel == "residual_rms_norm"
              and call.args[3].name.endswith("attn_norm.weight")]
    return [calls[a:b] for a, b in zip(starts, [*starts[1:], len(calls)])]


DECODE_AND_PREFILL = [StepItem((5,), 3, (0,)), StepItem((7, 8, 9), 0, (1,))]


def _kind(call: launches.KernelCall) -> str:
    """A matvec launch's kernel without its block-type suffix (the CUDA-core and the tensor
    cores' alike), another launch's kernel."""
    for fused in ("gate_up", "qkv"):
        if call.kernel.startswith("mul_mat_vec_") and f"_{fused}" in call.kernel:
            return f"mul_mat_vec_{fused}"
    return "mul_mat_vec" if call.kernel.startswith("mul_mat_vec_") else call.kernel


def _fused_qkv(call: launches.KernelCall) -> bool:
    """Whether a launch is a fused QKV (the matvecs' or the batched product's): the same
    arguments, the qkv counters last."""
    return call.kernel in ("mul_mat_vec_qkv", "mul_mat_vec_mma_qkv") or (
        call.kernel.startswith("mul_mat_batch") and "_qkv_" in call.kernel)


# What finishing q, k and v takes, by name, in order: qkv_finish's arguments, and
# mul_mat_vec_qkv's after its product's (`PRODUCT_ARGS`: q, k and v's segments, x, y, sizes).
QKV_FINISH_ARGS = ("qkv", "stride", "heads", "kv_heads", "head_dim", "q_bias", "k_bias",
                   "v_bias", "q_norm", "k_norm", "eps", "positions", "rope_dim", "base",
                   "factors", "neox", "slots", "k_cache", "v_cache")
PRODUCT_ARGS = 18


def _finish_args(call: launches.KernelCall) -> dict[str, launches.Arg]:
    """A qkv_finish's or a fused QKV's finishing arguments by name (the fused kernel takes
    the head counts as its q and k segments' rows over head_dim)."""
    if call.kernel == "qkv_finish":
        return dict(zip(QKV_FINISH_ARGS, call.args, strict=True))
    assert _fused_qkv(call) and call.args[-1] == launches.Ref("qkv_counters")
    head_dim = int(call.args[PRODUCT_ARGS])
    return {"qkv": call.args[14], "stride": call.args[15],
            "heads": call.args[3] // head_dim, "kv_heads": call.args[7] // head_dim,
            **dict(zip(QKV_FINISH_ARGS[4:], call.args[PRODUCT_ARGS:-1], strict=True))}


def _layer_finish_args(layer: list[launches.KernelCall]) -> dict[str, launches.Arg]:
    """The finishing arguments of a layer whose rows all take one fused QKV (no qkv_finish
    follows it)."""
    assert not any(c.kernel == "qkv_finish" for c in layer)
    return _finish_args(next(c for c in layer if _fused_qkv(c)))


def test_llama_layer_runs_the_kernels_in_order(models: dict[str, GGUFFile]) -> None:
    spec, calls = _calls(models["llama"], DECODE_AND_PREFILL)
    layers = _layer_slices(calls)
    assert len(layers) == spec.n_layers
    assert [_kind(call) for call in layers[0]] == [
        "residual_rms_norm", "mul_mat_vec_qkv", "attention_decode",
        "attention_prefill", "mul_mat_vec", "residual_rms_norm",
        "mul_mat_vec_gate_up", "mul_mat_vec"]
    finish = _layer_finish_args(layers[0])
    assert finish["base"] == np.float64(spec.rope_base) and finish["neox"] == 0  # NORM pairs
    assert (finish["heads"], finish["kv_heads"]) == (spec.n_heads, spec.n_kv_heads)
    assert {finish[k] for k in ("q_bias", "k_bias", "v_bias", "q_norm", "k_norm")} == {
        launches.NULL}
    assert (finish["k_cache"], finish["v_cache"]) == (launches.Ref("k_cache.0"),
                                                      launches.Ref("v_cache.0"))
    assert (finish["positions"], finish["slots"]) == (launches.Ref("step.positions"),
                                                      launches.Ref("step.slots"))
    assert (finish["head_dim"], finish["rope_dim"]) == (spec.head_dim, spec.rope_dim)
    gate_up = next(c for c in layers[0] if _kind(c) == "mul_mat_vec_gate_up")
    assert gate_up.kernel == "mul_mat_vec_gate_up_silu_q4_1"
    assert gate_up.args[:2] == (launches.Ref("blk.0.ffn_gate.weight"),
                                launches.Ref("blk.0.ffn_up.weight"))
    assert gate_up.args[5] == launches.Ref("gated") and gate_up.args[9] == 4
    assert calls[0].kernel.startswith("get_rows_") and calls[0].args[5] == np.float32(1.0)
    assert calls[-1].args[0].name == ("token_embd.weight" if spec.tied_output
                                      else "output.weight")


def test_qkv_is_one_launch_with_a_block_type_per_segment(models: dict[str, GGUFFile]) -> None:
    gguf = models["gemma3"]  # Q5_0 q and k, Q8_0 v
    spec, calls = _calls(gguf, DECODE_AND_PREFILL)
    qkv = next(c for c in _layer_slices(calls)[0] if c.kernel == "mul_mat_vec_qkv")
    layouts = launches.tensor_layouts(gguf)
    for i, part in enumerate("qkv"):
        layout = layouts[f"blk.0.attn_{part}.weight"]
        weights, pitch, code, rows = qkv.args[4 * i : 4 * i + 4]
        assert weights == launches.Ref(f"blk.0.attn_{part}.weight")
        assert (pitch, rows) == (layout.pitch, layout.rows)
        assert list(plan.KERNEL_TYPE_SUFFIX)[code] == layout.type_name
    assert list(qkv.args[6:12:4]) == [plan.kernel_type_code("Q5_0"), plan.kernel_type_code("Q8_0")]
    x, x_stride, y, y_stride, n_in, batch = qkv.args[12:PRODUCT_ARGS]
    assert (x, x_stride, y, n_in, batch) == (launches.Ref("normed"), spec.d_model,
                                             launches.Ref("qkv"), spec.d_model, 4)
    assert y_stride == spec.q_dim + 2 * spec.kv_dim
    finish = _finish_args(qkv)
    assert (finish["heads"], finish["kv_heads"], finish["head_dim"]) == (
        spec.n_heads, spec.n_kv_heads, spec.head_dim)


def test_qwen2_finishes_qkv_with_its_three_biases(models: dict[str, GGUFFile]) -> None:
    spec, calls = _calls(models["qwen2"], DECODE_AND_PREFILL)
    layer = _layer_slices(calls)[1]
    finish = _layer_finish_args(layer)
    assert [finish[f"{p}_bias"] for p in "qkv"] == [launches.Ref(f"blk.1.attn_{p}.bias")
                                                    for p in "qkv"]
    assert finish["q_norm"] == finish["k_norm"] == launches.NULL
    assert finish["neox"] == 1  # NEOX


def test_gemma3_quirks(models: dict[str, GGUFFile]) -> None:
    spec, calls = _calls(models["gemma3"], DECODE_AND_PREFILL)
    assert calls[0].args[5] == np.float32(spec.embedding_scale)
    for index, layer in enumerate(_layer_slices(calls)):
        sliding = spec.is_sliding(index)
        finish = _layer_finish_args(layer)
        assert [finish[f"{p}_norm"] for p in "qk"] == [
            launches.Ref(f"blk.{index}.attn_{p}_norm.weight") for p in "qk"]
        assert finish["eps"] == np.float32(spec.rms_eps)
        assert finish["base"] == (spec.rope_base_local if sliding else spec.rope_base)
        for attention in (c for c in layer if c.kernel.startswith("attention_")):
            window = attention.args[12 if attention.kernel == "attention_decode" else 14]
            assert window == (spec.sliding_window if sliding else 0)
        assert any("_gate_up_gelu_tanh_" in c.kernel for c in layer)
        opening, ffn_norm = [c for c in layer if c.kernel == "residual_rms_norm"][:2]
        assert ffn_norm.args[2].name == f"blk.{index}.post_attention_norm.weight"
        expected = launches.NULL if index == 0 else launches.Ref(
            f"blk.{index - 1}.post_ffw_norm.weight")
        assert opening.args[2] == expected
    final_norm = next(c for c in reversed(calls) if c.kernel == "residual_rms_norm")
    assert final_norm.args[2].name == f"blk.{spec.n_layers - 1}.post_ffw_norm.weight"
    assert final_norm.args[3].name == "output_norm.weight"
    assert calls[-1].args[0].name == "token_embd.weight"  # tied output


def test_logit_rows_are_gathered_only_when_they_are_not_the_first_rows(
        models: dict[str, GGUFFile]) -> None:
    gguf = models["llama-tiny"]
    _, gathered = _calls(gguf, DECODE_AND_PREFILL)  # logit rows 0 and 3
    assert gathered[-2].kernel == "get_rows_f32" and gathered[-1].args[2].name == "final"
    _, decode = _calls(gguf, [StepItem((5,), 3, (0,)), StepItem((6,), 0, (1,))])
    assert decode[-2].kernel != "get_rows_f32" and decode[-1].args[2].name == "normed"
    _, none = _calls(gguf, [StepItem((5, 6), 0, (0,), want_logits=False)])
    assert not any(launches.Ref("logits") in call.args for call in none)


def _decode_step(gguf: GGUFFile, streams: int) -> list[launches.KernelCall]:
    spec = spec_from_gguf(gguf)
    shape = launches.graph_shape(launches.bucket_for(streams, launches.graph_buckets(64)), 8,
                                 launches.split_keys_for(spec.context_length),
                                 spec.context_length, BLOCK)
    return launches.forward_calls(spec, launches.tensor_layouts(gguf), shape,
                                  launches.TILE_INPUT)


@pytest.mark.parametrize("streams", [1, 8, 9, 32, 64])
def test_the_decode_rows_number_picks_their_kernels(models: dict[str, GGUFFile],
                                                    streams: int) -> None:
    """However many streams share a decode step, every product of it is one launch over all
    its rows: up to 8 rows on the matvec (the tensor cores' for Q4_K), past 8 on the batched
    product; the logits rows on the batched product either way."""
    calls = _decode_step(models["llama-tiny"], streams)
    products = [c for c in calls if c.kernel.startswith("mul_mat")]
    *layers, logits = products
    assert logits.args[4] == launches.Ref("logits")
    assert logits.kernel.startswith("mul_mat_batch")
    family = "mul_mat_vec_mma_" if streams <= plan.MATVEC_MMA_MAX_ROWS else "mul_mat_batch"
    assert layers and all(c.kernel.startswith(family) for c in layers)
    batches = {int(c.args[PRODUCT_ARGS - 1] if _fused_qkv(c) else c.args[-1]) for c in products}
    assert batches == {launches.bucket_for(streams, launches.graph_buckets(64))}


def test_a_long_prefill_joins_the_decode_rows_on_the_batched_product(
        models: dict[str, GGUFFile]) -> None:
    """12 decode rows (past the matvec's 8) and a 20-token prompt: one batched product over
    the step's 32 rows for every matrix of a layer (a row's sums are the same bits whatever
    else shares its launch), q, k and v finished in the fused QKV's epilogue, gate and up in
    their fused entry: seven launches a layer, with the prefill's attention beside the
    decode rows'."""
    spec = spec_from_gguf(models["llama-tiny"])
    decode = [StepItem((i + 5,), 3 + i, (i,)) for i in range(12)]
    _, calls = _calls(models["llama-tiny"], [*decode, StepItem(tuple(range(1, 21)), 0, (12, 13))])
    layer = _layer_slices(calls)[0]
    assert [_kind(c) for c in layer] == [
        "residual_rms_norm", "mul_mat_batch32_qkv_f16x2", "attention_decode",
        "attention_prefill", "mul_mat_batch32_f16x2_q4_K", "residual_rms_norm",
        f"mul_mat_batch32_gate_up_{spec.activation}_f16x2_q4_K", "mul_mat_batch32_f16x2_q4_K"]
    products = [c for c in layer if c.kernel.startswith("mul_mat_batch")]
    assert [int(c.args[PRODUCT_ARGS - 1] if _fused_qkv(c) else c.args[-1]) for c in products] \
        == [32, 32, 32, 32]
    args = _layer_finish_args(layer)
    assert (args["qkv"], args["positions"], args["slots"]) == (
        launches.Ref("qkv"), launches.Ref("step.positions"), launches.Ref("step.slots"))
    output = [c for c in calls if launches.Ref("logits") in c.args[4:5]]
    assert [(c.kernel, int(c.args[8])) for c in output] == [
        ("mul_mat_batch16_f16x2_q6_K_planar", 13)]  # 12 decode rows and 1 prefill


def test_a_prefill_chunk_takes_the_batched_product_at_64_columns(
        models: dict[str, GGUFFile]) -> None:
    """A 100-token prompt alone: its products on 64-column blocks, two token tiles (the
    batched QKV on 32-column ones, four); rows on the matvec keep theirs beside it."""
    spec = spec_from_gguf(models["llama-tiny"])
    prompt = StepItem(tuple(range(1, 101)), 0, tuple(range(10, 17)))
    _, calls = _calls(models["llama-tiny"], [prompt])
    layer = _layer_slices(calls)[0]
    products = [c for c in layer if c.kernel.startswith("mul_mat")]
    assert [c.kernel for c in products] == [
        "mul_mat_batch32_qkv_f16x2", "mul_mat_batch64_f16x2_q4_K",
        f"mul_mat_batch64_gate_up_{spec.activation}_f16x2_q4_K", "mul_mat_batch64_f16x2_q4_K"]
    assert [c.launch.grid[0] for c in products] == [4, 2, 2, 2]
    # Four decode rows on the matvec, the prompt's rows after them on the batched product,
    # each run finished by its own fused QKV over its own rows.
    decode = [StepItem((i + 5,), 3 + i, (i,)) for i in range(4)]
    _, calls = _calls(models["llama-tiny"], [*decode, prompt])
    layer = _layer_slices(calls)[0]
    down = [c for c in layer if c.args[0] == launches.Ref("blk.0.ffn_down.weight")]
    assert [(_kind(c), int(c.args[8])) for c in down] == [
        ("mul_mat_vec", 4), ("mul_mat_batch64_f16x2_q4_K", 100)]
    assert down[1].args[2] == launches.Ref("gated", 4 * spec.ffn_dim * 4)
    assert down[1].args[4] == launches.Ref("projected", 4 * spec.d_model * 4)
    stride = spec.q_dim + 2 * spec.kv_dim
    fused = [c for c in layer if _fused_qkv(c)]
    assert [c.kernel for c in fused] == ["mul_mat_vec_mma_qkv", "mul_mat_batch32_qkv_f16x2"]
    assert not any(c.kernel == "qkv_finish" for c in layer)
    for call, first in zip(fused, (0, 4)):
        args = _finish_args(call)
        assert args["qkv"] == launches.Ref("qkv", first * stride * 4)
        assert (args["positions"], args["slots"]) == (launches.Ref("step.positions", first * 4),
                                                      launches.Ref("step.slots", first * 4))


def test_each_prefill_item_takes_the_matvec_or_the_batched_product_by_its_own_length(
        models: dict[str, GGUFFile]) -> None:
    """Two 5-token prompts together take the matvec as each alone does (10 rows would once
    have gone to the batched product); a 20-token one between them the batched product;
    neighbours on the same side share a launch; every logits row takes the batched product."""
    spec = spec_from_gguf(models["llama-tiny"])
    items = [StepItem((5,), 3, (0,)), StepItem((6,), 4, (1,)),
             StepItem(tuple(range(1, 6)), 0, (2,)), StepItem(tuple(range(1, 21)), 0, (3, 4)),
             StepItem(tuple(range(1, 6)), 0, (5,)), StepItem(tuple(range(1, 6)), 0, (6,))]
    step = _plan(spec, items)
    shape = launches.step_shape(step, 8, launches.split_keys_for(spec.context_length),
                                spec.context_length)
    assert launches.row_runs(shape) == [launches.RowRun(0, 7, launches.MATVEC),
                                        launches.RowRun(7, 20, launches.BATCH),
                                        launches.RowRun(27, 10, launches.MATVEC)]
    _, calls = _calls(models["llama-tiny"], items)
    down = [c for c in calls if c.args[0] == launches.Ref("blk.0.ffn_down.weight")]
    assert [(_kind(c), c.args[2].offset // (4 * spec.ffn_dim), int(c.args[8])) for c in down] \
        == [("mul_mat_vec", 0, 7), ("mul_mat_batch32_f16x2_q4_K", 7, 20), ("mul_mat_vec", 27, 10)]
    output = [c for c in calls if launches.Ref("logits") in c.args[4:5]]
    assert [(c.kernel.startswith("mul_mat_batch16_"), int(c.args[8])) for c in output] == [
        (True, 6)]
    two_short = items[2:3] + items[4:5]
    assert launches.row_runs(launches.step_shape(
        _plan(spec, two_short), 8, 256, spec.context_length)) == [
            launches.RowRun(0, 10, launches.MATVEC)]


def test_decode_rows_up_to_8_take_the_mma_matvec() -> None:
    """The Llama-3-8B shape (Q4_K_M): 4 decode rows' products take mul_mat_vec_mma, gate and
    up with the activation in its fused entry, q, k and v in one mul_mat_vec_mma_qkv with the
    finish; the Q4_K matrices from their file-layout blocks, the Q6_K ones (v and down in
    some layers) held row-planar. Seven launches a layer."""
    from benchmarks.cuda_budget import llama_8b_layouts

    spec, layouts = llama_8b_layouts()
    shape = launches.graph_shape(4, 8, launches.split_keys_for(spec.context_length),
                                 spec.context_length, BLOCK)
    assert launches.row_runs(shape) == [launches.RowRun(0, 4, launches.MATVEC)]
    calls = launches.forward_calls(spec, layouts, shape, launches.TILE_INPUT)
    layers = _layer_slices(calls)
    assert len(layers) == spec.n_layers
    served = set()
    for layer in layers:
        products = [c for c in layer if c.kernel.startswith("mul_mat_vec")
                    and c.args[0].name.startswith("blk.")]
        assert not any(c.kernel in ("mul_mat_vec_qkv", "gated_silu", "qkv_finish")
                       for c in layer)
        (qkv,) = [c for c in products if c.kernel == "mul_mat_vec_mma_qkv"]
        products.remove(qkv)
        assert qkv.launch == plan.matvec_mma_qkv_launch(spec.q_dim, spec.kv_dim, spec.kv_dim)
        for ref, code in zip(qkv.args[0:12:4], qkv.args[2:12:4]):
            type_name = list(plan.KERNEL_TYPE_SUFFIX)[int(code)]
            assert layouts[ref.name].type_name == type_name
            assert layouts[ref.name].planar == (type_name == "Q6_K")
        for call in products:
            if "gate_up" in call.kernel:
                assert call.kernel == plan.matvec_mma_gate_up_kernel("silu", "Q4_K")
                assert call.launch == plan.Launch((2 * spec.ffn_dim // 16, 1, 1), (256, 1, 1),
                                                  plan.MATVEC_MMA_STAGING_BYTES)
                assert {ref.name for ref in call.args[:2]} <= set(layouts)  # file layout
                continue
            matrix = layouts[call.args[0].name]
            served.add((matrix.type_name, call.kernel, matrix.planar))
            assert call.kernel == plan.matvec_mma_kernel(matrix.type_name)
            assert call.launch == plan.matvec_mma_launch(matrix.rows, matrix.row_length)
            assert int(call.args[8]) == 4
    assert served == {("Q4_K", "mul_mat_vec_mma_q4_K", False),
                      ("Q6_K", "mul_mat_vec_mma_q6_K", True)}
    assert {len(layer) for layer in layers[:-1]} == {7}
    # The logits rows (this spec's output is the Q4_K embedding, tied) take the batched
    # product, whatever their number.
    assert calls[-1].kernel == plan.batch_kernel("Q4_K", 4) == "mul_mat_batch16_f16x2_q4_K"
    assert calls[-1].launch == plan.batch_launch(spec.vocab_size, 4)
    assert calls[-1].args[0] == launches.Ref("token_embd.weight")
    assert calls[-1].args[4] == launches.Ref("logits")
    # (Its Q6_K output.weight is no product: the spec ties the output to the embedding.)
    q6_K = {name for name, matrix in layouts.items() if matrix.type_name == "Q6_K"}
    assert planar_names(layouts) == q6_K
    planar_reads = {arg.name for call in calls for arg in call.args
                    if isinstance(arg, launches.Ref) and arg.name in q6_K}
    assert planar_reads == q6_K - {"output.weight"}


def test_the_matvec_rows_of_types_the_mma_matvec_does_not_serve_take_the_cuda_cores(
        models: dict[str, GGUFFile]) -> None:
    """SmolLM2 (Q4_1 and Q8_0 blocks) decodes on the CUDA-core matvec, q, k and v in
    mul_mat_vec_qkv; its logits rows on the batched product."""
    decode = [StepItem((5,), 3, (0,)), StepItem((6,), 4, (1,))]
    spec, calls = _calls(models["llama"], decode)
    products = [c for c in calls if c.kernel.startswith("mul_mat")]
    *layers, logits = products
    assert all(c.kernel.startswith("mul_mat_vec_") and "_mma_" not in c.kernel for c in layers)
    assert {c.kernel for c in layers} >= {"mul_mat_vec_qkv", "mul_mat_vec_gate_up_silu_q4_1"}
    assert (logits.kernel, logits.launch) == (plan.batch_kernel("Q8_0", 2),
                                              plan.batch_launch(spec.vocab_size, 2))


def test_gate_and_up_of_different_types_take_two_products_and_the_activation(
        models: dict[str, GGUFFile]) -> None:
    """The decode row and the short prompt in one matvec run: gate on mul_mat_vec_mma, up on
    the CUDA-core matvec, the activation, down."""
    ffn = ["mul_mat_vec_mma_q4_K", "mul_mat_vec_q8_0", "gated_silu", "mul_mat_vec_mma_q4_K"]
    gguf = models["llama-tiny"]
    spec = spec_from_gguf(gguf)
    layouts = launches.tensor_layouts(gguf)
    up = layouts["blk.0.ffn_up.weight"]
    layouts["blk.0.ffn_up.weight"] = launches.MatrixLayout("Q8_0", up.rows, up.row_length)
    shape = launches.step_shape(_plan(spec, DECODE_AND_PREFILL), 8,
                                launches.split_keys_for(spec.context_length),
                                spec.context_length)
    layer = launches.layer_calls(spec, layouts, shape, 0, launches.TILE_INPUT)
    assert [c.kernel for c in layer[layer.index(next(
        c for c in layer if c.kernel == "residual_rms_norm" and c is not layer[0])) + 1 :]] == ffn


def test_a_decode_layer_is_a_handful_of_kernels(models: dict[str, GGUFFile]) -> None:
    """Per decode layer: norm, qkv (finished in its epilogue: biases, head norms, RoPE, the
    K/V write), attention (split and combine), o, norm, gate+up, down; per step: the
    embedding, the final norm and the output product. The same count at any batch."""
    for name in ("llama", "qwen2", "gemma3"):
        spec = spec_from_gguf(models[name])
        for streams in (1, 9, 32, 64):
            calls = _decode_step(models[name], streams)
            assert len(calls) == 7 * spec.n_layers + 3, (name, streams)


@pytest.mark.parametrize("streams", [9, 16, 32, 64, 65])
def test_decode_steps_past_8_rows_take_the_batched_product(streams: int) -> None:
    """A decode step of more than 8 rows multiplies every matrix on
    the batched product, all its rows a launch (N = 16, 32 or 64 token columns a block, the
    QKV at most 32): q, k and v with their finish in one launch, gate + up with the
    activation in one, Q6_K matrices read row-planar; seven launches a layer."""
    from benchmarks.cuda_budget import llama_8b_layouts

    spec, layouts = llama_8b_layouts()
    shape = launches.graph_shape(streams, 8, launches.split_keys_for(spec.context_length),
                                 spec.context_length, BLOCK)
    assert launches.row_runs(shape) == [launches.RowRun(0, streams, launches.BATCH)]
    calls = launches.forward_calls(spec, layouts, shape, launches.TILE_INPUT)
    tokens = plan.batch_tokens(streams)
    assert tokens == min(n for n in (16, 32, 64, 128) if n >= min(streams, 64))
    for layer in _layer_slices(calls)[:-1]:
        assert len(layer) == 7
        qkv, gate_up, down = (layer[i] for i in (1, 5, 6))
        assert qkv.kernel == f"mul_mat_batch{min(tokens, 32)}_qkv_f16x2"
        assert qkv.launch.grid == (-(-streams // min(tokens, 32)),
                                   (spec.q_dim + 2 * spec.kv_dim) // 64, 1)
        assert qkv.args[-1] == launches.Ref("qkv_counters")
        assert gate_up.kernel == f"mul_mat_batch{tokens}_gate_up_silu_f16x2_q4_K"
        assert gate_up.launch.grid == (-(-streams // tokens), spec.ffn_dim // 32, 1)
        for call in (layer[3], down):
            matrix = layouts[call.args[0].name]
            assert call.kernel == plan.batch_kernel(matrix.type_name, streams)
            assert call.kernel.endswith("_planar") == (matrix.type_name == "Q6_K")
            assert call.launch == plan.batch_launch(matrix.rows, streams)
            assert int(call.args[8]) == streams
    assert calls[-1].kernel.startswith(f"mul_mat_batch{tokens}_f16x2_")
    # 8 rows (a graph bucket) stay on the mma matvec
    eight = launches.graph_shape(8, 8, launches.split_keys_for(spec.context_length),
                                 spec.context_length, BLOCK)
    assert launches.row_runs(eight) == [launches.RowRun(0, 8, launches.MATVEC)]


@pytest.fixture(scope="module")
def planned_calls(models: dict[str, GGUFFile]) -> dict[str, launches.KernelCall]:
    """Kernel -> a call of it the backend plans: the forward steps of each architecture, and
    the candidates' tail."""
    calls = {}
    long_prefill = [*DECODE_AND_PREFILL, StepItem(tuple(range(1, 21)), 0, (12, 13))]
    for arch in ("llama", "qwen2", "gemma3"):
        spec, forward = _calls(models[arch], long_prefill)
        tail = launches.candidate_calls(spec, 2, 16, any_penalty=True, n_masked=1)
        calls.update((call.kernel, call) for call in [*forward, *tail])
        for streams in (9, 40):  # the batched product's steps
            calls.update((call.kernel, call) for call in _decode_step(models[arch], streams))
    # Types the fused launches do not join: an up matrix and a v of another type than their
    # neighbours' (two products then the activation; on the matvec, a launch a matrix then
    # qkv_finish).
    gguf = models["llama-tiny"]
    spec, layouts = spec_from_gguf(gguf), launches.tensor_layouts(gguf)
    for name in ("blk.0.ffn_up.weight", "blk.0.attn_v.weight"):
        layouts[name] = dataclasses.replace(layouts[name], type_name="Q8_0")
    shape = launches.step_shape(_plan(spec, long_prefill), 8,
                                launches.split_keys_for(spec.context_length),
                                spec.context_length)
    calls.update((call.kernel, call) for call in launches.forward_calls(
        spec, layouts, shape, launches.TILE_INPUT))
    return calls


def test_every_planned_kernel_is_in_a_source_file(
        planned_calls: dict[str, launches.KernelCall]) -> None:
    defined = {entry for entries in plan.kernel_entry_points().values() for entry in entries}
    assert set(planned_calls) <= defined


def test_every_launch_asks_for_the_dynamic_shared_memory_its_function_is_allowed(
        planned_calls: dict[str, launches.KernelCall]) -> None:
    """The mma matvec's launches ask for its staging ring, as many bytes as matvec_mma.cu
    sizes it (stages x pieces x threads x 16) and as the backend allows its functions; no
    other launch asks for any."""
    source = (plan.kernel_source_dir() / "matvec_mma.cu").read_text()
    constant = {name: int(value) for name, value in
                re.findall(r"constexpr int (MMA_MATVEC_\w+) = (\d+);", source)}
    ring = (constant["MMA_MATVEC_STAGES"] * constant["MMA_MATVEC_PIECES"]
            * constant["MMA_MATVEC_WARPS"] * 32 * 16)
    assert ring == plan.MATVEC_MMA_STAGING_BYTES
    asking = {kernel for kernel, call in planned_calls.items() if call.launch.shared}
    assert asking == {kernel for kernel in planned_calls if kernel.startswith("mul_mat_vec_mma_")}
    assert "mul_mat_vec_mma_qkv" in asking
    for kernel, call in planned_calls.items():
        assert call.launch.shared == plan.dynamic_shared_bytes(kernel), kernel


# A file a test: its PTX compile (seconds, many more on a loaded machine) under its own timeout.
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("name", sorted(plan.kernel_entry_points()))
def test_every_launch_matches_its_kernels_compiled_signature(
        planned_calls: dict[str, launches.KernelCall], name: str) -> None:
    calls = {kernel: planned_calls[kernel] for kernel in plan.kernel_entry_points()[name]
             if kernel in planned_calls}
    if not calls:
        pytest.skip(f"the backend plans no launch of {name}'s kernels in these steps")
    signatures = ptx_signatures((plan.kernel_source_dir() / name).read_text())
    planned_type = {launches.Ref: "u64", **PTX_TYPE}  # a Ref becomes an address
    for kernel, call in calls.items():
        assert [planned_type[type(arg)] for arg in call.args] == signatures[kernel], kernel


def test_every_address_names_something_the_backend_holds(models: dict[str, GGUFFile]) -> None:
    for arch in ("llama", "qwen2", "gemma3"):
        gguf = models[arch]
        spec = spec_from_gguf(gguf)
        step = _plan(spec, DECODE_AND_PREFILL)
        masked = RowInputs(allowed=np.ones(mask_words(spec.vocab_size), np.int32))
        rows = packing.row_arrays([RowInputs(), masked], spec.vocab_size)
        arena = set(cuda_weights.weight_arena(gguf)[0])
        held = {"null", *arena,
                *memory.workspace_buffers(spec, memory.StepLimits(4, 2, 2, 16)),
                *(f"{kv}_cache.{layer}" for kv in "kv" for layer in range(spec.n_layers)),
                *(f"step.{name}" for name in packing.step_arrays(step, 1, 8)),
                *(f"rows.{name}" for name in rows.arrays)}
        forward = _calls(gguf, DECODE_AND_PREFILL)[1]
        tail = launches.candidate_calls(spec, 2, rows.width, any_penalty=True,
                                        n_masked=rows.n_masked)
        named = {arg.name for call in [*forward, *tail] for arg in call.args
                 if isinstance(arg, launches.Ref)}
        assert named <= held, named - held


def test_a_decode_graph_reads_only_the_decode_step_arrays(models: dict[str, GGUFFile]) -> None:
    spec = spec_from_gguf(models["gemma3"])
    shape = launches.graph_shape(8, 16, 256, spec.context_length, BLOCK)
    calls = launches.forward_calls(spec, launches.tensor_layouts(models["gemma3"]), shape,
                                   launches.TILE_INPUT)
    graph_arrays = packing.decode_step_arrays([1], [0], [0], [[0]], 8, 16, 0, 0)
    step_names = {arg.name for call in calls for arg in call.args
                  if isinstance(arg, launches.Ref) and arg.name.startswith("step.")}
    assert step_names == {f"step.{name}" for name in graph_arrays}
    assert not any(call.kernel == "attention_prefill" for call in calls)


# --- decisions ------------------------------------------------------------------------------


def test_graph_buckets_serve_steps_of_single_tokens_that_all_want_logits(
        models: dict[str, GGUFFile]) -> None:
    spec = spec_from_gguf(models["llama-tiny"])
    buckets = launches.graph_buckets(8)
    decode = [StepItem((i + 1,), 2, (i,)) for i in range(3)]
    assert launches.graph_bucket(_plan(spec, decode), buckets) == 4
    assert launches.graph_bucket(_plan(spec, decode[:1]), buckets) == 1
    with_prefill = [*decode, StepItem((1, 2), 0, (9,))]
    assert launches.graph_bucket(_plan(spec, with_prefill), buckets) is None
    silent = [*decode[:2], StepItem((4,), 0, (9,), want_logits=False)]
    assert launches.graph_bucket(_plan(spec, silent), buckets) is None
    many = [StepItem((1,), 0, (i,)) for i in range(9)]
    assert launches.graph_bucket(_plan(spec, many), buckets) is None


def test_only_the_leading_single_token_items_take_the_decode_kernels() -> None:
    assert launches.leading_decode_items(np.array([1, 1, 5, 1])) == 2
    assert launches.leading_decode_items(np.array([3, 1])) == 0
    assert launches.leading_decode_items(np.array([1, 1])) == 2


@pytest.mark.parametrize("window", [0, 40])
def test_the_decode_attention_twin_merges_its_splits_as_one(window: int) -> None:
    """tests/cuda_emulator's attention_decode over 64-key splits (sequences of 5 and 300
    keys, groups of 12 q heads: two blocks a KV head) equals one split over everything;
    partials are written only by the splits holding keys, and only where several do."""
    from tests.cuda_emulator import KernelTwins, Memory

    rng = np.random.default_rng(window)
    heads, kv_heads, head_dim, block_size, lengths = 24, 2, 16, 16, [5, 300]
    memory = Memory()
    twins = KernelTwins(memory)

    def put(array: np.ndarray) -> int:
        address = memory.allocate(array.nbytes)
        memory.view(address, np.uint8, array.nbytes)[:] = array.reshape(-1).view(np.uint8)
        return address

    blocks = -(-max(lengths) // block_size)
    cache = [put(rng.standard_normal((2 * blocks * block_size, kv_heads * head_dim))
                 .astype(np.float16)) for _ in "kv"]
    tables = put(np.arange(2 * blocks, dtype=np.int32))  # sequence s: blocks s * blocks ...
    positions = put(np.array(lengths, dtype=np.int32) - 1)
    q = put(rng.standard_normal((2, heads * head_dim)).astype(np.float32))

    def decode(split_keys: int, splits: int) -> tuple[np.ndarray, np.ndarray]:
        launch = plan.attention_decode_launch(2, heads, kv_heads, splits)
        partials = 2 * heads * splits
        best = put(np.full(partials, np.nan, np.float32))
        out = put(np.zeros((2, heads * head_dim), np.float32))
        twins.attention_decode(
            launch.grid, q, heads * head_dim, *cache, tables, blocks, positions, block_size,
            heads, kv_heads, head_dim, 0.25, window, split_keys,
            put(np.zeros(partials * head_dim, np.float32)), best,
            put(np.zeros(partials, np.float32)), put(np.zeros(2 * launch.grid[1], np.int32)),
            out, heads * head_dim)
        return (twins.f32(out, 2 * heads * head_dim).copy(),
                ~np.isnan(twins.f32(best, partials).reshape(2, heads, splits)))

    split, written = decode(64, 8)
    whole, none = decode(512, 1)
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-6)
    assert not none.any()
    used = -(-(min(lengths[1], window) if window else lengths[1]) // 64)
    assert not written[0].any() and written[1, :, :used].all() == (used > 1)
    assert not written[1, :, used:].any()


def test_split_keys_bound_the_graph_grid() -> None:
    for context in (128, 2048, 8192, 32768, 131072):
        keys = launches.split_keys_for(context)
        assert keys % plan.DECODE_TILE_KEYS == 0 and keys >= 2 * plan.DECODE_TILE_KEYS
        assert plan.decode_splits(context, keys) <= 32
    assert launches.table_stride_for(8192, 16, 100) == 100
    assert launches.table_stride_for(100, 16, 1000) == 7


def test_step_arrays_lay_out_slots_tables_and_prefill_items(
        models: dict[str, GGUFFile]) -> None:
    spec = spec_from_gguf(models["llama-tiny"])
    step = _plan(spec, [StepItem((5,), 17, (3, 4)), StepItem((7, 8, 9), 15, (6, 2))])
    arrays = packing.step_arrays(step, 1, 4)
    assert arrays["slots"].tolist() == [4 * BLOCK + 1, 6 * BLOCK + 15, 2 * BLOCK, 2 * BLOCK + 1]
    assert arrays["block_tables"].tolist() == [[3, 4, 0, 0], [6, 2, 0, 0]]
    assert arrays["positions"].tolist() == [17, 15, 16, 17]
    assert (arrays["prefill_first_row"].tolist(), arrays["prefill_tokens"].tolist(),
            arrays["prefill_start"].tolist()) == ([1], [3], [15])
    assert arrays["logit_rows"].tolist() == [0, 3]
    assert all(a.dtype == np.int32 for a in arrays.values())


# --- rows: penalties and candidates ---------------------------------------------------------


def test_packed_penalties_apply_as_the_reference_does() -> None:
    rng = np.random.default_rng(3)
    vocab = 500
    rows = random_row_inputs(rng, 6, vocab)
    logits = rng.normal(0, 3, (6, vocab)).astype(np.float32)
    expected = logits.copy()
    apply_penalties(expected, rows)
    packed = packing.row_arrays(rows, vocab)
    penalties_twin(logits, packed.arrays)
    np.testing.assert_array_equal(logits, expected)
    assert packed.any_penalty == any(r.repetition_penalty != 1 and r.repeated or
                                     (r.presence_penalty or r.frequency_penalty) and r.generated
                                     or r.bias_tokens for r in rows)
    assert any(r.bias_tokens for r in rows)


def test_a_logit_bias_alone_launches_the_penalties_and_holds_its_row_back() -> None:
    """A row with a bias and nothing else packs its bias list (float64 values) and launches
    apply_penalties; it never runs ahead, a plain greedy row does."""
    from actors.compute.cuda_ahead import takes_its_candidate

    rows = [RowInputs(greedy=True), RowInputs(greedy=True, bias_tokens=(4, 9),
                                              bias_values=(100.0, -100.0))]
    packed = packing.row_arrays(rows, 50)
    assert packed.any_penalty
    assert packed.arrays["bias_offsets"].tolist() == [0, 0, 2]
    assert packed.arrays["bias_ids"].tolist() == [4, 9]
    assert packed.arrays["bias_values"].view(np.float64).tolist() == [100.0, -100.0]
    assert [takes_its_candidate(row) for row in rows] == [True, False]
    logits = np.zeros((2, 50), np.float32)
    penalties_twin(logits, packed.arrays)
    assert np.argwhere(logits).tolist() == [[1, 4], [1, 9]]
    with pytest.raises(InvalidRequest) as caught:
        packing.row_arrays([RowInputs(bias_tokens=(50,), bias_values=(1.0,))], 50)
    assert caught.value.field == "bias_tokens"


def random_masks(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """(n, mask_words(vocab)) int32 random token masks (every bit pattern, the sign bit
    included)."""
    return rng.integers(0, 1 << 32, (n, mask_words(vocab)), dtype=np.uint32).view(np.int32)


@pytest.mark.parametrize("vocab", [4096, 3001])
def test_packed_token_masks_apply_as_the_reference_does(vocab: int) -> None:
    """Rows 1 and 3 of 5 masked (one allowing a single token, the last past the vocabulary's
    last whole word when it has a partial one): the twin of apply_token_mask over the packed
    words equals apply_token_masks, the unmasked rows untouched."""
    from tests.cuda_emulator import KernelTwins, Memory

    rng = np.random.default_rng(vocab)
    logits = rng.normal(0, 3, (5, vocab)).astype(np.float32)
    masks = random_masks(rng, 2, vocab)
    masks[1] = 0
    masks[1, (vocab - 1) // 32] = np.uint32(1 << ((vocab - 1) % 32)).view(np.int32)
    rows = [RowInputs(), RowInputs(allowed=masks[0]), RowInputs(),
            RowInputs(allowed=masks[1]), RowInputs()]
    expected = logits.copy()
    apply_token_masks(expected, rows)
    packed = packing.row_arrays(rows, vocab)
    assert packed.n_masked == 2 and packed.arrays["mask_rows"].tolist() == [1, 3]
    np.testing.assert_array_equal(packed.arrays["mask_words"], masks)

    memory = Memory()
    twins = KernelTwins(memory)
    addresses = {}
    for name, array in (("logits", logits), ("mask_rows", packed.arrays["mask_rows"]),
                        ("mask_words", packed.arrays["mask_words"])):
        addresses[name] = memory.allocate(array.nbytes)
        memory.view(addresses[name], array.dtype, array.size)[:] = array.reshape(-1)
    twins.apply_token_mask(plan.token_mask_launch(2, vocab).grid, addresses["logits"], vocab,
                           addresses["mask_rows"], addresses["mask_words"])
    got = twins.f32(addresses["logits"], logits.size).reshape(logits.shape)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert np.isfinite(got[3]).sum() == 1 and np.isfinite(got[3, vocab - 1])


def test_unconstrained_rows_pack_and_launch_nothing_for_masks(
        models: dict[str, GGUFFile]) -> None:
    spec = spec_from_gguf(models["qwen2"])
    plain = packing.row_arrays([RowInputs(), RowInputs()], spec.vocab_size)
    assert plain.n_masked == 0 and not {"mask_rows", "mask_words"} & set(plain.arrays)
    kernels = [call.kernel for call in launches.candidate_calls(spec, 2, 1, False, 0)]
    assert kernels == ["top_candidates"]
    masked = packing.row_arrays(
        [RowInputs(), RowInputs(allowed=np.ones(mask_words(spec.vocab_size), np.int32))],
        spec.vocab_size)
    calls = launches.candidate_calls(spec, 2, 1, True, masked.n_masked)
    # The mask first: the penalties and the candidates then never see a forbidden token.
    assert [call.kernel for call in calls] == ["apply_token_mask", "apply_penalties",
                                               "top_candidates"]
    assert calls[0].launch == plan.token_mask_launch(1, spec.vocab_size)
    assert calls[0].launch.grid[0] * plan.MASK_THREADS >= spec.vocab_size


def test_row_inputs_the_kernels_cannot_serve_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="outside"):
        packing.row_arrays([RowInputs(repetition_penalty=1.2, repeated=(7, 100))], 100)
    with pytest.raises(InvalidRequest) as caught:
        packing.row_arrays([RowInputs(candidates=2000, max_candidates=2000)], 5000)
    assert caught.value.field == "candidates"
    # A token mask must cover the vocabulary exactly: ceil(100 / 32) = 4 words.
    for words in (3, 5):
        with pytest.raises(InvalidRequest, match=f"{words} words.*needs 4") as caught:
            packing.row_arrays([RowInputs(allowed=np.ones(words, np.int32))], 100)
        assert caught.value.field == "allowed"
        with pytest.raises(InvalidRequest, match="needs 4"):
            apply_token_masks(np.zeros((1, 100), np.float32),
                              [RowInputs(allowed=np.ones(words, np.int32))])


def test_candidate_counts_follow_the_contract_and_the_reference() -> None:
    rng = np.random.default_rng(11)
    vocab = 3000
    for trial in range(4):
        rows = random_row_inputs(rng, 8, vocab)
        logits = (rng.standard_normal((8, vocab)) * rng.uniform(0.5, 6)).astype(np.float32)
        apply_penalties(logits, rows)
        packed = packing.row_arrays(rows, vocab)
        records = top_candidates_twin(logits, packed.arrays, packed.width)
        got = packing.candidates_from_records(records, packed.width, rows)
        expected = top_candidates(logits, rows)
        for row, inputs in enumerate(rows):
            count = int(got.count[row])
            most = min(max(inputs.candidates, inputs.max_candidates, 1), vocab)
            assert min(inputs.candidates, vocab) <= count <= most
            # The same tokens in the same order as the reference, as far as both go.
            shared = min(count, int(expected.count[row]))
            np.testing.assert_array_equal(got.ids[row, :shared], expected.ids[row, :shared])
            if inputs.mass > 0 and count < most:
                peak = float(logits[row].max())
                weights = np.exp((logits[row].astype(np.float64) - peak) * inputs.inv_temp)
                taken = weights[got.ids[row, :count]].sum()
                assert taken >= inputs.mass * weights.sum() * (1 - 1e-5)
            assert abs(count - int(expected.count[row])) <= 1 or count == most
            assert (got.ids[row, count:] == 0).all()
            assert np.isneginf(got.logits[row, count:]).all()
        asked = np.array([r.want_log_z or r.mass > 0 for r in rows])
        assert np.isnan(got.log_z[~asked]).all()
        np.testing.assert_allclose(got.log_z[asked], expected.log_z[asked], atol=1e-4)


# --- memory ---------------------------------------------------------------------------------


def test_kv_pool_fills_the_memory_fraction_up_to_what_sequences_use() -> None:
    gib = 1 << 30
    blocks = memory.kv_pool_blocks(80 * gib, 0.9, 5 * gib, gib, 2 << 20, None, useful=10**9)
    assert blocks == (int(80 * gib * 0.9) - 6 * gib - (2 << 20)) // (2 << 20)
    assert memory.kv_pool_blocks(80 * gib, 0.9, 5 * gib, gib, 2 << 20, None, useful=64) == 64
    assert memory.kv_pool_blocks(80 * gib, 0.9, 5 * gib, gib, 2 << 20, 500, useful=64) == 500
    with pytest.raises(ComputeError, match="do not fit"):
        memory.kv_pool_blocks(8 * gib, 0.9, 5 * gib, gib, 2 << 20, 10**6, useful=64)
    with pytest.raises(ComputeError, match="short of one KV block"):
        memory.kv_pool_blocks(6 * gib, 0.9, 5 * gib, gib, 2 << 20, None, useful=64)


def test_weights_upload_as_stored_blocks_at_the_row_pitch(models: dict[str, GGUFFile]) -> None:
    """Every tensor's blocks as stored at the row pitch, once (its Q6_K matrices row-planar
    instead), the arena about the file's size."""
    for name in ("llama-tiny", "qwen2", "llama"):
        gguf = models[name]
        planar = planar_names(launches.tensor_layouts(gguf))
        offsets, size = cuda_weights.weight_arena(gguf)
        arena = np.zeros(size, dtype=np.uint8)
        for info in gguf:
            assert offsets[info.name] % cuda_weights.ARENA_ALIGN == 0
            for at, data in cuda_weights.device_bytes_of(gguf.raw(info.name), info,
                                                         chunk_rows=100):
                start = offsets[info.name] + at
                arena[start : start + data.size] = data
        assert set(offsets) == {info.name for info in gguf}
        assert bool(planar) == (name != "llama")  # smollm2: no Q6_K
        for info in gguf:
            start = offsets[info.name]
            if info.name in planar:
                pitch = plan.row_pitch("Q6_K", info.shape[-1])
                rows = math.prod(info.shape[:-1])
                np.testing.assert_array_equal(
                    arena[start : start + rows * pitch].reshape(rows, pitch),
                    plan.planar_q6_K_rows(gguf.raw(info.name).reshape(rows, -1)))
                continue
            if len(info.shape) == 1:
                stored = arena[start : start + 4 * info.shape[0]].view(np.float32)
                np.testing.assert_array_equal(
                    stored, dequantize(gguf.raw(info.name), info.type_name, info.shape))
                continue
            rows = math.prod(info.shape[:-1])
            pitch = plan.row_pitch(info.type_name, info.shape[-1])
            device_rows = arena[start : start + rows * pitch].reshape(rows, pitch)
            raw = gguf.raw(info.name).reshape(rows, -1)
            np.testing.assert_array_equal(device_rows[:, : raw.shape[1]], raw)
        file_bytes = sum(info.n_bytes for info in gguf)
        assert size <= 1.1 * file_bytes + cuda_weights.ARENA_ALIGN * len(offsets)
        assert sum(map(cuda_weights.device_tensor_bytes, gguf)) <= size


# --- the registry ---------------------------------------------------------------------------


class FakeCudaError(Exception):
    pass


def _fake_pycuda(monkeypatch: pytest.MonkeyPatch, *, count: int = 1,
                 capability: tuple[int, int] = (9, 0), init_error: bool = False) -> None:
    driver = types.ModuleType("pycuda.driver")
    driver.Error = FakeCudaError

    def init() -> None:
        if init_error:
            raise FakeCudaError("cuInit failed: no CUDA-capable device is detected")

    class Device:
        def __init__(self, ordinal: int) -> None:
            self.ordinal = ordinal

        @staticmethod
        def count() -> int:
            return count

        def compute_capability(self) -> tuple[int, int]:
            return capability

    driver.init, driver.Device = init, Device
    package = types.ModuleType("pycuda")
    package.driver = driver
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)


def test_registry_reason_without_pycuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    assert "pycuda is not installed" in CudaFactory().unavailable_reason()


def test_registry_reason_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("pycuda")
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.delitem(sys.modules, "pycuda.driver", raising=False)

    def failing_import(name: str, *args: object, **kwargs: object) -> object:
        if name == "pycuda.driver":
            raise ImportError("libcuda.so.1: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", failing_import)
    assert "no CUDA driver" in CudaFactory().unavailable_reason()


@pytest.mark.parametrize(("fake", "words"), [
    ({"count": 0}, "sees no device"),
    ({"init_error": True}, "CUDA cannot start: cuInit failed"),
    ({"capability": (7, 5)}, "compute capability 7.5 is below 8.0"),
])
def test_registry_reasons_from_the_driver(monkeypatch: pytest.MonkeyPatch, fake: dict,
                                          words: str) -> None:
    _fake_pycuda(monkeypatch, **fake)
    assert words in CudaFactory().unavailable_reason()


def test_registry_needs_nvcc_and_then_has_no_objection(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pycuda(monkeypatch)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "nvcc is not on the PATH" in CudaFactory().unavailable_reason()
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvcc")
    assert CudaFactory().unavailable_reason() is None


def test_a_negative_run_ahead_limit_is_refused_naming_it() -> None:
    """run_ahead_rows is the most rows of a greedy decode step run ahead, 0 for none."""
    with pytest.raises(InvalidRequest, match="run_ahead_rows must be >= 0") as refused:
        CudaFactory(run_ahead_rows=-1)
    assert refused.value.field == "run_ahead_rows"
    CudaFactory(run_ahead_rows=0)
