"""The CUDA backend's step data on the host side: the int32 input arrays packed for the kernels
(`step.<name>`: token ids, positions, KV slots, block tables; `rows.<name>`: token masks,
penalties and candidate counts), laid end to end in one buffer for a single host-to-device
copy, and the candidates' records unpacked on the way back. No pycuda, no device: tested on
any machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from actors.compute import cuda_plan as plan
from actors.errors import InvalidRequest
from actors.model.candidates import Candidates, RowInputs, mask_words
from actors.model.step import StepPlan


# --- the step's int32 input arrays ----------------------------------------------------------


def padded(values: Sequence[int] | np.ndarray, length: int, fill: int) -> np.ndarray:
    """values as int32, padded with `fill` to `length`."""
    values = np.asarray(values, dtype=np.int32)
    if values.ndim != 1 or values.size > length:
        raise InvalidRequest(f"{values.size} values do not fit {length} rows", field="batch")
    out = np.full(length, fill, dtype=np.int32)
    out[: values.size] = values
    return out


def block_table_array(tables: Sequence[Sequence[int]] | np.ndarray, rows: int, stride: int,
                      fill: int, used: np.ndarray | None = None) -> np.ndarray:
    """Ragged block tables -> int32 (rows, stride), each padded with `fill`; or, with `used`,
    the first used[i] entries of row i of a 2-d array of tables."""
    lengths = (np.array([len(table) for table in tables], dtype=np.int64) if used is None
               else np.asarray(used, dtype=np.int64))
    if len(tables) > rows or (lengths.size and lengths.max() > stride):
        raise InvalidRequest(f"block tables do not fit ({rows}, {stride})", field="blocks")
    out = np.full((rows, stride), fill, dtype=np.int32)
    if used is not None:
        width = min(np.shape(tables)[1], stride) if len(tables) else 0
        kept = np.arange(width) < lengths[:, None]
        out[: len(tables), :width] = np.where(kept, np.asarray(tables)[:, :width], fill)
    elif lengths.sum():
        flat = np.fromiter(chain.from_iterable(tables), np.int32, int(lengths.sum()))
        row = np.repeat(np.arange(len(tables)), lengths)
        column = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[row, column] = flat
    return out


@dataclass(frozen=True)
class PackedArrays:
    """Named int32 arrays laid out in one buffer: copy `buffer` into a pinned host buffer and
    on to the device once; array `name` starts `offsets[name]` int32s in (a multiple of 4, so
    every array is 16-byte aligned) with shape `shapes[name]`."""

    buffer: np.ndarray
    offsets: dict[str, int]
    shapes: dict[str, tuple[int, ...]]

    def view(self, name: str) -> np.ndarray:
        start = self.offsets[name]
        shape = self.shapes[name]
        return self.buffer[start : start + math.prod(shape)].reshape(shape)


def pack_int32(arrays: Mapping[str, np.ndarray]) -> PackedArrays:
    """Lay `arrays` (in the mapping's order) end to end in one int32 buffer."""
    offsets, shapes, cursor = {}, {}, 0
    for name, array in arrays.items():
        offsets[name], shapes[name] = cursor, tuple(array.shape)
        cursor += -(-array.size // 4) * 4
    buffer = np.zeros(cursor, dtype=np.int32)
    for name, array in arrays.items():
        buffer[offsets[name] : offsets[name] + array.size] = array.ravel()
    return PackedArrays(buffer, offsets, shapes)


def decode_step_arrays(token_ids: Sequence[int], positions: Sequence[int],
                       slots: Sequence[int], tables: Sequence[Sequence[int]] | np.ndarray,
                       bucket: int, table_stride: int, pad_slot: int, pad_block: int,
                       used: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A decode step (one token per sequence) padded to its graph bucket: token_ids,
    positions, slots (block * block_size + offset) and block_tables (ragged, or a 2-d array
    and the entries `used` of each row: block_table_array). Padding rows read token 0 at
    position 0 through `pad_block` and write their K/V to `pad_slot`, a slot of a block the
    scheduler never hands out, so a replayed graph touches no sequence's cache."""
    return {
        "token_ids": padded(token_ids, bucket, 0),
        "positions": padded(positions, bucket, 0),
        "slots": padded(slots, bucket, pad_slot),
        "block_tables": block_table_array(tables, bucket, table_stride, pad_block, used),
    }


def pack_decode_step(token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                     tables: Sequence[Sequence[int]], bucket: int, table_stride: int,
                     pad_slot: int, pad_block: int) -> PackedArrays:
    """`decode_step_arrays` packed into one buffer."""
    return pack_int32(decode_step_arrays(token_ids, positions, slots, tables, bucket,
                                         table_stride, pad_slot, pad_block))



def step_arrays(step: StepPlan, n_decode: int, table_stride: int) -> dict[str, np.ndarray]:
    """The arrays the forward kernels read (`step.<name>`), for a step run launch by launch."""
    prefill = slice(n_decode, None)
    return {
        "token_ids": step.token_ids.astype(np.int32),
        "positions": step.positions.astype(np.int32),
        "slots": (step.slot_blocks * step.block_size + step.slot_offsets).astype(np.int32),
        "block_tables": block_table_array(list(step.block_tables), len(step.lengths),
                                               table_stride, 0),
        "prefill_first_row": step.first_rows[prefill].astype(np.int32),
        "prefill_tokens": step.lengths[prefill].astype(np.int32),
        "prefill_start": step.starts[prefill].astype(np.int32),
        "logit_rows": step.logit_rows.astype(np.int32),
    }


def _words(values: np.ndarray) -> np.ndarray:
    """float32 / float64 values as the int32 words of the packed buffer."""
    return np.ascontiguousarray(values).view(np.int32)


_NO_IDS = np.zeros(0, np.int64)


def _csr(lists: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row id lists -> (offsets (rows + 1,), ids) int32."""
    lengths = [len(ids) for ids in lists]
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).astype(np.int32)
    return offsets, _concatenated_int32(lists)


def _bias_lists(rows: Sequence[RowInputs],
                vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows' logit biases as CSR: (offsets int32, ids int32, values float64)."""
    ids = [_checked_ids(row.bias_tokens, vocab, "bias_tokens") for row in rows]
    values = [np.asarray(row.bias_values, dtype=np.float64).reshape(-1) for row in rows]
    if any(len(i) != len(v) for i, v in zip(ids, values)):
        raise InvalidRequest("bias_tokens and bias_values differ in length", field="bias_values")
    offsets, flat_ids = _csr(ids)
    return offsets, flat_ids, np.concatenate([np.zeros(0), *values])


def _concatenated_int32(lists: Sequence[np.ndarray]) -> np.ndarray:
    """The lists one after the other as int32 (the empty ones cost nothing)."""
    return np.concatenate([np.zeros(0, np.int64), *(ids for ids in lists if len(ids))]
                          ).astype(np.int32)


def _checked_ids(ids: Sequence[int], vocab: int, field: str) -> np.ndarray:
    values = np.asarray(ids, dtype=np.int64).reshape(-1)
    if values.size and (values.min() < 0 or values.max() >= vocab):
        raise InvalidRequest(f"{field} holds a token id outside [0, {vocab})", field=field)
    return values


@dataclass(frozen=True)
class RowArrays:
    """The rows' mask, penalty and candidate inputs (`rows.<name>`), the candidate record
    width, whether any row has a penalty to apply and how many rows have a token mask."""

    arrays: dict[str, np.ndarray]
    width: int
    any_penalty: bool
    n_masked: int


def check_token_masks(rows: Sequence[RowInputs], vocab: int) -> None:
    """InvalidRequest for a row's token mask of another size than the vocabulary's
    (mask_words(vocab) words), as the numpy reference refuses it."""
    words = mask_words(vocab)
    for inputs in rows:
        if inputs.allowed is not None and np.size(inputs.allowed) != words:
            raise InvalidRequest(f"a token mask of {np.size(inputs.allowed)} words for a "
                                 f"vocabulary of {vocab} tokens (needs {words})",
                                 field="allowed")


def token_masks(rows: Sequence[RowInputs], vocab: int) -> dict[str, np.ndarray]:
    """apply_token_mask's inputs: the masked rows' indices (`mask_rows`) and their words,
    (masked rows, mask_words(vocab)) int32 (`mask_words`); none where no row has a mask, so
    unconstrained steps upload and launch nothing for it."""
    check_token_masks(rows, vocab)
    masked = [row for row, inputs in enumerate(rows) if inputs.allowed is not None]
    if not masked:
        return {}
    return {"mask_rows": np.array(masked, dtype=np.int32),
            "mask_words": np.stack([np.asarray(rows[row].allowed, dtype=np.int32).reshape(-1)
                                    for row in masked])}


def row_arrays(rows: Sequence[RowInputs], vocab: int) -> RowArrays:
    """Pack RowInputs for apply_token_mask (`token_masks`), apply_penalties (CSR lists, ids
    ascending, float64 parameters; the logit biases' CSR list, float64 values) and
    top_candidates (least / most candidates, mass, inv_temp). InvalidRequest for a mask of
    the wrong size, a penalty or bias id outside the vocabulary or a row asking for more
    candidates than the kernel selects."""
    masks = token_masks(rows, vocab)
    repeated, counted, counts = [], [], []
    for row in rows:
        if not (row.repeated or row.generated or row.generated_counts):
            repeated.append(_NO_IDS)  # most rows: no ids to check or sort
            counted.append(_NO_IDS)
            counts.append(_NO_IDS)
            continue
        rep = np.unique(_checked_ids(row.repeated, vocab, "repeated"))
        repeated.append(rep if row.repetition_penalty != 1.0 else rep[:0])
        ids = _checked_ids(row.generated, vocab, "generated")
        row_counts = np.asarray(row.generated_counts, dtype=np.int64).reshape(-1)
        if ids.size != row_counts.size:
            raise InvalidRequest("generated and generated_counts differ in length",
                                 field="generated_counts")
        if row.presence_penalty == 0 and row.frequency_penalty == 0:
            ids, row_counts = ids[:0], row_counts[:0]
        order = np.argsort(ids, kind="stable")
        counted.append(ids[order])
        counts.append(row_counts[order])
    cap = min(vocab, plan.MAX_CANDIDATES)
    least = np.array([min(max(1, row.candidates), vocab) for row in rows], dtype=np.int64)
    if (least > cap).any():
        raise InvalidRequest(f"a row asks for {int(least.max())} candidates; the CUDA backend "
                             f"selects at most {cap}", field="candidates")
    most = np.array([min(max(row.candidates, row.max_candidates, 1), cap) for row in rows],
                    dtype=np.int64)
    rep_offsets, rep_ids = _csr(repeated)
    count_offsets, count_ids = _csr(counted)
    bias_offsets, bias_ids, bias_values = _bias_lists(rows, vocab)
    float64_of = {name: np.array([getattr(row, name) for row in rows], dtype=np.float64)
                  for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")}
    arrays = {
        # float64 first: every array starts 16-byte aligned, these need 8.
        "repetition": _words(float64_of["repetition_penalty"]),
        "presence": _words(float64_of["presence_penalty"]),
        "frequency": _words(float64_of["frequency_penalty"]),
        "bias_values": _words(bias_values),
        "least": least.astype(np.int32),
        "most": most.astype(np.int32),
        "mass": _words(np.array([row.mass for row in rows], dtype=np.float32)),
        "inv_temp": _words(np.array([row.inv_temp for row in rows], dtype=np.float32)),
        "rep_offsets": rep_offsets,
        "rep_ids": rep_ids,
        "count_offsets": count_offsets,
        "count_ids": count_ids,
        "counts": _concatenated_int32(counts),
        "bias_offsets": bias_offsets,
        "bias_ids": bias_ids,
        **masks,
    }
    return RowArrays(arrays, int(most.max()) if len(rows) else 1,
                     bool(rep_ids.size or count_ids.size or bias_ids.size),
                     len(masks["mask_rows"]) if masks else 0)


# --- the candidates' way back ---------------------------------------------------------------


def candidates_from_records(records: np.ndarray, width: int,
                            rows: Sequence[RowInputs]) -> Candidates:
    """top_candidates' records (n_rows, candidate_record_words(width)) int32 -> Candidates:
    columns past a row's count become id 0 / logit -inf, log_z is NaN where the row did not
    ask for it (nor for a mass) or its top logit is not finite."""
    count = records[:, 0].copy()
    real = np.arange(width) < count[:, None]
    ids = np.where(real, records[:, 2 : 2 + width], 0).astype(np.int32)
    logits = np.where(real, records[:, 2 + width :].view(np.float32), np.float32(-np.inf))
    keep = int(count.max()) if len(rows) else 1
    log_z = records[:, 1].view(np.float32).astype(np.float64)
    asked = np.array([row.want_log_z or row.mass > 0 for row in rows], dtype=bool)
    log_z[~asked | ~np.isfinite(logits[:, 0])] = np.nan
    return Candidates(ids=ids[:, :keep], logits=logits[:, :keep].astype(np.float32),
                      count=count.astype(np.int32), log_z=log_z)
