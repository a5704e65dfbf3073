"""Exact per-slot counts of the blocks of a kv tile: mult[t, s] = #{k : idx[t, k] == s} (SPEC §2: a duplicated
index counts once per slot). The sparse teacher reads the selection as bits (`selection`), which cannot count;
query tiles where some row selects a block twice take these counts instead, K compares per (query, block).

Two layouts: the row-major loop (`multiplicity`), and the transposed one (`multiplicity_transposed`, when the query
tile folds into 128 lanes): the [bq, K_p] index block transposed once per query tile (queries on the 128 lanes,
slots on sublanes, `transpose_slots`), four 8-bit counters per int32 word. The indices are the caller's (any
value): the counts include empty slots, and the caller keeps them only where the block bit (some valid slot
selects the block) is set.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from csa_pallas.kernels import common

LANES = common.LANES


def multiplicity(idx_ref, base, *, block_q: int, block_k: int, width_p: int):
    """int32 [bq, bk]: how many slots of each row select block base + s (s < bk). Row-major fallback for query
    tiles that do not fold into 128 lanes (`slot_fold_width`)."""
    lane = lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1) + base

    def body(c, acc):
        chunk = idx_ref[:, pl.ds(pl.multiple_of(c * LANES, LANES), LANES)]  # [bq, 128]
        for j in range(LANES):
            acc = acc + (chunk[:, j:j + 1] == lane).astype(jnp.int32)
        return acc

    return lax.fori_loop(0, width_p // LANES, body, jnp.zeros((block_q, block_k), jnp.int32))


def slot_fold_width(block_q: int) -> int:
    """How many slot groups share the 128 lanes of the transposed index block (0: no transposed layout)."""
    if block_q <= LANES and LANES % block_q == 0:
        return LANES // block_q
    return 1 if block_q % LANES == 0 else 0


def transpose_slots(idx, fold: int):
    """[bq, K_p] indices -> [K_p / fold, fold * bq]: column f*bq + t of row r holds idx[t, f * K_p/fold + r], so
    one row covers every query of the tile on full 128-lane vregs."""
    width = idx.shape[1] // fold
    folded = jnp.concatenate([idx[:, f * width:(f + 1) * width] for f in range(fold)], axis=0) if fold > 1 else idx
    return folded.T


# Multiplicity counters packed into one int32 word: COUNTER_FIELDS fields of COUNTER_BITS bits each.
COUNTER_FIELDS, COUNTER_BITS = 4, 8
COUNTER_MAX = (1 << COUNTER_BITS) - 1


def multiplicity_transposed(idx_t_ref, base, *, block_q: int, block_k: int, fold: int):
    """int32 [bq, bk] like `multiplicity`, from the transposed index block idx_t_ref [K_p/fold, fold*bq].

    Blocks on sublanes, queries on lanes: each slot row is a sublane broadcast of one loaded row (no cross-lane
    permutes). Four 8-bit counters share an int32 word (block f * bk/4 + w in field f of word w), so each slot row
    costs bk/4 compare/select/add lanes instead of bk. A slot's word in the tile (-1: not in the tile) and its
    increment (1 << 8f) are computed on its single loaded row and broadcast. The slot rows are summed in runs of
    at most 255 rows, so no counter can carry into the next field, and the runs' unpacked counts are added. The
    [bk, fold*bq] counts are transposed once and the fold groups summed."""
    rows, lanes = idx_t_ref.shape
    words = block_k // COUNTER_FIELDS
    word = lax.broadcasted_iota(jnp.int32, (words, lanes), 0)

    def body(r, acc):
        local = idx_t_ref[pl.ds(r, 1), :] - base  # [1, lanes]: one vreg of work, shared by the bk/4 words
        if words & (words - 1) == 0:  # power of two: shift and mask
            field = lax.shift_right_arithmetic(local, words.bit_length() - 1)
            position = local & (words - 1)
        else:
            field = sum((local >= f * words).astype(jnp.int32) for f in range(1, COUNTER_FIELDS))
            position = local - field * words
        key = jnp.where((local >= 0) & (local < block_k), position, -1)
        step = jnp.left_shift(jnp.int32(1), field * COUNTER_BITS)
        return acc + jnp.where(jnp.broadcast_to(key, (words, lanes)) == word, jnp.broadcast_to(step, (words, lanes)),
                               0)

    runs = -(-rows // COUNTER_MAX)
    run = -(-rows // runs)
    counts = None
    for start in range(0, rows, run):
        packed = lax.fori_loop(start, min(start + run, rows), body, jnp.zeros((words, lanes), jnp.int32),
                               unroll=True)
        fields = [lax.shift_right_logical(packed, f * COUNTER_BITS) & COUNTER_MAX for f in range(COUNTER_FIELDS)]
        unpacked = jnp.concatenate(fields, axis=0)  # [bk, lanes]
        counts = unpacked if counts is None else counts + unpacked
    counts = counts.T  # [fold*bq, bk]
    mult = counts[:block_q]
    for f in range(1, fold):
        mult = mult + counts[f * block_q:(f + 1) * block_q]
    return mult
