"""A fake pycuda for the CUDA backend's host tests: device memory as numpy byte arrays at fake
addresses, copies that move bytes, decode graphs that record and replay launches, and kernels
that are numpy twins of cuda_src (run) or are only recorded (not run). With `run_kernels` the
backend's whole step, from packing to the candidate records and fetch_rows, is computed on the
host and can be checked against the CPU model; the kernels themselves are checked against the
same twins' semantics on the device by tests/gpu/test_kernels.py."""

from __future__ import annotations

import bisect
import functools
import hashlib
import importlib
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.compute import cuda_plan as plan
from actors.model.gguf.quants import dequantize, row_bytes
from tests.cuda_samples import gated_twin, penalties_twin, tile_product, top_candidates_twin

GIB = 1 << 30
TYPE_OF_SUFFIX = {suffix: name for name, suffix in plan.KERNEL_TYPE_SUFFIX.items()}
# The PTX type each launch argument's type becomes (an address: u64).
PTX_TYPE = {np.uintp: "u64", np.int64: "u64", np.int32: "u32", np.float32: "f32",
            np.float64: "f64"}


@functools.cache
def ptx_compile_context() -> tuple[str, ...]:
    """What a cuda_src file's PTX depends on besides its own text: the headers, the options
    and the nvcc (read once a run)."""
    headers = [path.read_text() for path in sorted(plan.kernel_source_dir().glob("*.cuh"))]
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    return (*headers, *plan.nvcc_options(), nvcc)


@functools.cache
def ptx_signatures(source: str) -> dict[str, list[str]]:
    """Entry point -> its parameters' PTX types, from nvcc -ptx of `source` (a cuda_src
    file's text, compiled with the backend's options); empty where no nvcc is. Kept in the
    kernel cache folder between runs, keyed by the source, the headers, the options and the
    nvcc (a file's PTX takes seconds)."""
    if shutil.which("nvcc") is None:
        return {}
    key = hashlib.sha256("\0".join([source, *ptx_compile_context()]).encode())
    kept = plan.kernel_cache_dir() / f"ptx-signatures-{key.hexdigest()[:32]}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernels.cu"
        path.write_text(source)
        ptx = subprocess.run(
            ["nvcc", "-ptx", "-arch=sm_80", *plan.nvcc_options(),
             f"-I{plan.kernel_source_dir()}", str(path), "-o", "-"],
            check=True, capture_output=True, text=True).stdout
        signatures = {entry: re.findall(r"\.param\s+\.(\w+)", params)
                      for entry, params in re.findall(r"\.entry (\w+)\(([^)]*)\)", ptx)}
        written = Path(folder) / "signatures.json"
        written.write_text(json.dumps(signatures))
        written.replace(kept)  # whole or not at all, should two runs write it at once
    return signatures


