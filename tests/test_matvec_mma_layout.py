"""The tensor-core matvec's data layout (cuda_src/matvec_mma.cu), Q4_K and Q6_K (row-planar),
played on numpy without a device: every lane's A fragments from its own weight bytes, its B fragments from the shared
activation table as fill_table lays it out (each 32-element group's power-of-two scale found
over the lanes GROUP_LANE_BITS names) and the owner / zero rule reads it, the MMAs by the
PTX m16n8k16 fragment layout, each lane's scales and its groups' 2^e on its own accumulator
columns. The result
must be the product of the decoded weights: a wrong word, pair, entry, column or scale
in the layout moves it far off. (What only a device shows, the tensor cores' own float32
sums, is the device tests' part: tests/gpu/test_kernels.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from actors.compute.cuda_plan import planar_q6_K_rows
from actors.model.gguf.quants import _k_scales_mins, dequantize
from tests.cuda_samples import SPLIT_GROUP, finite_blocks, split_exponents

ROWS, LANES = 16, 32
TABLE_BLOCKS, ENTRIES_PER_BLOCK = 32, 64  # matvec_mma.cu's constants
LOW_NIBBLE_PAIR, HIGH_NIBBLE_PAIR = 0x000F000F, 0x00F000F0
K_BLOCK_GROUPS = 256 // SPLIT_GROUP
Q4_K_GROUP_LANE_BITS, Q6_K_GROUP_LANE_BITS = 0b00111, 0b01011  # MmaQ4K's, MmaQ6K's


def halves(pairs: np.ndarray) -> np.ndarray:
    """float16x2 bit patterns (uint32) as their (low, high) halves, float64."""
    return pairs.astype("<u4").view(np.float16).reshape(*pairs.shape, 2).astype(np.float64)


def mma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """D = A B + C for one m16n8k16 from the 32 lanes' fragments (PTX's layout, lane = 4 g +
    t): a (32, 4) pairs {(g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}, b (32, 2)
    pairs {(k 2t.., n g), (k 2t+8.., n g)}, c and D (32, 4) {(g, 2t), (g, 2t+1), (g+8, 2t),
    (g+8, 2t+1)}; summed exactly (float64)."""
    lane = np.arange(LANES)
    g, t = lane // 4, lane % 4
    a_matrix, b_matrix = np.zeros((16, 16)), np.zeros((16, 8))
    for register, (row, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                         (g + 8, 2 * t + 8)]):
        a_matrix[row, k], a_matrix[row, k + 1] = halves(a[:, register]).T
    for register, k in enumerate([2 * t, 2 * t + 8]):
        b_matrix[k, g], b_matrix[k + 1, g] = halves(b[:, register]).T
    d = a_matrix @ b_matrix
    return c + np.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]],
                        axis=1)


def split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """split_pair's parts: hi = f16(x), lo = f16(x - hi) (the subtraction in float32)."""
    hi = x.astype(np.float16)
    lo = (x - hi.astype(np.float32)).astype(np.float16)
    return hi, lo


def pairs_of(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """float16x2 bit patterns, `first` in the low half."""
    return first.view(np.uint16).astype(np.uint32) | (second.view(np.uint16).astype(np.uint32)
                                                      << 16)


def q4_K_first_element(c: int, i: int) -> int:
    """MmaQ4K::first_element: chunk c (sub-blocks 2c, 2c + 1), word i."""
    return 64 * c + 4 * i


def q6_K_first_element(c: int, i: int) -> int:
    """MmaQ6K::first_element: lane c's positions 16 (c % 2).. of half c / 2, quarter i / 4,
    word i % 4."""
    return 128 * (c // 2) + 16 * (c % 2) + 32 * (i // 4) + 4 * (i % 4)


def item_runs(x: np.ndarray, block: int, item: int, first_element,
              second_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """The two 4-element runs of x fill_table's item (lane) `item` splits in K-block `block`."""
    base = block * 256 + first_element(item // 8 % 4, item % 8)
    return x[base:base + 4], x[base + second_offset:base + second_offset + 4]


def fill_table(x: np.ndarray, first: int, count: int, first_element=q4_K_first_element,
               second_offset: int = 32, group_lane_bits: int = Q4_K_GROUP_LANE_BITS
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fill_table's entries (uint32, 4 a 16-byte entry; 16 zero entries at the end), sums
    (per K-block and chunk c: the entries' first and second elements) and factors (per
    K-block, its 32-element groups' 2^e) of K-blocks [first, first + count); entry i of chunk
    c splits elements first_element(c, i) .. + 3 and second_offset on, each run scaled by
    2^-e of the exponent found over the runs of the lanes that differ from its own in
    group_lane_bits alone."""
    table = np.zeros((TABLE_BLOCKS * ENTRIES_PER_BLOCK + 16, 4), dtype=np.uint32)
    sums = np.zeros((TABLE_BLOCKS * 4, 2))
    factors = np.zeros(TABLE_BLOCKS * K_BLOCK_GROUPS)
    for item in range(count * 32):
        block, c, i = item // 32, item // 8 % 4, item % 8
        low, high = item_runs(x, first + block, item, first_element, second_offset)
        lanes = [other for other in range(32)
                 if other & ~group_lane_bits == item % 32 & ~group_lane_bits]
        group_runs = [item_runs(x, first + block, lane, first_element, second_offset)
                      for lane in lanes]
        e_low, e_high = (int(split_exponents(np.concatenate([runs[r] for runs in group_runs]))[0])
                         for r in range(2))
        parts = [split(low * np.float32(2.0**-e_low)), split(high * np.float32(2.0**-e_high))]
        element = first_element(c, i)
        if element % SPLIT_GROUP == 0:
            factors[block * K_BLOCK_GROUPS + element // SPLIT_GROUP] = 2.0**e_low
            factors[block * K_BLOCK_GROUPS + (element + second_offset) // SPLIT_GROUP] = \
                2.0**e_high
        for part in range(2):  # hi entry, then lo entry
            (low_part, high_part) = (parts[0][part], parts[1][part])
            table[block * ENTRIES_PER_BLOCK + (8 * c + i) * 2 + part] = [
                pairs_of(low_part[0:1], low_part[2:3])[0], pairs_of(low_part[1:2], low_part[3:4])[0],
                pairs_of(high_part[0:1], high_part[2:3])[0],
                pairs_of(high_part[1:2], high_part[3:4])[0]]
        sums[block * 4 + c] += [low.astype(np.float64).sum(), high.astype(np.float64).sum()]
    return table, sums, factors


def levels(words: np.ndarray, mask: int) -> np.ndarray:
    """The kernel's level pairs: the masked bits ORed into float16 1024 (nibble_pairs_of),
    then 1024 subtracted in float16."""
    biased = halves((words & mask) | 0x64006400).astype(np.float16) - np.float16(1024)
    return pairs_of(biased[..., 0], biased[..., 1])


def lane_block_sums(raw_tile: np.ndarray, table: np.ndarray, sums: np.ndarray,
                    factors: np.ndarray, block: int, k: int) -> np.ndarray:
    """MmaQ4K::multiply for every lane of K-block `block` (table index k): (32, 2) sums of
    rows g and g + 8 over the lane's two sub-blocks."""
    lane = np.arange(LANES)
    g, c = lane // 4, lane % 4
    column = lane // 4
    owner = column // 2 == c
    entry = np.where(owner, k * ENTRIES_PER_BLOCK + 16 * c + column % 2,
                     TABLE_BLOCKS * ENTRIES_PER_BLOCK)
    blocks = raw_tile[:, block * 144:(block + 1) * 144]
    chunk_bytes = (16 + 32 * c)[:, None] + np.arange(32)  # each lane's chunk of the quants
    chunk, chunk8 = blocks[g[:, None], chunk_bytes], blocks[g[:, None] + 8, chunk_bytes]
    words, words8 = chunk.view("<u4"), chunk8.view("<u4")
    low, high = np.zeros((LANES, 4)), np.zeros((LANES, 4))
    for i in range(8):
        w, w8 = words[:, i], words8[:, i]
        a_low = np.stack([levels(w, LOW_NIBBLE_PAIR), levels(w8, LOW_NIBBLE_PAIR),
                          levels(w >> 8, LOW_NIBBLE_PAIR), levels(w8 >> 8, LOW_NIBBLE_PAIR)],
                         axis=1)
        a_high = np.stack([levels(w, HIGH_NIBBLE_PAIR), levels(w8, HIGH_NIBBLE_PAIR),
                           levels(w >> 8, HIGH_NIBBLE_PAIR), levels(w8 >> 8, HIGH_NIBBLE_PAIR)],
                          axis=1)
        b = table[entry + 2 * i]
        low = mma(a_low, b[:, 0:2], low)
        high = mma(a_high, b[:, 2:4], high)
    out = np.zeros((LANES, 2))
    for r, rows in enumerate([g, g + 8]):
        head = blocks[rows, :16]
        d = head[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float64)
        dmin = head[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
        scales, mins = _k_scales_mins(head[:, 4:16])  # (32 lanes, 8 sub-blocks)
        sub_block = 2 * c
        factor_low, factor_high = (factors[k * K_BLOCK_GROUPS + sub_block + s] for s in (0, 1))
        scaled = (scales[lane, sub_block] * (low[:, 2 * r] + low[:, 2 * r + 1]) * factor_low +
                  scales[lane, sub_block + 1] / 16 * (high[:, 2 * r] + high[:, 2 * r + 1]) *
                  factor_high)
        lane_sums = sums[k * 4 + c]
        min_terms = (mins[lane, sub_block] * lane_sums[:, 0] +
                     mins[lane, sub_block + 1] * lane_sums[:, 1])
        out[:, r] = d * scaled - dmin * min_terms
    return out


def six_bit_pairs(first_run: np.ndarray, second_run: np.ndarray, top: np.ndarray,
                  quarter: int) -> np.ndarray:
    """(32 lanes, 2) level pairs (bytes 0 and 2, then 1 and 3) of one quarter's word: the 6-bit
    level u - 32 as float16 (u: its nibble from the quarter's run, its top bits from qh)."""
    nibbles = (second_run if quarter % 2 else first_run) >> (4 * (quarter // 2))
    tops = (top >> (2 * quarter)) & 0x03030303
    level_bytes = ((nibbles & 0x0F0F0F0F) | (tops << 4)).astype("<u4").view(np.uint8)
    level_bytes = level_bytes.reshape(-1, 4).astype(np.float16) - np.float16(32)
    return np.stack([pairs_of(level_bytes[:, 0], level_bytes[:, 2]),
                     pairs_of(level_bytes[:, 1], level_bytes[:, 3])], axis=1)


def q6_K_lane_block_sums(planar_tile: np.ndarray, n_blocks: int, table: np.ndarray,
                         factors: np.ndarray, block: int, k: int) -> np.ndarray:
    """MmaQ6K::multiply for every lane of K-block `block` (table index k), reading the
    row-planar rows: (32, 2) sums of rows g and g + 8 over the lane's four sub-blocks."""
    lane = np.arange(LANES)
    g, c = lane // 4, lane % 4
    h, v = c // 2, c % 2
    column = lane // 4
    owner = column // 2 == c
    entry = np.where(owner, k * ENTRIES_PER_BLOCK + 16 * c + column % 2,
                     TABLE_BLOCKS * ENTRIES_PER_BLOCK)
    runs, scales, d = [], [], []  # per row of the lane (g, g + 8)
    for rows in (g, g + 8):
        at = [192 * block + offset[:, None] + np.arange(16)
              for offset in (64 * h + 16 * v, 64 * h + 32 + 16 * v, 128 + 32 * h + 16 * v)]
        runs.append([planar_tile[rows[:, None], where].view("<u4") for where in at])
        scale_at = 192 * n_blocks + 16 * block + 8 * h[:, None] + 2 * np.arange(4) + v[:, None]
        scales.append(planar_tile[rows[:, None], scale_at].view(np.int8).astype(np.float64))
        d_at = 208 * n_blocks + 2 * block
        d.append(planar_tile[rows, d_at:d_at + 2].copy().view(np.float16)[:, 0]
                 .astype(np.float64))
    out = np.zeros((LANES, 2))
    for u in range(2):  # quarters u and u + 2 share each table entry
        sums = [np.zeros((LANES, 4)), np.zeros((LANES, 4))]
        for j in range(4):
            b = table[entry + 2 * (4 * u + j)]
            for half, quarter in enumerate((u, u + 2)):
                row_g, row_g8 = (six_bit_pairs(*(words[:, j] for words in row_runs), quarter)
                                 for row_runs in runs)
                a = np.stack([row_g[:, 0], row_g8[:, 0], row_g[:, 1], row_g8[:, 1]], axis=1)
                sums[half] = mma(a, b[:, 2 * half:2 * half + 2], sums[half])
        for r in range(2):
            for half, quarter in enumerate((u, u + 2)):
                factor = factors[k * K_BLOCK_GROUPS + 4 * h + quarter]
                out[:, r] += d[r] * scales[r][:, quarter] * factor * (sums[half][:, 2 * r] +
                                                                      sums[half][:, 2 * r + 1])
    return out


def mma_matvec_row_tile(raw_tile: np.ndarray, x: np.ndarray, type_name: str) -> np.ndarray:
    """mma_matvec for one token: the pieces of TABLE_BLOCKS K-blocks, the warps' K-blocks,
    the lanes' sums added over the 4 lanes of a row (16 rows). Q6_K reads the rows as
    cuda_plan.planar_q6_K_rows lays them out."""
    n_blocks = x.size // 256
    planar = planar_q6_K_rows(raw_tile) if type_name == "Q6_K" else None
    acc = np.zeros((LANES, 2))
    for first in range(0, n_blocks, TABLE_BLOCKS):
        count = min(TABLE_BLOCKS, n_blocks - first)
        if planar is None:
            table, sums, factors = fill_table(x, first, count)
            for k in range(count):
                acc += lane_block_sums(raw_tile, table, sums, factors, first + k, k)
        else:
            table, _, factors = fill_table(x, first, count, q6_K_first_element, 64,
                                           Q6_K_GROUP_LANE_BITS)
            for k in range(count):
                acc += q6_K_lane_block_sums(planar, n_blocks, table, factors, first + k, k)
    per_row = acc.reshape(8, 4, 2).sum(axis=1)  # lanes 4g..4g+3
    return np.concatenate([per_row[:, 0], per_row[:, 1]])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n_in", [512, 8448])
def test_lane_fragments_and_table_give_the_product(n_in: int, type_name: str) -> None:
    """512: two K-blocks (most warps idle); 8448: 33 K-blocks, a full table and a piece of
    one. Within float32 of the decoded weights' product (the d * sc products the decode
    rounds to float32 are the only difference left in an exact sum)."""
    rng = np.random.default_rng(n_in)
    raw = finite_blocks(type_name, ROWS, n_in, rng)
    x = rng.standard_normal(n_in).astype(np.float32)
    w = dequantize(raw, type_name, (ROWS, n_in)).astype(np.float64)
    got = mma_matvec_row_tile(raw, x, type_name)
    expected = w @ x.astype(np.float64)
    scale = np.abs(w) @ np.abs(x.astype(np.float64))
    assert (np.abs(got - expected) <= 1e-6 * scale).all()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_extreme_activations_give_the_product(type_name: str) -> None:
    """Groups of 32 elements at 7e4, 1e5 and 1e30 (past float16's range), 1e-5, 1e-30 and
    1e-40 (below its resolution) and plain ones, 1024 inputs: within float32 of the decoded
    weights' product plus what the split may cost (2^-22 of a group's largest magnitude an
    element), where the plain split gave NaN."""
    rng = np.random.default_rng(53)
    n_in = 1024
    raw = finite_blocks(type_name, ROWS, n_in, rng)
    magnitudes = np.array([7e4, 1e5, 1e30, 1.0, 1e-5, 1e-30, 1e-40, 1.0])
    groups = rng.standard_normal((n_in // SPLIT_GROUP, SPLIT_GROUP))
    groups *= magnitudes[np.arange(len(groups)) % magnitudes.size, None]
    x = groups.reshape(-1).astype(np.float32)
    w = dequantize(raw, type_name, (ROWS, n_in)).astype(np.float64)
    got = mma_matvec_row_tile(raw, x, type_name)
    x64 = x.astype(np.float64)
    largest = np.repeat(np.abs(x64).reshape(-1, SPLIT_GROUP).max(axis=1), SPLIT_GROUP)
    bound = 1e-6 * (np.abs(w) @ np.abs(x64)) + 2.0**-22 * (np.abs(w) @ largest)
    assert (np.abs(got - w @ x64) <= bound).all()
