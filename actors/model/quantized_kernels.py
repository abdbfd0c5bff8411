"""Compiled kernels over a GGUF matrix's own blocks (numba): `x @ W.T` for a few rows of x,
and rows of W dequantized to float32.

Each block type the project reads has one decoder, `_factors_<type>(row, u)`: the quantized
values of a 32-element unit of a row of blocks, as two halves of 16, with each half's step and
the unit's offset; its levels `_levels_<type>` are q * step (+ offset), the float32 values
`quants.dequantize` gives, computed with the same operations in the same order (no fast-math:
every multiply and add rounds as written). Sixteen elements is the widest run every format
stores under one scale at consecutive byte addresses (a Q4_0 block's halves are its low and its
high nibbles; a Q6_K scale covers 16). Rows of x that pass through W together share each
unit's levels; a row alone takes the unit as its factors instead, step * sum(q x) + offset *
sum(x), the same levels in half the operations (the sums round differently, as another order
of the sums would; a one-hot row still gives each level bit for bit).

The decoders work on explicit 16-lane vectors (`_F32X`, `_I32X`: LLVM vector values, one
AVX-512 register, two AVX2 or four NEON ones), because LLVM's auto-vectorizer turns loops this
short into scalar code. The kernels' accumulators are such vectors too, so they stay in
registers.

One kernel, `run_rows`, runs a job (MATVEC or DEQUANTIZE) on chunks of a matrix's rows, the
matrix's parts (q | k | v, each its own type) in one call; every thread that calls it with the
same counters takes chunks from them until none are left (actors.model.quantized runs it in
the calling thread and in helper threads that join when they are free: no thread waits for
another to start, which a fork-join team must, and which on a busy machine costs a time slice
a call). `_rows_job_of_type` is the small dispatcher that runs the job compiled for a part's
block type. The kernel is compiled once for every type (cache=True keeps it on disk).
Decoders are passed as values only into functions numba inlines: a function passed on through
an ordinary call leaves a pointer in the compiled code, which the on-disk cache cannot hold.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
from llvmlite import ir
import numba
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

# GGUF type name -> the code the kernel dispatches on.
TYPE_CODES = {name: code for code, name in enumerate(
    ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)}
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = TYPE_CODES.values()
# Elements per vector and per decoded group: a row must hold whole groups.
LANES = 16
# Rows of x multiplied together against one weight row, whose units are decoded once for them:
# WIDE_TILE with half-vector accumulators (eight fit in AVX2's registers beside a unit's
# levels), then TILE with whole ones.
WIDE_TILE = 8
TILE = 4
HALF = LANES // 2
# The bytes of W's rows that the rows of x pass through together (each pass decodes them
# again): well inside a core's L2 cache.
BLOCK_BYTES = 1 << 16
# What `run_rows` does.
MATVEC, DEQUANTIZE = 0, 1


# --- 16-lane vectors -------------------------------------------------------------------------


class _Vector(types.Type):
    """An LLVM vector of `lanes` float32 ("f32") or int32 ("i32") values."""

    def __init__(self, kind: str, lanes: int = LANES) -> None:
        self.kind = kind
        self.lanes = lanes
        super().__init__(name=f"{kind}x{lanes}")

    @property
    def lane(self) -> ir.Type:
        return ir.FloatType() if self.kind == "f32" else ir.IntType(32)

    @property
    def ir_type(self) -> ir.VectorType:
        return ir.VectorType(self.lane, self.lanes)


_F32X = _Vector("f32")
_I32X = _Vector("i32")
# Half a vector: one AVX2 register. The wide tile's accumulators are these, so that eight rows
# of x fit in the registers beside a unit's levels.
_F32H = _Vector("f32", HALF)


@register_model(_Vector)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.ir_type)


def _loader(array_dtype: types.Type, element: ir.Type, result: _Vector, widen: str):
    """An intrinsic (array, start) -> `result`: `result.lanes` `element`s at `start` of a contiguous
    1-d array of `array_dtype` (`start` counts the array's items: bytes for a byte array),
    widened by the IRBuilder method `widen` ("" keeps them as they are)."""

    @intrinsic
    def load(typingctx, array, start):
        if not (isinstance(array, types.Array) and array.dtype == array_dtype
                and isinstance(start, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            index = context.cast(builder, args[1], signature.args[1], types.intp)
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            pointer = builder.bitcast(builder.gep(data, [index]),
                                      ir.PointerType(ir.VectorType(element, result.lanes)))
            value = builder.load(pointer, align=1)
            return getattr(builder, widen)(value, result.ir_type) if widen else value

        return result(array, start), codegen

    return load


# 16 float32 of a float32 array; from a byte array: 16 bytes zero- or sign-extended, 16 IEEE
# halves (widened exactly), 16 little-endian uint16, 16 float32.
_load_f32 = _loader(types.float32, ir.FloatType(), _F32X, "")
_load_u8 = _loader(types.uint8, ir.IntType(8), _I32X, "zext")
_load_i8 = _loader(types.uint8, ir.IntType(8), _I32X, "sext")
_load_f16 = _loader(types.uint8, ir.HalfType(), _F32X, "fpext")
_load_u16 = _loader(types.uint8, ir.IntType(16), _I32X, "zext")
_load_f32_bytes = _loader(types.uint8, ir.FloatType(), _F32X, "")
_load_f32_half = _loader(types.float32, ir.FloatType(), _F32H, "")


@intrinsic
def _store_f32(typingctx, array, start, value):
    """array[start : start + LANES] = value, for a contiguous 1-d float32 array."""
    if not (isinstance(array, types.Array) and array.dtype == types.float32
            and isinstance(start, types.Integer) and value == _F32X):
        return None

    def codegen(context, builder, signature, args):
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [index]), ir.PointerType(_F32X.ir_type))
        builder.store(args[2], pointer, align=1)

    return types.void(array, start, value), codegen


def _splat(builder, value: ir.Value, vector: _Vector) -> ir.Value:
    """`value` (already of the lane type) in every lane."""
    single = builder.insert_element(ir.Constant(vector.ir_type, ir.Undefined), value,
                                    ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(single, single, ir.Constant(
        ir.VectorType(ir.IntType(32), vector.lanes), [0] * vector.lanes))


def _constant(vector: _Vector, lanes: list[float] | list[int]):
    """An intrinsic () -> the constant vector of `lanes`."""

    @intrinsic
    def constant(typingctx):
        def codegen(context, builder, signature, args):
            return ir.Constant(vector.ir_type, lanes)

        return vector(), codegen

    return constant


def _lanewise(source: _Vector, result: _Vector, build: Callable[..., ir.Value]):
    """An intrinsic (`source` vector) -> `result` vector: build(builder, value)."""

    @intrinsic
    def convert(typingctx, value):
        if value != source:
            return None

        def codegen(context, builder, signature, args):
            return build(builder, args[0])

        return result(value), codegen

    return convert


_zeros = _constant(_F32X, [0.0] * LANES)
_zeros_half = _constant(_F32H, [0.0] * _F32H.lanes)
_lane_index = _constant(_I32X, list(range(LANES)))  # 0, 1, ..., LANES - 1
# Each int32 lane as the float32 of its value (exact below 2**24); its bits read as a float32.
_to_float = _lanewise(_I32X, _F32X, lambda builder, value: builder.sitofp(value, _F32X.ir_type))
_bits_as_float = _lanewise(_I32X, _F32X,
                           lambda builder, value: builder.bitcast(value, _F32X.ir_type))


@intrinsic
def _fill_half(typingctx, value):
    """The float32 `value` in every lane of a half vector."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return _splat(builder, args[0], _F32H)

    return _F32H(value), codegen


@intrinsic
def _fill_i32(typingctx, value):
    """The low 32 bits of the integer `value` in every lane."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return _splat(builder, builder.trunc(args[0], ir.IntType(32)) if args[0].type.width > 32
                      else builder.zext(args[0], ir.IntType(32)), _I32X)

    return _I32X(value), codegen


@intrinsic
def _multiply_add(typingctx, a, b, c):
    """a * b + c lane by lane, fused where the machine has FMA (accumulating a product: the
    levels it multiplies are already rounded)."""
    if not (isinstance(a, _Vector) and a.kind == "f32" and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        vector = a.ir_type
        fmuladd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fmuladd.v{a.lanes}f32")
        return builder.call(fmuladd, args)

    return a(a, b, c), codegen


@intrinsic
def _lane_sum(typingctx, value):
    """The float32 sum of the lanes, halves added pairwise (a fixed order)."""
    if not (isinstance(value, _Vector) and value.kind == "f32"):
        return None

    def codegen(context, builder, signature, args):
        vector, width = args[0], value.lanes
        while width > 1:
            width //= 2
            mask = ir.VectorType(ir.IntType(32), width)
            low = builder.shuffle_vector(vector, vector, ir.Constant(mask, list(range(width))))
            high = builder.shuffle_vector(vector, vector,
                                          ir.Constant(mask, list(range(width, 2 * width))))
            vector = builder.fadd(low, high)
        return builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))

    return types.float32(value), codegen


@intrinsic
def _halves(typingctx, value):
    """A float32 vector's low and high halves (for AVX2: its two registers, so free)."""
    if value != _F32X:
        return None
    half = types.UniTuple(_F32H, 2)

    def codegen(context, builder, signature, args):
        mask = ir.VectorType(ir.IntType(32), _F32H.lanes)
        low, high = (builder.shuffle_vector(args[0], args[0],
                                            ir.Constant(mask, list(range(start,
                                                                         start + _F32H.lanes))))
                     for start in (0, _F32H.lanes))
        return context.make_tuple(builder, half, [low, high])

    return half(value), codegen


def _binary(float_op: str | None, int_op: str | None):
    """An intrinsic (vector, vector or scalar) -> vector applying IRBuilder's `float_op` to
    float32 vectors or `int_op` to int32 vectors lane by lane, a scalar in every lane."""

    @intrinsic
    def apply(typingctx, a, b):
        if not isinstance(a, _Vector) or (float_op if a.kind == "f32" else int_op) is None:
            return None
        if not (b == a or isinstance(b, (types.Integer, types.Float))):
            return None

        def codegen(context, builder, signature, args):
            left, right = args
            if not isinstance(signature.args[1], _Vector):
                lane = types.float32 if a.kind == "f32" else types.int32
                right = _splat(builder, context.cast(builder, right, signature.args[1], lane), a)
            return getattr(builder, float_op if a.kind == "f32" else int_op)(left, right)

        return a(a, b), codegen

    return apply


def _overload_operator(python_operator: Callable[..., object], apply: object) -> None:
    def vector_operator(a, b):
        if isinstance(a, _Vector):
            return lambda a, b: apply(a, b)
        return None

    overload(python_operator)(vector_operator)


# Lane-by-lane operators on vectors (a scalar right operand fills every lane). >> is logical:
# the kernels only shift bytes and bit fields.
_overload_operator(operator.add, _binary("fadd", "add"))
_overload_operator(operator.sub, _binary("fsub", "sub"))
_overload_operator(operator.mul, _binary("fmul", "mul"))
_overload_operator(operator.and_, _binary(None, "and_"))
_overload_operator(operator.or_, _binary(None, "or_"))
_overload_operator(operator.rshift, _binary(None, "lshr"))
_overload_operator(operator.lshift, _binary(None, "shl"))


@intrinsic
def _half_to_float(typingctx, bits):
    """The float32 value of the IEEE half whose bits are `bits` (exact)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        half_bits = builder.trunc(args[0], ir.IntType(16)) if args[0].type.width > 16 else args[0]
        return builder.fpext(builder.bitcast(half_bits, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


# --- reading a row of blocks -----------------------------------------------------------------


@njit(inline="always")
def _f16(row, at):
    """The float32 of the little-endian half at byte `at`."""
    return _half_to_float(np.uint32(row[at]) | (np.uint32(row[at + 1]) << 8))


@njit(inline="always")
def _u32(row, at):
    return (np.uint32(row[at]) | (np.uint32(row[at + 1]) << 8)
            | (np.uint32(row[at + 2]) << 16) | (np.uint32(row[at + 3]) << 24))


@njit(inline="always")
def _nibble_pair(row, at):
    """The low nibbles and the high nibbles of the 16 bytes at `at`."""
    packed = _load_u8(row, at)
    return packed & 15, packed >> 4


# --- the factors of a unit (32 elements: 32u .. 32u + 31) of a row, one decoder per type ------
# Each quantized type's `_factors_<type>(row, u)` returns (q_low, q_high, step_low, step_high,
# offset): the quantized values of the unit's two halves (16 each, as float32: exact, being
# small integers), each half's step and the unit's offset (0 where the format has none). Its
# `_levels_<type>` is q * step (+ offset) in float32, the operations `quants.dequantize` does.
# A unit shares one block header in every format (a Q4_0..Q8_0 block, a Q4_K/Q5_K sub-block, a
# Q6_K quarter of a half), read once. The float types' levels are their values, step 1.


def _plus_offset(value, offset):
    """value + offset; value itself where the format has no offset (offset None, known when
    the kernel compiles, so such formats pay no add)."""
    return value if offset is None else value + offset


@overload(_plus_offset)
def _plus_offset_compiled(value, offset):
    if isinstance(offset, types.NoneType):
        return lambda value, offset: value
    return lambda value, offset: value + offset


def _levels_of(factors):
    """A quantized format's levels: q * step (+ offset) for each half."""

    @njit(inline="always")
    def levels(row, u):
        q_low, q_high, step_low, step_high, offset = factors(row, u)
        return (_plus_offset(q_low * step_low, offset),
                _plus_offset(q_high * step_high, offset))

    return levels


def _unscaled(levels):
    """A float type's factors: its values, step 1, no offset."""

    @njit(inline="always")
    def factors(row, u):
        low, high = levels(row, u)
        return low, high, np.float32(1), np.float32(1), None

    return factors


@njit(inline="always")
def _levels_f32(row, u):
    return _load_f32_bytes(row, 128 * u), _load_f32_bytes(row, 128 * u + 64)


@njit(inline="always")
def _levels_f16(row, u):
    return _load_f16(row, 64 * u), _load_f16(row, 64 * u + 32)


@njit(inline="always")
def _levels_bf16(row, u):
    return (_bits_as_float(_load_u16(row, 64 * u) << 16),
            _bits_as_float(_load_u16(row, 64 * u + 32) << 16))


@njit(inline="always")
def _factors_q4_0(row, u):
    at = 18 * u  # d, 16 bytes: element j < 16 is byte j's low nibble, else its high
    d = _f16(row, at)
    low, high = _nibble_pair(row, at + 2)
    return _to_float(low - 8), _to_float(high - 8), d, d, None


@njit(inline="always")
def _factors_q4_1(row, u):
    at = 20 * u  # d, m, 16 bytes of nibbles
    d = _f16(row, at)
    low, high = _nibble_pair(row, at + 4)
    return _to_float(low), _to_float(high), d, d, _f16(row, at + 2)


@njit(inline="always")
def _q5_values(row, qh_at, qs_at):
    """Q5_0/Q5_1: the nibbles, with fifth bits from the 32-bit word at qh_at."""
    fifths = _fill_i32(_u32(row, qh_at))
    lanes = _lane_index()
    low, high = _nibble_pair(row, qs_at)
    return (low | (((fifths >> lanes) & 1) << 4),
            high | (((fifths >> (lanes + LANES)) & 1) << 4))


@njit(inline="always")
def _factors_q5_0(row, u):
    at = 22 * u  # d, qh, 16 bytes of nibbles
    d = _f16(row, at)
    low, high = _q5_values(row, at + 2, at + 6)
    return _to_float(low - 16), _to_float(high - 16), d, d, None


@njit(inline="always")
def _factors_q5_1(row, u):
    at = 24 * u  # d, m, qh, 16 bytes of nibbles
    d = _f16(row, at)
    low, high = _q5_values(row, at + 4, at + 8)
    return _to_float(low), _to_float(high), d, d, _f16(row, at + 2)


@njit(inline="always")
def _factors_q8_0(row, u):
    at = 34 * u  # d, 32 signed bytes
    d = _f16(row, at)
    return (_to_float(_load_i8(row, at + 2)), _to_float(_load_i8(row, at + 18)), d, d,
            None)


@njit(inline="always")
def _k_step_offset(row, at, sub):
    """Q4_K/Q5_K: d * scale and -(dmin * min) of 32-element sub-block `sub`, the 6-bit scales
    and mins packed in the 12 bytes at at + 4: bytes 0-3 scales 0-3 (and the top bits of
    scales 4-7), bytes 4-7 the same for mins, bytes 8-11 the low nibbles of both 4-7."""
    packed = at + 4
    if sub < 4:
        scale, minimum = row[packed + sub] & 63, row[packed + 4 + sub] & 63
    else:
        low = row[packed + 4 + sub]
        scale = (low & 15) | ((row[packed + sub - 4] >> 6) << 4)
        minimum = (low >> 4) | ((row[packed + sub] >> 6) << 4)
    return _f16(row, at) * np.float32(scale), -(_f16(row, at + 2) * np.float32(minimum))


@njit(inline="always")
def _factors_q4_k(row, u):
    at = 144 * (u >> 3)  # d, dmin, 12 scale bytes, 4 x 32 bytes: sub-blocks 2c, 2c+1 in c
    sub = u & 7
    step, offset = _k_step_offset(row, at, sub)
    packed = at + 16 + 32 * (sub >> 1)
    shift = 4 * (sub & 1)
    low, high = _load_u8(row, packed) >> shift, _load_u8(row, packed + LANES) >> shift
    return _to_float(low & 15), _to_float(high & 15), step, step, offset


@njit(inline="always")
def _factors_q5_k(row, u):
    at = 176 * (u >> 3)  # d, dmin, 12 scale bytes, 32 bytes of fifth bits, 128 of nibbles
    sub = u & 7
    step, offset = _k_step_offset(row, at, sub)
    packed = at + 48 + 32 * (sub >> 1)
    shift = 4 * (sub & 1)
    low = ((_load_u8(row, packed) >> shift) & 15) | (((_load_u8(row, at + 16) >> sub) & 1) << 4)
    high = (((_load_u8(row, packed + LANES) >> shift) & 15)
            | (((_load_u8(row, at + 16 + LANES) >> sub) & 1) << 4))
    return _to_float(low), _to_float(high), step, step, offset


@njit(inline="always")
def _factors_q6_k(row, u):
    # 128 ql bytes, 64 qh bytes, 16 int8 scales (one per 16 elements), d. Each 128-element
    # half has 64 ql and 32 qh bytes; its quarter q takes ql bytes from 32 (q & 1) on, their
    # nibble q >> 1, and bits 2q, 2q + 1 of the qh bytes.
    at = 210 * (u >> 3)
    unit = u & 7
    half, quarter = unit >> 2, unit & 3
    ql = at + 64 * half + 32 * (quarter & 1)
    qh = at + 128 + 32 * half
    nibble_shift, high_shift = 4 * (quarter >> 1), 2 * quarter
    d = _f16(row, at + 208)
    scales = at + 192 + 2 * unit
    low = ((_load_u8(row, ql) >> nibble_shift) & 15) | (((_load_u8(row, qh) >> high_shift) & 3) << 4)
    high = (((_load_u8(row, ql + LANES) >> nibble_shift) & 15)
            | (((_load_u8(row, qh + LANES) >> high_shift) & 3) << 4))
    return (_to_float(low - 32), _to_float(high - 32), d * np.float32(np.int8(row[scales])),
            d * np.float32(np.int8(row[scales + 1])), None)


_factors_f32, _factors_f16, _factors_bf16 = map(_unscaled, (_levels_f32, _levels_f16,
                                                            _levels_bf16))
(_levels_q4_0, _levels_q4_1, _levels_q5_0, _levels_q5_1, _levels_q8_0, _levels_q4_k,
 _levels_q5_k, _levels_q6_k) = map(_levels_of, (
    _factors_q4_0, _factors_q4_1, _factors_q5_0, _factors_q5_1, _factors_q8_0, _factors_q4_k,
    _factors_q5_k, _factors_q6_k))


# --- the jobs on one row of W, for one block type --------------------------------------------


@njit(inline="always")
def _unit_product(xr, at, low, high, acc):
    """acc (a half vector) + a unit's levels (`low`, `high`) times x row `xr` from `at`."""
    low0, low1 = _halves(low)
    high0, high1 = _halves(high)
    acc = _multiply_add(_load_f32_half(xr, at), low0, acc)
    acc = _multiply_add(_load_f32_half(xr, at + HALF), low1, acc)
    acc = _multiply_add(_load_f32_half(xr, at + LANES), high0, acc)
    return _multiply_add(_load_f32_half(xr, at + LANES + HALF), high1, acc)


@njit(inline="always")
def _wide_tile(levels, row, x, out, r, j):
    """out[r : r + WIDE_TILE, j] = x[r : r + WIDE_TILE] @ (levels of `row`): each unit decoded
    once for the eight rows, one half-vector accumulator a row."""
    x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
    x4, x5, x6, x7 = x[r + 4], x[r + 5], x[r + 6], x[r + 7]
    acc0 = acc1 = acc2 = acc3 = acc4 = acc5 = acc6 = acc7 = _zeros_half()
    for u in range(x.shape[1] // (2 * LANES)):
        low, high = levels(row, u)
        at = 2 * LANES * u
        acc0 = _unit_product(x0, at, low, high, acc0)
        acc1 = _unit_product(x1, at, low, high, acc1)
        acc2 = _unit_product(x2, at, low, high, acc2)
        acc3 = _unit_product(x3, at, low, high, acc3)
        acc4 = _unit_product(x4, at, low, high, acc4)
        acc5 = _unit_product(x5, at, low, high, acc5)
        acc6 = _unit_product(x6, at, low, high, acc6)
        acc7 = _unit_product(x7, at, low, high, acc7)
    out[r, j] = _lane_sum(acc0)
    out[r + 1, j] = _lane_sum(acc1)
    out[r + 2, j] = _lane_sum(acc2)
    out[r + 3, j] = _lane_sum(acc3)
    out[r + 4, j] = _lane_sum(acc4)
    out[r + 5, j] = _lane_sum(acc5)
    out[r + 6, j] = _lane_sum(acc6)
    out[r + 7, j] = _lane_sum(acc7)


@njit(inline="always")
def _tile(levels, row, x, out, r, j):
    """out[r : r + TILE, j] = x[r : r + TILE] @ (levels of `row`)."""
    x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
    acc0 = acc1 = acc2 = acc3 = _zeros()
    for u in range(x.shape[1] // (2 * LANES)):
        low, high = levels(row, u)
        at = 2 * LANES * u
        acc0 = _multiply_add(_load_f32(x0, at), low, acc0)
        acc1 = _multiply_add(_load_f32(x1, at), low, acc1)
        acc2 = _multiply_add(_load_f32(x2, at), low, acc2)
        acc3 = _multiply_add(_load_f32(x3, at), low, acc3)
        acc0 = _multiply_add(_load_f32(x0, at + LANES), high, acc0)
        acc1 = _multiply_add(_load_f32(x1, at + LANES), high, acc1)
        acc2 = _multiply_add(_load_f32(x2, at + LANES), high, acc2)
        acc3 = _multiply_add(_load_f32(x3, at + LANES), high, acc3)
    out[r, j] = _lane_sum(acc0)
    out[r + 1, j] = _lane_sum(acc1)
    out[r + 2, j] = _lane_sum(acc2)
    out[r + 3, j] = _lane_sum(acc3)


@njit(inline="always")
def _single(factors, row, x, sums, out, r, j):
    """out[r, j] = x[r] @ (levels of `row`), a unit's levels taken as their factors: each
    half's products with the quantized values, summed, times its step, and the offsets times
    the unit's sum of x (`sums[r]`). The same levels, in fewer operations than forming each
    (one row of x gains nothing from levels shared between rows)."""
    xr, sums_r = x[r], sums[r]
    # Four vector chains and two scalar ones: each add waits on its own last, two units ago.
    acc0 = acc1 = acc2 = acc3 = _zeros_half()
    offsets0 = offsets1 = np.float32(0)
    n_units = x.shape[1] // (2 * LANES)
    u = 0
    while u + 8 <= n_units:  # a K-block's units together: u is a multiple of 8
        acc0, acc1, acc2, acc3, offsets0, offsets1 = _factored_pair(
            factors, row, xr, sums_r, u, acc0, acc1, acc2, acc3, offsets0, offsets1)
        acc0, acc1, acc2, acc3, offsets0, offsets1 = _factored_pair(
            factors, row, xr, sums_r, u + 2, acc0, acc1, acc2, acc3, offsets0, offsets1)
        acc0, acc1, acc2, acc3, offsets0, offsets1 = _factored_pair(
            factors, row, xr, sums_r, u + 4, acc0, acc1, acc2, acc3, offsets0, offsets1)
        acc0, acc1, acc2, acc3, offsets0, offsets1 = _factored_pair(
            factors, row, xr, sums_r, u + 6, acc0, acc1, acc2, acc3, offsets0, offsets1)
        u += 8
    while u < n_units:
        acc0, acc1, offsets0 = _factored_unit(factors, row, xr, sums_r, u, acc0, acc1, offsets0)
        u += 1
    out[r, j] = _lane_sum((acc0 + acc1) + (acc2 + acc3)) + (offsets0 + offsets1)


@njit(inline="always")
def _factored_pair(factors, row, xr, sums_r, u, acc0, acc1, acc2, acc3, offsets0, offsets1):
    """Units u and u + 1, each on its own chains (acc0, acc1, offsets0; acc2, acc3, offsets1)."""
    acc0, acc1, offsets0 = _factored_unit(factors, row, xr, sums_r, u, acc0, acc1, offsets0)
    acc2, acc3, offsets1 = _factored_unit(factors, row, xr, sums_r, u + 1, acc2, acc3, offsets1)
    return acc0, acc1, acc2, acc3, offsets0, offsets1


@njit(inline="always")
def _factored_unit(factors, row, xr, sums_r, u, acc_low, acc_high, offsets):
    """The accumulators after unit `u`: each half's sum of q x (eight lanes) times its step
    into acc_low / acc_high, offset times the unit's sum of x into `offsets`."""
    q_low, q_high, step_low, step_high, offset = factors(row, u)
    at = 2 * LANES * u
    low0, low1 = _halves(q_low)
    high0, high1 = _halves(q_high)
    low = _multiply_add(_load_f32_half(xr, at + HALF), low1, _load_f32_half(xr, at) * low0)
    high = _multiply_add(_load_f32_half(xr, at + LANES + HALF), high1,
                         _load_f32_half(xr, at + LANES) * high0)
    return (_multiply_add(low, _fill_half(step_low), acc_low),
            _multiply_add(high, _fill_half(step_high), acc_high),
            _plus_offset(offsets, _times(offset, sums_r[u])))


def _times(offset, unit_sum):
    """offset * unit_sum; None where the format has no offset."""
    return None if offset is None else offset * unit_sum


@overload(_times)
def _times_compiled(offset, unit_sum):
    if isinstance(offset, types.NoneType):
        return lambda offset, unit_sum: None
    return lambda offset, unit_sum: offset * unit_sum


@njit(inline="always")
def _unit_sums(x, first):
    """The sum of each unit of the rows of x from `first` on: (rows of x, units) float32."""
    n_units = x.shape[1] // (2 * LANES)
    sums = np.empty((x.shape[0], n_units), dtype=np.float32)
    for r in range(first, x.shape[0]):
        xr = x[r]
        for u in range(n_units):
            sums[r, u] = _lane_sum(_load_f32(xr, 2 * LANES * u)
                                   + _load_f32(xr, 2 * LANES * u + LANES))
    return sums


@njit(inline="always")
def _row_of(data, offset, size, rows, features, j):
    """The blocks of W[features[j]]: row rows[features[j]] of `size` bytes from `offset`."""
    start = offset + rows[features[j]] * size
    return data[start : start + size]


@njit(inline="always")
def _matvec_rows(levels, factors, data, offset, size, rows, features, x, out, first, last):
    """out[:, j] = x @ W[features[j]] for j in [first, last): a block of W's rows (small
    enough to stay in the core's cache) at a time, through which the rows of x pass
    WIDE_TILE at a time, then TILE, then one by one (each pass decodes the block again)."""
    n_x = x.shape[0]
    singles = n_x // WIDE_TILE * WIDE_TILE
    if n_x - singles >= TILE:
        singles += TILE
    sums = _unit_sums(x, singles)
    block = max(1, BLOCK_BYTES // size)
    for start in range(first, last, block):
        end = min(start + block, last)
        r = 0
        while r + WIDE_TILE <= n_x:
            for j in range(start, end):
                _wide_tile(levels, _row_of(data, offset, size, rows, features, j), x, out, r, j)
            r += WIDE_TILE
        if r + TILE <= n_x:
            for j in range(start, end):
                _tile(levels, _row_of(data, offset, size, rows, features, j), x, out, r, j)
            r += TILE
        while r < n_x:
            for j in range(start, end):
                _single(factors, _row_of(data, offset, size, rows, features, j), x, sums, out,
                        r, j)
            r += 1


@njit(inline="always")
def _dequantize_row(levels, row, out, j):
    """out[j] = the levels of `row`."""
    dest = out[j]
    for u in range(out.shape[1] // (2 * LANES)):
        low, high = levels(row, u)
        _store_f32(dest, 2 * LANES * u, low)
        _store_f32(dest, 2 * LANES * u + LANES, high)


@njit(inline="always")
def _rows_job(levels, factors, job, data, offset, size, rows, features, x, out, first, last):
    """`job` on W[features[j]] for j in [first, last), each the row rows[features[j]] of
    `size` bytes from byte `offset` of `data` (`levels` and `factors`: its type's decoders)."""
    if job == MATVEC:
        _matvec_rows(levels, factors, data, offset, size, rows, features, x, out, first, last)
    else:
        for j in range(first, last):
            _dequantize_row(levels, _row_of(data, offset, size, rows, features, j), out, j)


def _rows_job_for(levels, factors):
    """`_rows_job` with one block type's decoders, compiled as a function of its own: every
    type's kernels inlined into one function took numba over two minutes to compile (the cost
    grows faster than a function's size), a function a type about two thirds of that."""

    @njit
    def rows_job(job, data, offset, size, rows, features, x, out, first, last):
        _rows_job(levels, factors, job, data, offset, size, rows, features, x, out, first, last)

    return rows_job


_rows_job_q4_k = _rows_job_for(_levels_q4_k, _factors_q4_k)
_rows_job_q6_k = _rows_job_for(_levels_q6_k, _factors_q6_k)
_rows_job_q5_k = _rows_job_for(_levels_q5_k, _factors_q5_k)
_rows_job_q8_0 = _rows_job_for(_levels_q8_0, _factors_q8_0)
_rows_job_q5_0 = _rows_job_for(_levels_q5_0, _factors_q5_0)
_rows_job_q5_1 = _rows_job_for(_levels_q5_1, _factors_q5_1)
_rows_job_q4_0 = _rows_job_for(_levels_q4_0, _factors_q4_0)
_rows_job_q4_1 = _rows_job_for(_levels_q4_1, _factors_q4_1)
_rows_job_f16 = _rows_job_for(_levels_f16, _factors_f16)
_rows_job_bf16 = _rows_job_for(_levels_bf16, _factors_bf16)
_rows_job_f32 = _rows_job_for(_levels_f32, _factors_f32)


@njit
def _rows_job_of_type(code, job, data, offset, size, rows, features, x, out, first, last):
    """`_rows_job` with the decoders of block type `code`."""
    if code == Q4_K:
        _rows_job_q4_k(job, data, offset, size, rows, features, x, out, first, last)
    elif code == Q6_K:
        _rows_job_q6_k(job, data, offset, size, rows, features, x, out, first, last)
    elif code == Q5_K:
        _rows_job_q5_k(job, data, offset, size, rows, features, x, out, first, last)
    elif code == Q8_0:
        _rows_job_q8_0(job, data, offset, size, rows, features, x, out, first, last)
    elif code == Q5_0:
        _rows_job_q5_0(job, data, offset, size, rows, features, x, out, first, last)
    elif code == Q5_1:
        _rows_job_q5_1(job, data, offset, size, rows, features, x, out, first, last)
    elif code == Q4_0:
        _rows_job_q4_0(job, data, offset, size, rows, features, x, out, first, last)
    elif code == Q4_1:
        _rows_job_q4_1(job, data, offset, size, rows, features, x, out, first, last)
    elif code == F16:
        _rows_job_f16(job, data, offset, size, rows, features, x, out, first, last)
    elif code == BF16:
        _rows_job_bf16(job, data, offset, size, rows, features, x, out, first, last)
    else:
        _rows_job_f32(job, data, offset, size, rows, features, x, out, first, last)


def _is_words(array: types.Type) -> bool:
    return isinstance(array, types.Array) and array.dtype == types.int64


def _word_pointer(context, builder, signature, args) -> ir.Value:
    """In an intrinsic called (words, index, ...): the pointer to words[index]."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, signature.args[0], array, [args[1]])


def _on_counter(build: Callable[..., ir.Value]):
    """An intrinsic (counters, index) -> int64: build(builder, pointer to counters[index]),
    counters being a 1-d int64 array."""

    @intrinsic
    def operation(typingctx, counters, index):
        if not (_is_words(counters) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            return build(builder, _word_pointer(context, builder, signature, args))

        return types.int64(counters, index), codegen

    return operation


# Add 1 to a counter atomically, returning the value it had; read one atomically.
_fetch_add = _on_counter(
    lambda builder, pointer: builder.atomic_rmw("add", pointer, ir.Constant(ir.IntType(64), 1),
                                                "seq_cst"))
_fetch_sub = _on_counter(
    lambda builder, pointer: builder.atomic_rmw("sub", pointer, ir.Constant(ir.IntType(64), 1),
                                                "seq_cst"))
_atomic_read = _on_counter(lambda builder, pointer: builder.load_atomic(pointer, "seq_cst", 8))


# counters[CLAIMED]: chunks handed out; counters[DONE]: chunks finished.
CLAIMED, DONE = 0, 1
# The columns of a matrix's parts table: one row a part, output features [FIRST, END) of W
# stored as rows of ROW_BYTES bytes of blocks of type CODE from byte OFFSET of the data.
CODE, OFFSET, ROW_BYTES, FIRST, END = range(5)
PART_COLUMNS = 5


@intrinsic
def _data_pointer(typingctx, array):
    """A pointer to an array's first item, typed as its items (for numba.carray)."""
    if not isinstance(array, types.Array):
        return None
    pointer_type = types.CPointer(array.dtype)

    def codegen(context, builder, signature, args):
        return context.make_array(signature.args[0])(context, builder, args[0]).data

    return pointer_type(array), codegen


@njit(inline="always")
def _c_view(array):
    """A C-order array as the one type every caller's arrays take here (writable, C layout):
    the kernels then compile once a process, not once for each caller's flags (read-only
    mapped blocks, the views a helper makes of a published call), minutes each cold."""
    return numba.carray(_data_pointer(array), array.shape)


@njit(inline="always")
def _run_chunk(job, data, parts, rows, features, x, out, chunk, n_chunks):
    """`job` on chunk `chunk` of `n_chunks` of W[features] (see run_rows): its runs of
    features in one part, each run in one call."""
    n = features.size
    j, last = chunk * n // n_chunks, (chunk + 1) * n // n_chunks
    while j < last:
        part = 0
        while features[j] >= parts[part, END]:
            part += 1
        end = j + 1
        while end < last and parts[part, FIRST] <= features[end] < parts[part, END]:
            end += 1
        _rows_job_of_type(parts[part, CODE], job, _c_view(data), parts[part, OFFSET],
                          parts[part, ROW_BYTES], _c_view(rows), _c_view(features),
                          _c_view(x), _c_view(out), j, end)
        j = end


@njit(nogil=True, cache=True)
def run_rows(job, data, parts, rows, features, x, out, n_chunks, counters):
    """`job` on W[features[j]] for every j, in `n_chunks` chunks: every thread that calls this
    with the same `counters` (int64, zeros) takes chunks until none are left, so a thread that
    comes late finds nothing to do and holds nobody up.

    W is the matrix whose output feature f is row rows[f] of its part's blocks in `data`
    (uint8, read-only; `parts` an int64 table, columns above). MATVEC: out[:, j] =
    x @ W[features[j]]. DEQUANTIZE: out[j] = W[features[j]] as float32 (x is not read). x and
    out are C-order float32; W's rows hold whole units (2 LANES)."""
    chunk = _fetch_add(counters, CLAIMED)
    while chunk < n_chunks:
        _run_chunk(job, data, parts, rows, features, x, out, chunk, n_chunks)
        _fetch_add(counters, DONE)
        chunk = _fetch_add(counters, CLAIMED)


@njit(nogil=True, cache=True)
def claim_chunk(counters):
    """The next chunk of a shared call for this thread (none is left from n_chunks on)."""
    return _fetch_add(counters, CLAIMED)


@njit(nogil=True, cache=True)
def finish_chunk(counters):
    """Count a chunk this thread claimed as finished."""
    _fetch_add(counters, DONE)


# --- a call published to the helper threads --------------------------------------------------
# One int64 array, `call`, holds the newest call handed to the helpers: compiled calls of
# run_rows there whole (the addresses and shapes of their arrays), so a helper runs one after
# another inside `serve_calls` without coming back to Python (whose lock the calling thread
# holds between calls); other calls are only numbered there, the caller keeping their task.
# call[TICKET] is the call's number, whether it is compiled, its chunks and the chunks claimed
# so far, in one word: a thread claims a chunk by swapping the word for the next, which fails
# once the call is another one, so a helper that read the fields of an older call never acts
# on them. The caller writes the next call's fields only once every chunk is done.
TICKET, CHUNKS_DONE, WATCHING = 0, 8, 16  # on cache lines of their own
(JOB, DATA, DATA_SIZE, PARTS, N_PARTS, ROWS, N_ROWS, FEATURES, N_FEATURES, X, X_ROWS, X_COLS,
 OUT, OUT_ROWS, OUT_COLS) = range(24, 39)
CALL_WORDS = 40
CHUNK_BITS = 12  # chunks claimed, then the call's chunks, then its kind, then its number
CHUNK_MASK = (1 << CHUNK_BITS) - 1
COMPILED_BIT = 1 << (2 * CHUNK_BITS)
NUMBER_SHIFT = 2 * CHUNK_BITS + 1


@njit(cache=True)
def ticket(number: int, n_chunks: int, compiled: bool) -> int:
    """The TICKET word of call `number` of `n_chunks` chunks, none claimed yet."""
    return (number << NUMBER_SHIFT) | (COMPILED_BIT if compiled else 0) | (n_chunks << CHUNK_BITS)


@intrinsic
def _swap_if(typingctx, words, index, expected, desired):
    """words[index] = desired if it is `expected` (atomically); whether it was."""
    if not _is_words(words):
        return None

    def codegen(context, builder, signature, args):
        result = builder.cmpxchg(_word_pointer(context, builder, signature, args), args[2],
                                 args[3], "seq_cst", "seq_cst")
        return builder.extract_value(result, 1)

    return types.boolean(words, index, types.int64, types.int64), codegen


@intrinsic
def _store(typingctx, words, index, value):
    """words[index] = value, atomically (seen by other threads after what came before)."""
    if not _is_words(words):
        return None

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _word_pointer(context, builder, signature, args),
                             "seq_cst", 8)

    return types.void(words, index, types.int64), codegen


def _pointer_to(dtype: types.Type):
    """An intrinsic: an integer address as a pointer to `dtype`s (for numba.carray)."""

    @intrinsic
    def pointer(typingctx, address):
        if not isinstance(address, types.Integer):
            return None
        pointer_type = types.CPointer(dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(pointer_type))

        return pointer_type(address), codegen

    return pointer


@intrinsic
def _address(typingctx, array):
    """The address of an array's first item."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return types.int64(array), codegen


_bytes_at, _int64s_at, _float32s_at = map(_pointer_to, (types.uint8, types.int64,
                                                        types.float32))


@njit(inline="always")
def _claim(call, number):
    """The next chunk of published call `number` for this thread; -1 when none is left or the
    call published is another."""
    while True:
        word = _atomic_read(call, TICKET)
        claimed = word & CHUNK_MASK
        if word >> NUMBER_SHIFT != number or claimed >= (word >> CHUNK_BITS) & CHUNK_MASK:
            return -1
        if _swap_if(call, TICKET, word, word + 1):
            return claimed


@njit(inline="always")
def _run_claimed(call, number, job, data, parts, rows, features, x, out):
    """Run chunks of published call `number` (its arrays given) until none is left."""
    n_chunks = (_atomic_read(call, TICKET) >> CHUNK_BITS) & CHUNK_MASK
    chunk = _claim(call, number)
    while chunk >= 0:
        _run_chunk(job, data, parts, rows, features, x, out, chunk, n_chunks)
        _fetch_add(call, CHUNKS_DONE)
        chunk = _claim(call, number)


@njit(nogil=True, cache=True)
def publish(call, word):
    """Make `word` (the ticket of a call that is not compiled) the published call."""
    _store(call, CHUNKS_DONE, 0)
    _store(call, TICKET, word)


@njit(nogil=True, cache=True)
def run_shared(call, word, job, data, parts, rows, features, x, out):
    """Publish the compiled call of ticket `word` (run_rows' arguments), then run the caller's
    share of it: chunks until none is left."""
    call[JOB] = job
    call[DATA], call[DATA_SIZE] = _address(data), data.size
    call[PARTS], call[N_PARTS] = _address(parts), parts.shape[0]
    call[ROWS], call[N_ROWS] = _address(rows), rows.size
    call[FEATURES], call[N_FEATURES] = _address(features), features.size
    call[X], call[X_ROWS], call[X_COLS] = _address(x), x.shape[0], x.shape[1]
    call[OUT], call[OUT_ROWS], call[OUT_COLS] = _address(out), out.shape[0], out.shape[1]
    _store(call, CHUNKS_DONE, 0)
    _store(call, TICKET, word)
    _run_claimed(call, word >> NUMBER_SHIFT, job, data, parts, rows, features, x, out)


@njit(nogil=True, cache=True)
def wait_for_published(call, n_chunks):
    """Return once the published call's `n_chunks` chunks are done: the reads it took beyond
    the first (how long the helpers kept this thread waiting)."""
    reads = 0
    while _atomic_read(call, CHUNKS_DONE) < n_chunks:
        reads += 1
    return reads


@njit(nogil=True, cache=True)
def product_in_call(call, number, n_chunks, data, parts, rows, features, x, out):
    """out[:, j] = x @ W[features[j]] (run_rows' arguments) from compiled code: published as
    call `number` in `n_chunks` chunks and shared with the helpers watching, or run by this
    thread alone where `n_chunks` is 0. The reads spent waiting for the helpers' chunks."""
    # Constants passed on as int64, not as literals: a literal's type would compile the
    # kernels once more (run_rows and the block kernels for it, a minute and more cold).
    matvec = np.int64(MATVEC)
    if n_chunks == 0:
        run_rows(matvec, data, parts, rows, features, x, out, np.int64(1),
                 np.zeros(2, dtype=np.int64))
        return 0
    run_shared(call, ticket(number, n_chunks, True), matvec, data, parts, rows, features, x,
               out)
    return wait_for_published(call, n_chunks)


@njit(nogil=True, cache=True)
def serve_calls(call, seen, reads):
    """A helper's watch over the published call: each compiled call after call `seen` it
    helps run, from its fields; it returns at a call that is not compiled, or after `reads`
    reads without a new call: (the newest call's number, whether it is one to run in Python).
    Calls within a step come faster than a sleeping thread wakes."""
    _fetch_add(call, WATCHING)
    python_call = False
    left = reads
    while left > 0:
        word = _atomic_read(call, TICKET)
        number = word >> NUMBER_SHIFT
        if number == seen:
            left -= 1
            continue
        seen = number
        if not word & COMPILED_BIT:
            python_call = True
            break
        # The fields may be those of a later call by now: then no claim succeeds.
        data = numba.carray(_bytes_at(call[DATA]), call[DATA_SIZE])
        parts = numba.carray(_int64s_at(call[PARTS]), (call[N_PARTS], PART_COLUMNS))
        rows = numba.carray(_int64s_at(call[ROWS]), call[N_ROWS])
        features = numba.carray(_int64s_at(call[FEATURES]), call[N_FEATURES])
        x = numba.carray(_float32s_at(call[X]), (call[X_ROWS], call[X_COLS]))
        out = numba.carray(_float32s_at(call[OUT]), (call[OUT_ROWS], call[OUT_COLS]))
        _run_claimed(call, number, call[JOB], data, parts, rows, features, x, out)
        left = reads
    _fetch_sub(call, WATCHING)
    return seen, python_call


@njit(nogil=True, cache=True)
def wait_for_chunks(counters, n_chunks):
    """Return once `n_chunks` chunks of a `run_rows` call are finished (the others' chunks
    take as long as one chunk at most: spinning is cheaper than sleeping)."""
    while _atomic_read(counters, DONE) < n_chunks:
        pass