class Memory:
    """Allocations at fake device addresses; `view(address, dtype, count)` is a writable numpy
    view of the bytes there."""

    def __init__(self) -> None:
        self.bases: list[int] = []
        self.blocks: dict[int, np.ndarray] = {}
        # Above 4 GiB, as a device's addresses are: an address squeezed into 32 bits fails
        self.next_address = 1 << 40

    def allocate(self, size: int) -> int:
        address = self.next_address
        self.next_address += -(-max(size, 1) // 256) * 256 + 256
        bisect.insort(self.bases, address)
        self.blocks[address] = np.zeros(max(size, 1), dtype=np.uint8)
        return address

    def free(self, address: int) -> None:
        self.bases.remove(address)
        del self.blocks[address]

    def view(self, address: int, dtype: Any, count: int) -> np.ndarray:
        base = self.bases[bisect.bisect_right(self.bases, int(address)) - 1]
        start = int(address) - base
        size = count * np.dtype(dtype).itemsize
        block = self.blocks[base]
        assert start + size <= block.size, "a kernel reads past its allocation"
        return block[start : start + size].view(dtype)


@functools.cache  # a pure check of the geometry: once per shape
def assert_each_head_counted_complete_once(rows: int, head_dim: int, per_block: int) -> None:
    """mul_mat_vec_qkv's head counting over one segment, its blocks in any order: each block
    counts itself on the heads its rows touch, and a head is finished by the block whose count
    reaches the blocks holding its rows (the kernel's formula); that must happen exactly once
    per head, and only once every block holding its rows has counted."""
    blocks = -(-rows // per_block)
    counts, finished = np.zeros(rows // head_dim, dtype=np.int64), []
    for block in np.random.default_rng(rows).permutation(blocks):
        first, last = block * per_block, min((block + 1) * per_block, rows) - 1
        for head in range(first // head_dim, last // head_dim + 1):
            holding = ((head + 1) * head_dim - 1) // per_block - head * head_dim // per_block + 1
            counts[head] += 1
            if counts[head] == holding:
                finished.append(head)
    assert sorted(finished) == list(range(rows // head_dim))
    stored = [{r // per_block for r in range(h * head_dim, (h + 1) * head_dim)}
              for h in range(rows // head_dim)]
    assert list(counts) == [len(held) for held in stored]


def file_q6_K_rows(planar: np.ndarray, n_in: int) -> np.ndarray:
    """cuda_plan.planar_q6_K_rows undone: (n, >= 210 * nb) row-planar Q6_K rows of n_in
    elements -> (n, 210 * nb) rows of the file's blocks (ql + qh, scales, d each)."""
    n, nb = len(planar), n_in // 256
    fields = [planar[:, first * nb : last * nb].reshape(n, nb, last - first)
              for first, last in ((0, 192), (192, 208), (208, 210))]
    return np.concatenate(fields, axis=2).reshape(n, 210 * nb)


PRODUCT_ROWS = 4096  # weight rows the matvec twins decode at a time (KernelTwins.products)


def activation_and_rest(prefix: str, name: str) -> tuple[str, str]:
    """A fused gate+up entry's activation and what follows it: prefix<act>_<rest>."""
    return next((a, name[len(f"{prefix}{a}_"):]) for a in plan.ACTIVATIONS
                if name.startswith(f"{prefix}{a}_"))


class KernelTwins:
    """numpy twins of the cuda_src entry points, reading and writing `Memory`."""

    def __init__(self, memory: Memory) -> None:
        self.m = memory

    def f32(self, address: Any, count: int) -> np.ndarray:
        return self.m.view(address, np.float32, count)

    def i32(self, address: Any, count: int) -> np.ndarray:
        return self.m.view(address, np.int32, count)

    def rows(self, address: Any, n: int, stride: int, width: int) -> np.ndarray:
        """(n, width) float32 view of rows `stride` floats apart."""
        flat = self.f32(address, (n - 1) * stride + width) if n else self.f32(address, 0)
        return np.lib.stride_tricks.as_strided(flat, (n, width), (4 * stride, 4), writeable=True)

    def matrix(self, address: Any, pitch: int, type_name: str, rows: int,
               n_in: int) -> np.ndarray:
        """The decoded rows at `address`: the file's blocks, or a Q6_K matrix row-planar
        (cuda_plan.holds_planar, planar_q6_K_rows)."""
        raw = self.m.view(address, np.uint8, rows * pitch).reshape(rows, pitch)
        # A copy: quants' Q4_K decode shifts a single block's bytes in place.
        blocks = (file_q6_K_rows(raw, n_in) if plan.holds_planar(type_name)
                  else raw[:, : row_bytes(type_name, n_in)].copy())
        return dequantize(blocks, type_name, (rows, n_in))

    def launch(self, name: str, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        # Every entry reads its Q6_K matrices row-planar (`matrix`); the batched product's and
        # get_rows' say so in their names.
        name = name.removesuffix(plan.PLANAR_KERNEL)
        if name.startswith("mul_mat_vec_mma_"):
            # The tensor cores' matvec (mul_mat_vec_mma_<suffix>, its gate_up_<act>_<suffix>,
            # its qkv): the matvec's arguments and twins; its own summation on the device,
            # within the same float32 bound.
            name = "mul_mat_vec_" + name[len("mul_mat_vec_mma_"):]
        if name.startswith("get_rows_"):
            self.get_rows(TYPE_OF_SUFFIX[name[len("get_rows_"):]], grid, *args)
        elif name == "mul_mat_vec_qkv":
            self.mul_mat_vec_qkv(*args)
        elif name.startswith("mul_mat_vec_gate_up_"):
            activation, suffix = activation_and_rest("mul_mat_vec_gate_up_", name)
            self.gate_up(activation, TYPE_OF_SUFFIX[suffix], *args)
        elif name.startswith("mul_mat_vec_"):
            self.matmul(TYPE_OF_SUFFIX[name[len("mul_mat_vec_"):]], None, *args)
        elif name.startswith("mul_mat_batch"):
            self.batch(name, grid, args)
        else:
            getattr(self, name)(grid, *args)

    def batch(self, name: str, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        """mul_mat_batch<N>_<input>_<suffix>, its gate_up_<act> and qkv entries: the same sums
        whatever N (tile_product's numbers), on a grid of N-token tiles."""
        match = re.fullmatch(r"mul_mat_batch(\d+)_(gate_up_|qkv_)?(.*)", name)
        assert match is not None, name
        tokens, fused, rest = int(match.group(1)), match.group(2), match.group(3)
        qkv = fused == "qkv_"
        n = int(args[17] if qkv else args[-1])  # the rows
        most = plan.BATCH_QKV_TOKENS if qkv else plan.BATCH_TOKENS[-1]
        assert tokens == plan.batch_tokens(n, most), (name, n)
        assert grid[0] * tokens >= n > (grid[0] - 1) * tokens, (name, grid)
        if qkv:
            assert rest in plan.TILE_INPUTS, name
            self.mul_mat_vec_qkv(*args, tile_input=rest, batch_tokens=tokens)
            return
        activation = None
        if fused:
            activation, rest = activation_and_rest("", rest)
        tile_input, suffix = rest.split("_", 1)
        assert tile_input in plan.TILE_INPUTS, name
        if activation is not None:
            self.gate_up(activation, TYPE_OF_SUFFIX[suffix], *args,
                         tile_input=tile_input)
        else:
            self.matmul(TYPE_OF_SUFFIX[suffix], tile_input, *args)

    def get_rows(self, type_name: str, grid: tuple[int, ...], table: Any, pitch: int, ids: Any,
                 out: Any, d: int, scale: float) -> None:
        """The gather of table rows `ids` times scale."""
        n, d = grid[0], int(d)
        for i, token in enumerate(self.i32(ids, n)):
            row = self.matrix(int(table) + int(token) * int(pitch), int(pitch), type_name, 1,
                              d)[0]
            self.f32(int(out) + 4 * i * d, d)[:] = row * scale

    def product(self, type_name: str, tile_input: str | None, weights: Any, pitch: int, x: Any,
                x_stride: int, rows: int, n_in: int, n: int) -> np.ndarray:
        """(n, rows) float32: the matvec's products, one activation row at a time (a row's
        result is the same whatever else shares the launch, as the kernel promises), or with a
        tile input the batched product's. The weights are
        decoded PRODUCT_ROWS rows at a time: a vocabulary's logits matrix decoded whole
        (gemma-3's: 671 MB of float32) cost seconds a step in fresh pages alone."""
        rows, n_in, pitch = int(rows), int(n_in), int(pitch)
        xs = self.rows(x, int(n), int(x_stride), n_in)
        out = np.empty((len(xs), rows), dtype=np.float32)
        for first in range(0, rows, PRODUCT_ROWS):
            count = min(PRODUCT_ROWS, rows - first)
            w = self.matrix(int(weights) + first * pitch, pitch, type_name, count, n_in)
            if tile_input is not None:
                out[:, first : first + count] = tile_product(w, xs, type_name)
                continue
            for i, row in enumerate(xs):
                out[i, first : first + count] = w @ row
        return out

    def matmul(self, type_name: str, tile_input: str | None, weights: Any, pitch: int, x: Any,
               x_stride: int, y: Any, y_stride: int, rows: int, n_in: int, n: int) -> None:
        self.rows(y, int(n), int(y_stride), int(rows))[:] = self.product(
            type_name, tile_input, weights, pitch, x, x_stride, rows, n_in, n)

    def mul_mat_vec_qkv(self, *args: Any, tile_input: str | None = None,
                        batch_tokens: int = 0) -> None:
        """Three matvecs (q, k, v segments, a block type each; those of mul_mat_vec_mma_qkv
        alike), or with a tile input and `batch_tokens` mul_mat_batch<batch_tokens>_qkv's
        tiles, into one row of y, then qkv_finish's twin on those rows (positions and slots
        per activation row). The head counters must be zero (the backend zero-fills them;
        every launch leaves them so)."""
        assert len(args) == 34
        segments, (x, x_stride, y, y_stride, n_in, n) = args[:12], args[12:18]
        head_dim, finish, counters = int(args[18]), args[19:33], args[33]
        types = [list(plan.KERNEL_TYPE_SUFFIX)[int(code)] for code in segments[2::4]]
        rows = [int(r) for r in segments[3::4]]
        per_block, counter_tiles = plan.matvec_rows_per_block(int(n_in)), 1
        if batch_tokens:
            per_block, counter_tiles = plan.BATCH_ROWS, -(-int(n) // batch_tokens)
        column = 0
        for (weights, pitch, _, _), type_name, count in zip(zip(*[iter(segments)] * 4), types,
                                                           rows):
            self.matmul(type_name, tile_input, weights, pitch, x, x_stride,
                        int(y) + 4 * column, y_stride, count, n_in, n)
            column += count
        heads, kv_heads = rows[0] // head_dim, rows[1] // head_dim
        assert not self.i32(counters, (heads + 2 * kv_heads) * counter_tiles).any(), \
            "qkv counters are not zero"
        for count in rows:
            assert count % head_dim == 0
            assert_each_head_counted_complete_once(count, head_dim, per_block)
        self.qkv_finish((1, int(n)), y, y_stride, heads, kv_heads, head_dim, *finish)

    def gate_up(self, activation: str, type_name: str,
                gate: Any, up: Any, pitch: int, x: Any, x_stride: int, y: Any, y_stride: int,
                rows: int, n_in: int, n: int, tile_input: str | None = None) -> None:
        """y = act(gate . x) * (up . x): the two products (the matvec's, or with a tile input
        the tiles') and the gated activation's twin."""
        gates, ups = (self.product(type_name, tile_input, w, pitch, x, x_stride, rows, n_in, n)
                      for w in (gate, up))
        self.rows(y, int(n), int(y_stride), int(rows))[:] = gated_twin(activation, gates, ups)

    @staticmethod
    def _rms(v: np.ndarray, eps: float) -> np.ndarray:
        return np.sqrt((v * v).sum(axis=-1, keepdims=True) / np.float32(v.shape[-1]) +
                       np.float32(eps))

    def residual_rms_norm(self, grid: tuple[int, ...], x: Any, delta: Any, delta_weight: Any,
                          weight: Any, out: Any, d: int, eps: float) -> None:
        n, d = grid[0], int(d)
        rows = self.f32(x, n * d).reshape(n, d)
        if int(delta):
            add = self.f32(delta, n * d).reshape(n, d)
            if int(delta_weight):
                add = add / self._rms(add, eps) * self.f32(delta_weight, d)
            rows += add
        self.f32(out, n * d).reshape(n, d)[:] = rows / self._rms(rows, eps) * self.f32(weight, d)

    def head_rms_norm(self, grid: tuple[int, ...], x: Any, stride: int, heads: int,
                      head_dim: int, weight: Any, eps: float) -> None:
        n, heads, head_dim = grid[1], int(heads), int(head_dim)
        v = self.rows(x, n, int(stride), heads * head_dim).reshape(n, heads, head_dim)
        v[:] = v / self._rms(v, eps) * self.f32(weight, head_dim)

    def rope(self, grid: tuple[int, ...], x: Any, stride: int, positions: Any, heads: int,
             head_dim: int, rope_dim: int, base: float, factors: Any, neox: int) -> None:
        n, heads, head_dim, half = grid[1], int(heads), int(head_dim), int(rope_dim) // 2
        v = self.rows(x, n, int(stride), heads * head_dim).reshape(n, heads, head_dim)
        inv_freq = float(base) ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / int(rope_dim))
        if int(factors):
            inv_freq = inv_freq / self.f32(factors, half).astype(np.float64)
        angles = self.i32(positions, n).astype(np.float64)[:, None] * inv_freq
        cos, sin = (f(angles).astype(np.float32)[:, None, :] for f in (np.cos, np.sin))
        first, second = ((v[..., :half], v[..., half : 2 * half]) if int(neox)
                         else (v[..., 0 : 2 * half : 2], v[..., 1 : 2 * half : 2]))
        x0, x1 = first.copy(), second.copy()
        first[:] = x0 * cos - x1 * sin
        second[:] = x0 * sin + x1 * cos

    def add_bias(self, grid: tuple[int, ...], y: Any, stride: int, bias: Any, n: int,
                 width: int) -> None:
        self.rows(y, int(n), int(stride), int(width))[:] += self.f32(bias, int(width))

    def kv_write(self, grid: tuple[int, ...], k: Any, v: Any, stride: int, slots: Any, n: int,
                 kv_dim: int, k_cache: Any, v_cache: Any) -> None:
        n, kv_dim = int(n), int(kv_dim)
        for t, slot in enumerate(self.i32(slots, n)):
            for source, cache in ((k, k_cache), (v, v_cache)):
                row = self.f32(int(source) + 4 * t * int(stride), kv_dim)
                self.m.view(int(cache) + 2 * int(slot) * kv_dim, np.float16, kv_dim)[:] = row

    def feed_greedy_tokens(self, grid: tuple[int, ...], records: Any, record_words: int,
                           token_ids: Any, n: int) -> None:
        words = self.i32(records, int(n) * int(record_words)).reshape(int(n), int(record_words))
        self.i32(token_ids, int(n))[:] = words[:, 2]

    def qkv_finish(self, grid: tuple[int, ...], qkv: Any, stride: int, heads: int,
                   kv_heads: int, head_dim: int, q_bias: Any, k_bias: Any, v_bias: Any,
                   q_norm: Any, k_norm: Any, eps: float, positions: Any, rope_dim: int,
                   base: float, factors: Any, neox: int, slots: Any, k_cache: Any,
                   v_cache: Any) -> None:
        """The separate kernels' twins in their order: biases, head norms, RoPE, KV write."""
        n, q_dim, kv_dim = grid[1], int(heads) * int(head_dim), int(kv_heads) * int(head_dim)
        k_at, v_at = int(qkv) + 4 * q_dim, int(qkv) + 4 * (q_dim + kv_dim)
        for at, bias, width in ((qkv, q_bias, q_dim), (k_at, k_bias, kv_dim),
                                (v_at, v_bias, kv_dim)):
            if int(bias):
                self.add_bias(grid, at, stride, bias, n, width)
        for at, norm, count in ((qkv, q_norm, heads), (k_at, k_norm, kv_heads)):
            if int(norm):
                self.head_rms_norm((1, n), at, stride, count, head_dim, norm, eps)
        self.rope((1, n), qkv, stride, positions, int(heads) + int(kv_heads), head_dim,
                  rope_dim, base, factors, neox)
        self.kv_write(grid, k_at, v_at, stride, slots, n, kv_dim, k_cache, v_cache)

    def _keys_and_values(self, k_cache: Any, v_cache: Any, table: np.ndarray,
                         block_size: int, kv_heads: int, head_dim: int, keys: range
                         ) -> tuple[np.ndarray, np.ndarray]:
        """K and V at positions `keys` through the block table: (S, kv_heads, head_dim)."""
        kv_dim = kv_heads * head_dim
        slots = [int(table[p // block_size]) * block_size + p % block_size for p in keys]
        k_rows, v_rows = (
            [self.m.view(int(cache) + 2 * s * kv_dim, np.float16, kv_dim) for s in slots]
            for cache in (k_cache, v_cache))
        return tuple(np.stack(rows).astype(np.float32).reshape(len(slots), kv_heads, -1)
                     for rows in (k_rows, v_rows))

    def _head_attention(self, q_row: np.ndarray, kv: tuple[Any, Any], table: np.ndarray,
                        block_size: int, heads: int, kv_heads: int, head_dim: int,
                        keys: Callable[[int], range], scale: float
                        ) -> list[tuple[float, float, np.ndarray]]:
        """Per query head: (max, sum of exp(score - max), sum of exp(score - max) * v)."""
        out = []
        group = heads // kv_heads
        for head in range(heads):
            span = keys(head)
            if not len(span):
                out.append((-np.inf, 0.0, np.zeros(head_dim, dtype=np.float32)))
                continue
            k, v = self._keys_and_values(kv[0], kv[1], table, block_size, kv_heads, head_dim,
                                         span)
            q = q_row[head * head_dim : (head + 1) * head_dim] * np.float32(scale)
            scores = k[:, head // group] @ q
            peak = scores.max()
            weights = np.exp(scores - peak)
            out.append((float(peak), float(weights.sum()), weights @ v[:, head // group]))
        return out

    def attention_decode(self, grid: tuple[int, ...], q: Any, q_stride: int, k_cache: Any,
                         v_cache: Any, tables: Any, table_stride: int, positions: Any,
                         block_size: int, heads: int, kv_heads: int, head_dim: int, scale: float,
                         window: int, split_keys: int, acc: Any, best: Any, total: Any,
                         counters: Any, out: Any, out_stride: int) -> None:
        """Each sequence's used splits (those holding keys) and, where there are several,
        their partials as the kernel writes them; the output merged in split order. The
        counters must be zero (the backend zero-fills them; every launch leaves them so)."""
        splits, head_blocks, n = grid
        heads, head_dim, split_keys = int(heads), int(head_dim), int(split_keys)
        table_stride = int(table_stride)
        group = heads // int(kv_heads)
        assert head_blocks == int(kv_heads) * -(-group // plan.MAX_GROUP_HEADS)
        assert not self.i32(counters, n * head_blocks).any(), "attention counters are not zero"
        for s in range(n):
            position = int(self.i32(positions, n)[s])
            table = self.i32(int(tables) + 4 * s * table_stride, table_stride)
            first = max(0, position - int(window) + 1) if int(window) else 0
            used = min(splits, -(-(position - first + 1) // split_keys))
            q_row = self.f32(int(q) + 4 * s * int(q_stride), heads * head_dim)
            parts = []
            for split in range(used):
                low = first + split * split_keys
                span = range(low, min(position, low + split_keys - 1) + 1)
                parts.append(self._head_attention(q_row, (k_cache, v_cache), table,
                                                  int(block_size), heads, int(kv_heads),
                                                  head_dim, lambda head, span=span: span, scale))
            peaks = np.array([[p[0] for p in part] for part in parts], dtype=np.float32)
            sums = np.array([[p[1] for p in part] for part in parts], dtype=np.float32)
            values = np.array([[p[2] for p in part] for part in parts], dtype=np.float32)
            if used > 1:
                index = (s * heads + np.arange(heads))[None, :] * splits + np.arange(used)[:, None]
                self.f32(best, n * heads * splits)[index] = peaks
                self.f32(total, n * heads * splits)[index] = sums
                self.f32(acc, n * heads * splits * head_dim).reshape(-1, head_dim)[index] = values
            weight = np.exp(peaks - peaks.max(axis=0))  # (used, heads)
            merged = (weight[..., None] * values).sum(axis=0) / (weight * sums).sum(axis=0)[:, None]
            self.f32(int(out) + 4 * s * int(out_stride), heads * head_dim)[:] = merged.ravel()

    def attention_prefill(self, grid: tuple[int, ...], q: Any, q_stride: int, k_cache: Any,
                          v_cache: Any, tables: Any, table_stride: int, first_rows: Any,
                          tokens: Any, starts: Any, block_size: int, heads: int, kv_heads: int,
                          head_dim: int, scale: float, window: int, out: Any,
                          out_stride: int) -> None:
        items, heads, head_dim, table_stride = grid[2], int(heads), int(head_dim), int(table_stride)
        for item in range(items):
            table = self.i32(int(tables) + 4 * item * table_stride, table_stride)
            first_row = int(self.i32(first_rows, items)[item])
            for i in range(int(self.i32(tokens, items)[item])):
                position = int(self.i32(starts, items)[item]) + i
                low = max(0, position - int(window) + 1) if int(window) else 0
                q_row = self.f32(int(q) + 4 * (first_row + i) * int(q_stride), heads * head_dim)
                parts = self._head_attention(q_row, (k_cache, v_cache), table, int(block_size),
                                             heads, int(kv_heads), head_dim,
                                             lambda head: range(low, position + 1), scale)
                row = self.f32(int(out) + 4 * (first_row + i) * int(out_stride), heads * head_dim)
                row[:] = np.concatenate([values / weight for _, weight, values in parts])

    def _gated(self, activation: str, gate_up: Any, out: Any, n: int, ffn: int) -> None:
        both = self.f32(gate_up, int(n) * 2 * int(ffn)).reshape(int(n), 2, int(ffn))
        self.f32(out, int(n) * int(ffn)).reshape(int(n), int(ffn))[:] = gated_twin(
            activation, both[:, 0], both[:, 1])

    def gated_silu(self, grid: tuple[int, ...], *args: Any) -> None:
        self._gated("silu", *args)

    def gated_gelu_tanh(self, grid: tuple[int, ...], *args: Any) -> None:
        self._gated("gelu_tanh", *args)

    def apply_token_mask(self, grid: tuple[int, ...], logits: Any, vocab: int,
                         mask_rows: Any, words: Any) -> None:
        """Each masked row's tokens whose bit (t % 32 of word t // 32) is clear to -inf, the
        others untouched; the launch covers the vocabulary a thread per token."""
        blocks, n_masked, vocab = grid[0], grid[1], int(vocab)
        assert blocks * plan.MASK_THREADS >= vocab > (blocks - 1) * plan.MASK_THREADS
        row_words = -(-vocab // 32)
        rows = self.i32(mask_rows, n_masked)
        masks = self.m.view(words, np.uint32, n_masked * row_words).reshape(n_masked, -1)
        tokens = np.arange(vocab)
        bits = (masks[:, tokens // 32] >> (tokens % 32).astype(np.uint32)) & 1
        masked, token = np.nonzero(bits == 0)
        self.f32(logits, (int(rows.max()) + 1) * vocab)[rows[masked].astype(np.int64) * vocab
                                                          + token] = -np.inf

    def apply_penalties(self, grid: tuple[int, ...], logits: Any, vocab: int,
                        rep_offsets: Any, rep_ids: Any, repetition: Any, count_offsets: Any,
                        count_ids: Any, counts: Any, presence: Any, frequency: Any,
                        bias_offsets: Any, bias_ids: Any, bias_values: Any) -> None:
        n, vocab = grid[0], int(vocab)
        rep_end = int(self.i32(rep_offsets, n + 1)[n])
        count_end = int(self.i32(count_offsets, n + 1)[n])
        bias_end = int(self.i32(bias_offsets, n + 1)[n])
        arrays = {
            "rep_offsets": self.i32(rep_offsets, n + 1), "rep_ids": self.i32(rep_ids, rep_end),
            "count_offsets": self.i32(count_offsets, n + 1),
            "count_ids": self.i32(count_ids, count_end), "counts": self.i32(counts, count_end),
            "bias_offsets": self.i32(bias_offsets, n + 1), "bias_ids": self.i32(bias_ids, bias_end),
            "bias_values": self.m.view(bias_values, np.int32, 2 * bias_end),
            **{name: self.m.view(address, np.int32, 2 * n) for name, address in
               (("repetition", repetition), ("presence", presence), ("frequency", frequency))},
        }
        penalties_twin(self.f32(logits, n * vocab).reshape(n, vocab), arrays)

    def top_candidates(self, grid: tuple[int, ...], logits: Any, vocab: int, least: Any,
                       most: Any, mass: Any, inv_temp: Any, width: int, out: Any,
                       slice_partials: Any, counters: Any) -> None:
        """The records of top_candidates_twin; the slices' partials must fit their buffer
        and the counters be zero (the backend zero-fills them; every launch leaves them so)."""
        slices, n = grid[0], grid[1]
        vocab, width = int(vocab), int(width)
        assert slices == plan.candidate_slices(vocab)
        assert not self.i32(counters, n).any(), "candidate counters are not zero"
        self.i32(slice_partials, n * plan.MAX_SLICES * plan.SLICE_WORDS)
        arrays = {name: self.i32(address, n) for name, address in
                  (("least", least), ("most", most), ("mass", mass), ("inv_temp", inv_temp))}
        records = top_candidates_twin(self.f32(logits, n * vocab).reshape(n, vocab), arrays,
                                      width)
        self.i32(out, records.size)[:] = records.ravel()


# The kernels that choose and feed tokens (EmulatedDevice's run_candidates).
CANDIDATE_KERNELS = frozenset({"apply_token_mask", "apply_penalties", "top_candidates",
                               "feed_greedy_tokens"})


class EmulatedModule:
    """A module loaded from an emulated cubin (pycuda.driver.module_from_buffer): its
    functions launch the kernels' twins on `device`."""

    def __init__(self, device: EmulatedDevice, cubin: bytes) -> None:
        # Where nvcc is, each launch's arguments are checked against the compiled kernel's
        # parameters: their number and types, which a twin cannot see.
        self.device = device
        self.signatures = ptx_signatures(cubin.decode()) if device.check_signatures else {}
        device.modules_made += 1
        weakref.finalize(self, device.release, "module")

    def get_function(self, name: str) -> EmulatedFunction:
        if self.signatures and name not in self.signatures:
            # As cuModuleGetFunction: a name the file does not define is refused.
            raise self.device.LogicError(
                f"cuModuleGetFunction failed: named symbol not found ({name})")
        return EmulatedFunction(self, name)


# cuFuncSetAttribute's attribute the backend sets (pycuda.driver.function_attribute's).
MAX_DYNAMIC_SHARED_SIZE_BYTES = "MAX_DYNAMIC_SHARED_SIZE_BYTES"


class EmulatedFunction:
    """An entry point of an EmulatedModule, as PyCUDA's Function: called with the kernel's
    arguments, grid, block, shared and stream, it launches the kernel's twin. It holds its
    module, as PyCUDA's do (custodian and ward). A launch asking for dynamic shared memory
    is refused unless set_attribute allowed the function that much, as cuLaunchKernel
    refuses one past the 48 KB a block has without asking (every such launch here asks for
    more)."""

    def __init__(self, module: EmulatedModule, name: str) -> None:
        self.module, self.name = module, name
        self.allowed_shared = 0

    def set_attribute(self, attribute: str, value: int) -> None:
        assert attribute == MAX_DYNAMIC_SHARED_SIZE_BYTES, attribute
        self.allowed_shared = int(value)

    def __call__(self, *args: Any, grid: tuple[int, ...], block: tuple[int, ...],
                 shared: int = 0, stream: Any = None) -> None:
        device, name, signatures = self.module.device, self.name, self.module.signatures
        if shared > self.allowed_shared:
            raise device.LogicError(f"cuLaunchKernel failed: {name} asks for {shared} bytes of "
                                    f"dynamic shared memory, allowed {self.allowed_shared}")
        # PyCUDA passes an allocation as its address
        args = tuple(np.uintp(a.address) if isinstance(a, device.allocation_type)
                     else a for a in args)
        assert all(isinstance(a, tuple(PTX_TYPE)) for a in args), name
        if name in signatures:
            assert [PTX_TYPE[type(a)] for a in args] == signatures[name], \
                (name, "arguments unlike the kernel's parameters")
        assert math.prod(block) <= 1024 and min(grid) >= 1, (name, grid, block)
        device.launch(name, grid, args)


class EmulatedDevice:
    """The pycuda.driver and pycuda.compiler the backend imports, and the graph API it calls
    through libcuda, over `Memory`. Counts what the backend asks for; `fail_kernel` makes that
    kernel's launches raise, `context_broken` makes the context probe fail. With
    `graph_seconds`, the stream keeps time as a device would: each graph launch takes that
    long after the stream's earlier work, and a wait (an event's or the stream's) sleeps until
    the work before it is done (the work itself still happens at once)."""

    class Error(Exception):
        pass

    class MemoryError(Error):
        pass

    class LogicError(Error):
        pass

    def __init__(self, run_kernels: bool, free_bytes: int = 100 * GIB,
                 graph_seconds: float = 0.0, run_candidates: bool = False) -> None:
        self.graph_seconds = graph_seconds
        # Without the kernels, the candidates' still (over whatever the logits rows hold):
        # an engine over the device then gets answers.
        self.run_candidates = run_candidates
        self.busy_until = 0.0  # perf_counter time the stream's queued work ends
        self.memory = Memory()
        self.twins = KernelTwins(self.memory)
        self.run_kernels = run_kernels
        self.free_bytes = free_bytes
        self.attributes = {"L2_CACHE_SIZE": 60 << 20}
        self.check_signatures = True
        self.launches: list[str] = []
        self.copies = self.synchronizations = self.detached = 0
        self.context_stack: list[Any] = []
        self.fail_kernel: str | None = None
        self.context_broken = False
        self.capturing: list[tuple[str, tuple[int, ...], tuple[Any, ...]]] | None = None
        self.graphs: dict[int, list[tuple[str, tuple[int, ...], tuple[Any, ...]]]] = {}
        self.captures = self.replays = self.destroyed = 0
        self.captured: list[tuple[str, ...]] = []  # the kernels of each capture, in order
        self.compiled: list[tuple[str, dict[str, Any]]] = []
        # Streams and modules made, and how each went: released while the context was
        # current, or later (after the context's detach: PyCUDA then warns from a destructor).
        self.streams: list[int] = []
        self.modules_made = 0
        self.released: list[str] = []
        self.released_without_context: list[str] = []

    @property
    def live(self) -> set[int]:
        return set(self.memory.bases)

    # --- pycuda.driver ------------------------------------------------------------------

    def driver_module(self) -> types.ModuleType:
        device = self
        module = types.ModuleType("pycuda.driver")
        module.Error, module.MemoryError, module.LogicError = (self.Error, self.MemoryError,
                                                                self.LogicError)
        module.module_from_buffer = functools.partial(EmulatedModule, device)
        module.function_attribute = types.SimpleNamespace(
            MAX_DYNAMIC_SHARED_SIZE_BYTES=MAX_DYNAMIC_SHARED_SIZE_BYTES)

        class Allocation:
            def __init__(self, size: int) -> None:
                self.address = device.memory.allocate(size)

            def __int__(self) -> int:
                return self.address

            def free(self) -> None:
                device.memory.free(self.address)

        class HostBuffer(bytearray):
            def free(self) -> None:
                pass

        class Context:
            def push(self) -> None:
                device.context_stack.append(self)

            def detach(self) -> None:
                device.detached += 1

            @staticmethod
            def pop() -> None:
                device.context_stack.pop()

            @staticmethod
            def synchronize() -> None:
                device.probe()

            @staticmethod
            def get_device() -> Device:
                return Device(0)

        class Device:
            def __init__(self, ordinal: int) -> None:
                pass

            @staticmethod
            def count() -> int:
                return 1

            def compute_capability(self) -> tuple[int, int]:
                return (9, 0)

            def get_attribute(self, attribute: str) -> int:
                return device.attributes[attribute]

            def name(self) -> str:
                return "Emulated H200"

            def retain_primary_context(self) -> Context:
                return Context()

        class Stream:
            handle = 77

            def __init__(self, flags: int = 0) -> None:
                device.streams.append(flags)
                weakref.finalize(self, device.release, "stream")

            def synchronize(self) -> None:
                device.synchronizations += 1
                device.wait_until(device.busy_until)

        class Event:
            recorded = 0.0

            def record(self, stream: Any = None) -> None:
                # when the stream's work before it ends (now, where it has none left)
                self.recorded = max(device.busy_until, time.perf_counter())

            def synchronize(self) -> None:
                device.synchronizations += 1
                device.wait_until(self.recorded)

            def time_since(self, start: Event) -> float:
                """Milliseconds from `start`'s record to this one's, as CUDA's events give."""
                return (self.recorded - start.recorded) * 1e3

        def to_device(array: np.ndarray) -> Allocation:
            allocation = Allocation(array.nbytes)
            device.copy_in(allocation.address, array)
            return allocation

        def memcpy_dtod_async(destination: Any, source: Any, size: int,
                              stream: Any = None) -> None:
            device.memory.view(destination, np.uint8, size)[:] = \
                device.memory.view(source, np.uint8, size)

        module.Context, module.Device, module.Stream = Context, Device, Stream
        module.Event = Event
        module.device_attribute = types.SimpleNamespace(L2_CACHE_SIZE="L2_CACHE_SIZE")
        module.to_device, module.memcpy_dtod_async = to_device, memcpy_dtod_async
        self.allocation_type = Allocation  # gpuarray's and launches' too
        module.init = lambda: None
        module.mem_get_info = self.mem_get_info
        module.mem_alloc = Allocation
        module.pagelocked_empty = lambda n, dtype: np.ndarray(  # .base: the "allocation"
            (n,), dtype, buffer=HostBuffer(n * np.dtype(dtype).itemsize))
        module.memcpy_htod = self.copy_in
        module.memcpy_htod_async = lambda address, data, stream: self.copy_in(address, data)
        module.memcpy_dtoh = self.copy_out
        module.memcpy_dtoh_async = lambda data, address, stream: self.copy_out(data, address)
        module.memset_d32 = self.fill
        module.Function = object
        return module

    def gpuarray_module(self) -> types.ModuleType:
        """pycuda.gpuarray's to_gpu, as tests/gpu use it: an array's allocation (`gpudata`)
        and `get()`."""
        device = self
        module = types.ModuleType("pycuda.gpuarray")

        class GPUArray:
            def __init__(self, array: np.ndarray) -> None:
                self.shape, self.dtype = array.shape, array.dtype
                self.gpudata = device.allocation_type(array.nbytes)
                device.copy_in(self.gpudata.address, array)

            def get(self) -> np.ndarray:
                out = np.empty(self.shape, self.dtype)
                device.copy_out(out, self.gpudata.address)
                return out

        module.to_gpu = GPUArray
        return module

    def release(self, what: str) -> None:
        (self.released if self.context_stack and not self.detached
         else self.released_without_context).append(what)

    def probe(self) -> None:
        if self.context_broken:
            raise self.LogicError("cuCtxSynchronize failed: an illegal memory access was "
                                  "encountered")

    def mem_get_info(self) -> tuple[int, int]:
        self.probe()
        return self.free_bytes, 141 * GIB

    def copy_in(self, address: Any, data: np.ndarray) -> None:
        self.copies += 1
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.memory.view(address, np.uint8, raw.size)[:] = raw

    def fill(self, address: Any, value: int, count: int) -> None:
        self.memory.view(address, np.uint32, count)[:] = value

    def copy_out(self, data: np.ndarray, address: Any) -> None:
        self.copies += 1
        out = data.view(np.uint8).reshape(-1)
        out[:] = self.memory.view(address, np.uint8, out.size)

    # --- pycuda.compiler ----------------------------------------------------------------

    def compiler_module(self) -> types.ModuleType:
        device = self
        module = types.ModuleType("pycuda.compiler")

        def compile(source: str, **options: Any) -> bytes:
            # The emulated cubin is the source itself: a module made from it reads its
            # kernels' parameters there.
            device.compiled.append((source, options))
            return source.encode()

        class SourceModule(EmulatedModule):
            def __init__(self, source: str, **options: Any) -> None:
                super().__init__(device, compile(source, **options))

        module.compile, module.SourceModule = compile, SourceModule
        return module

    def launch(self, name: str, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        if name == self.fail_kernel:
            raise self.LogicError(f"cuLaunchKernel failed: {name}")
        if self.capturing is not None:
            self.capturing.append((name, grid, args))
            return
        self.launches.append(name)
        if self.run_kernels or (self.run_candidates and name in CANDIDATE_KERNELS):
            self.twins.launch(name, grid, args)

    # --- the graph API (actors.compute.cuda.DriverGraphs) -------------------------------

    def capture(self, stream: Any, enqueue: Callable[[], None]) -> int:
        self.capturing = []
        try:
            enqueue()
            self.captures += 1
            self.graphs[self.captures] = self.capturing
            self.captured.append(tuple(name for name, _, _ in self.capturing))
        finally:
            self.capturing = None
        return self.captures

    def wait_until(self, moment: float) -> None:
        """Sleep until the emulated stream's work queued before `moment` is done."""
        left = moment - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def launch_graph(self, executable: int, stream: Any) -> None:
        if self.graph_seconds:
            self.busy_until = max(self.busy_until, time.perf_counter()) + self.graph_seconds
        self.replays += 1
        for name, grid, args in self.graphs[executable]:
            self.launch(name, grid, args)

    def destroy(self, executable: int) -> None:
        self.destroyed += 1
        del self.graphs[executable]

    def graph_api(self) -> Any:
        api = types.SimpleNamespace(capture=self.capture, launch=self.launch_graph,
                                    destroy=self.destroy)
        return lambda: api


# The modules that import pycuda, imported again over each emulated device.
BACKEND_MODULES = ("actors.compute.cuda", "actors.compute.cuda_buffers")


def install(monkeypatch: pytest.MonkeyPatch, device: EmulatedDevice) -> Any:
    """Import actors.compute.cuda over `device` (undone by the monkeypatch, except the module,
    which the caller drops from sys.modules); returns the module."""
    package = types.ModuleType("pycuda")
    package.driver, package.compiler = device.driver_module(), device.compiler_module()
    package.gpuarray = device.gpuarray_module()
    # importing it makes the primary context current, as PyCUDA's does
    package.autoprimaryctx = types.ModuleType("pycuda.autoprimaryctx")
    package.autoprimaryctx.context = package.driver.Context()
    for name in ("driver", "compiler", "gpuarray", "autoprimaryctx"):
        monkeypatch.setitem(sys.modules, f"pycuda.{name}", getattr(package, name))
    monkeypatch.setitem(sys.modules, "pycuda", package)
    for name in BACKEND_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("actors.compute.cuda")
    device.real_driver_graphs = module.DriverGraphs  # for tests of it over a fake libcuda
    monkeypatch.setattr(module, "DriverGraphs", device.graph_api())
    return module


def emulated_backend_module(monkeypatch: pytest.MonkeyPatch,
                            run_kernels: bool) -> Iterator[tuple[Any, EmulatedDevice]]:
    """actors.compute.cuda over a new EmulatedDevice (its kernels' twins run or only
    recorded), and the device; the module is dropped again after (a fixture's body)."""
    device = EmulatedDevice(run_kernels=run_kernels)
    try:
        yield install(monkeypatch, device), device
    finally:
        for name in BACKEND_MODULES:
            sys.modules.pop(name, None)
