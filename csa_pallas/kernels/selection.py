"""The top-k selection in the forms the sparse kernels read at O(1) per (query, block) or slot: sparse mode's
preprocessing, built once per call before the teacher kernel. The kernels read the caller's top-k indices as they
are (no [B, S, K]-sized copy is made); what the indices alone cannot say travels as bits:

* `slot_bits_pallas` (a small Pallas kernel, one pass over the indices): per query, bit k set when slot k is in
  V(t) (SPEC §2: in range, block visible to the query, the row not masked by loss_mask): int32 [B, S_p, K_p / 32],
  slot k is bit (k & 31) of word k >> 5 (8 MiB at S = 128K, K = 512, against 256 MiB for the indices themselves).
* `block_bits_pallas` (a small Pallas kernel, the visit path): per query, one bit per compressed block, set when
  some valid slot selects it: int32 [B, S_p, W_p], block s is bit (s & 31) of word s >> 5 (W = N_p / 32 words,
  padded to 128 lanes). Built with the query tile's indices transposed (queries on the 128 lanes, slots on
  sublanes): each slot row costs W/8 vreg compare/select/or triples, i.e. K * N / 32 lane-ops per query, an eighth
  of the packed 8-bit counters it replaces and a few percent of the teacher's matmul work at any N. Empty slots are
  set to -1 once per tile first (no slot-bit test in the per-slot loop: 34.9 -> 26.7 us at S = 4K, static v5p
  estimate).
* `tile_tables` (XLA on the bits): per (query tile, kv tile) whether any query of the tile selected a block of the
  tile (the teacher skips the others: no matmul, no exponentials), and per query tile whether some row holds a
  duplicated index (popcount of its block bits < popcount of its slot bits). Bits cannot count, and SPEC §2 counts
  a duplicated index once per slot, so such tiles take the exact per-slot count (`slot_counts`), K compares per
  (query, block); a real indexer never selects a block twice, so that path is the exception.
"""

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, runtime, slot_counts

WORD_BITS = 32
EMPTY_SLOT = -1.0  # the value of empty slots in a slot-order P (the stand-alone KL kernels read V(t) as P >= 0)
LANES = common.LANES
BUILD_ROWS = 128  # queries per step of the bit kernels: one vreg row of lanes (fewer for short sequences)


def build_rows(seq_len: int) -> int:
    """Query rows per step of the bit kernels: 128, or the next power of two >= S (>= 8) for shorter sequences
    (fewer padded rows and grid steps; the padded length is a multiple of it)."""
    return min(BUILD_ROWS, max(common.SUBLANES, 1 << (max(seq_len, 1) - 1).bit_length()))
# Words of one accumulator pass of the build kernel (16 vregs per 128 queries): wider bit rows are built in passes.
BUILD_WORDS = 128


def word_count(padded_blocks: int) -> int:
    """W_p: int32 words per query row of the block bits (lane-padded)."""
    return common.round_up(max(common.cdiv(padded_blocks, WORD_BITS), 1), common.LANES)


def _slot_bits_kernel(idx_ref, src_ref, out_ref, *, from_limit: bool):
    """One step: R <= 128 query rows. from_limit: V(t) = 0 <= idx < limit[t] (src_ref [1, R] int32: the rows'
    limits); else src_ref is the validity [R, K_p] (int8). Writes out_ref [R, K_p / 32]: slot k = bit k & 31 of word
    k >> 5, packed with the slots on sublanes (32 slot rows per word: a sublane-group shift-and-sum)."""
    rows, k_p = idx_ref.shape
    if from_limit:
        limit = common.rows_to_column(src_ref[...].astype(jnp.float32)).astype(jnp.int32)  # [R, 1]
        idx = idx_ref[...]
        valid = ((idx >= 0) & (idx < limit)).astype(jnp.int32)
    else:
        valid = (src_ref[...].astype(jnp.int32) != 0).astype(jnp.int32)
    v = valid.T.reshape(k_p // WORD_BITS, WORD_BITS, rows)  # [words, 32, R]
    words = v[:, 0, :]
    for j in range(1, WORD_BITS):  # an or over the 32 slots of each word (static slices of the middle dim)
        words = words | jnp.left_shift(v[:, j, :], j)
    out_ref[...] = words.T


def slot_bits_pallas(idx, *, limit=None, valid=None, rows: int = BUILD_ROWS, interpret=False):
    """Slot bits int32 [B, S_p, K_p / 32] (slot k is bit k & 31 of word k >> 5): V(t) per slot, packed in one pass
    over the indices (XLA fused the same packing unpredictably: a [B, S, K] int32 and a relayout copy of the indices
    in some programs, 512 MiB at S = 128K).

    Args:
      idx: int32 [B, S_p, K_p] top-k indices (S_p and K_p multiples of 128).
      limit: int32 [B, 1, S_p]: with default positions slot k of row t is valid iff 0 <= idx < limit[t]
        (min(N, (t + 1) // m), 0 on a row masked by loss_mask). Or:
      valid: int8 [B, S_p, K_p]: the validity itself (packed documents: it needs the blocks' metadata, gathered
        in XLA).
    """
    b, s_p, k_p = idx.shape
    if s_p % rows:
        raise ValueError(f"rows: expected a divisor of the padded sequence length {s_p}, got {rows}")
    from_limit = limit is not None
    src, src_spec = ((limit, pl.BlockSpec((None, 1, rows), lambda i, j: (i, 0, j))) if from_limit else
                     (valid, pl.BlockSpec((None, rows, k_p), lambda i, j: (i, j, 0))))
    return runtime.pallas_call(
        functools.partial(_slot_bits_kernel, from_limit=from_limit),
        grid=(b, s_p // rows),
        in_specs=[pl.BlockSpec((None, rows, k_p), lambda i, j: (i, j, 0)), src_spec],
        out_specs=pl.BlockSpec((None, rows, k_p // WORD_BITS), lambda i, j: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, s_p, k_p // WORD_BITS), jnp.int32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=idx.size * 4 + src.size * src.dtype.itemsize + idx.size // 8),
        interpret=interpret,
        name="csa_slot_bits",
    )(idx, src)


def _dropping_result(fn: Callable) -> Callable:
    """fn as a `pl.when` body, which must return nothing."""
    def run():
        fn()
    return run


def write_slots(out_ref, acc, valid, *, normalize: bool, rowmax_ref=None, top_column=None):
    """The last step of a sparse teacher without the fused KL: out_ref [bq, K_p] = the head sums acc f32 [bq, K_p]
    on the valid slots (bool [bq, K_p]), L1-normalised, or (normalize=False) as they are with the rows' M
    (top_column f32 [bq, 1]) in row 0 of rowmax_ref [8, bq]; EMPTY_SLOT on the other slots."""
    acc = jnp.where(valid, acc, 0.0)
    if normalize:
        acc = acc / jnp.maximum(jnp.sum(acc, axis=1, keepdims=True), common.F32_TINY)
    else:
        rows = common.column_to_rows(top_column, 1)  # [1, bq]
        rowmax_ref[...] = jnp.concatenate([rows, jnp.zeros((common.SUBLANES - 1, rows.shape[1]), jnp.float32)],
                                          axis=0)
    out_ref[...] = jnp.where(valid, acc, EMPTY_SLOT)


def expand_bits(words_ref, start, width: int):
    """bool [rows, width]: bits [start, start + width) of the bit rows in words_ref [rows, nw] (bit i = bit i & 31
    of word i >> 5; start a multiple of 128, static or traced; width a multiple of 128). Per 128 bits: an in-vreg
    lane gather of the (<= 128-word) window holding them, a shift and an and."""
    rows, nw = words_ref.shape
    lane = lax.broadcasted_iota(jnp.int32, (rows, LANES), 1)
    parts = []
    for j in range(width // LANES):
        first_word = lax.shift_right_logical(start + j * LANES, 5)
        if nw <= LANES:
            window, offset = words_ref[...], first_word
        else:
            window_start = pl.multiple_of(first_word & ~(LANES - 1), LANES)
            window, offset = words_ref[:, pl.ds(window_start, LANES)], first_word - window_start
        w = jnp.take_along_axis(window, offset + lax.shift_right_logical(lane, 5), axis=1)
        parts.append((lax.shift_right_logical(w, lane & (WORD_BITS - 1)) & 1) != 0)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _build_kernel(idx_ref, vbits_ref, out_ref, idx_t_ref, vbits_t_ref, *, num_words: int):
    """One step: R <= 128 queries. idx_ref [R, K_p] top-k indices, vbits_ref [R, K_p/32] slot bits -> out_ref
    [R, W_p] block bits."""
    rows_q = idx_ref.shape[0]
    idx_t_ref[...] = idx_ref[...].T  # [K_p, 128]: slots on sublanes, queries on lanes
    nw = vbits_ref.shape[1]
    vb = vbits_ref[...]
    if nw < LANES:
        vb = jnp.concatenate([vb, jnp.zeros((vb.shape[0], LANES - nw), jnp.int32)], axis=1)
    vbits_t_ref[...] = vb.T  # [128, 128]: slot word w of every query on row w
    slots = idx_t_ref.shape[0]
    # Empty slots become -1 once for the whole tile, 32 slot rows per slot word (a sublane shift by the slot's bit),
    # so the per-slot loop below reads one row and tests no bit: -1's word (-1 >> 5) matches no word.
    bit_of_row = lax.broadcasted_iota(jnp.int32, (WORD_BITS, rows_q), 0)

    def mask_empty(g, carry):
        rows32 = pl.ds(pl.multiple_of(g * WORD_BITS, WORD_BITS), WORD_BITS)
        valid = lax.shift_right_logical(vbits_t_ref[pl.ds(g, 1), :], bit_of_row) & 1  # [32, R]
        idx_t_ref[rows32, :] = jnp.where(valid != 0, idx_t_ref[rows32, :], -1)
        return carry

    lax.fori_loop(0, slots // WORD_BITS, mask_empty, 0, unroll=min(4, slots // WORD_BITS))
    out_ref[...] = jnp.zeros(out_ref.shape, jnp.int32)
    for start in range(0, num_words, BUILD_WORDS):
        words = min(BUILD_WORDS, num_words - start)
        rows = common.round_up(words, common.SUBLANES)
        word = lax.broadcasted_iota(jnp.int32, (rows, rows_q), 0) + start

        def body(r, acc):
            s = idx_t_ref[pl.ds(r, 1), :]  # [1, 128]: one slot of every query (-1: empty)
            bit = jnp.left_shift(jnp.int32(1), s & (WORD_BITS - 1))
            return acc | jnp.where(word == lax.shift_right_arithmetic(s, 5), bit, 0)

        acc = lax.fori_loop(0, slots, body, jnp.zeros((rows, rows_q), jnp.int32), unroll=8)
        if rows < common.LANES:
            acc = jnp.concatenate([acc, jnp.zeros((common.LANES - rows, rows_q), jnp.int32)], axis=0)
        out_ref[:, start:start + common.LANES] = acc.T


def block_bits_pallas(idx, vbits, num_blocks_padded: int, *, rows: int = BUILD_ROWS, interpret=False):
    """Block-selection bits from the top-k indices and their slot bits.

    Args:
      idx: int32 [B, S_p, K_p] top-k indices (any value; only slots whose bit is set are read; S_p a multiple of
        128, K_p of 128; K_p <= 4096).
      vbits: int32 [B, S_p, K_p / 32] (`slot_bits`).
      num_blocks_padded: N_p, the teacher's padded block count (valid indices are < N).
      rows: query rows per step (`build_rows`; a divisor of S_p).

    Returns:
      int32 [B, S_p, W_p]: bit (s & 31) of word s >> 5 is set iff some valid slot of the row holds s.
    """
    b, s_p, k_p = idx.shape
    w_p = word_count(num_blocks_padded)
    num_words = common.cdiv(num_blocks_padded, WORD_BITS)
    if s_p % rows:
        raise ValueError(f"rows: expected a divisor of the padded sequence length {s_p}, got {rows}")
    kernel = functools.partial(_build_kernel, num_words=num_words)
    nw = vbits.shape[2]
    return runtime.pallas_call(
        kernel,
        grid=(b, s_p // rows),
        in_specs=[pl.BlockSpec((None, rows, k_p), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((None, rows, nw), lambda i, j: (i, j, 0))],
        out_specs=pl.BlockSpec((None, rows, w_p), lambda i, j: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, s_p, w_p), jnp.int32),
        scratch_shapes=[pltpu.VMEM((k_p, rows), jnp.int32), pltpu.VMEM((LANES, rows), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=idx.size * 4 + vbits.size * 4 + b * s_p * w_p * 4),
        interpret=interpret,
        name="csa_block_bits",
    )(idx, vbits)


def tile_tables(bits, vbits, *, block_q: int, block_k: int, num_kv_tiles: int):
    """(table, active). table: the per-query-tile scalar-prefetch table int32 [B * nq * (1 + nkw)], nkw =
    ceil(nk / 32): word 0 of a query tile's row is 1 when a row of the tile holds a duplicated index (popcount of
    its block bits < its valid slots, `vbits`), words 1.. are bit-packed flags, bit kt: some query of the tile
    selected a block of kv tile kt. active: those flags as bool [B, nq, nk]."""
    b, s_p, _ = bits.shape
    nq = s_p // block_q
    words_per_tile = block_k // WORD_BITS  # sparse kv tiles are multiples of 128 blocks
    used = bits[:, :, :num_kv_tiles * words_per_tile].reshape(b, nq, block_q, num_kv_tiles, words_per_tile)
    active = jnp.any(used != 0, axis=(2, 4))  # [B, nq, nk]
    nkw = common.cdiv(num_kv_tiles, WORD_BITS)
    padded = jnp.pad(active, ((0, 0), (0, 0), (0, nkw * WORD_BITS - num_kv_tiles)))
    shifts = jnp.arange(WORD_BITS, dtype=jnp.int32)
    packed = jnp.sum(jnp.left_shift(padded.reshape(b, nq, nkw, WORD_BITS).astype(jnp.int32), shifts), axis=-1,
                     dtype=jnp.int32)  # distinct bits: the sum is an or
    distinct = jnp.sum(lax.population_count(bits), axis=-1)  # [B, S_p]
    slots = jnp.sum(lax.population_count(vbits), axis=-1)
    dup = jnp.any((distinct < slots).reshape(b, nq, block_q), axis=-1).astype(jnp.int32)  # [B, nq]
    return jnp.concatenate([dup[..., None], packed], axis=-1).reshape(-1), active


def tile_lists(active):
    """The walk's lists of selected kv tiles (`schedule.TileSchedule.listed`): active bool [B, nq, nk] ->
    (lists int32 [B * nq * nk]: row (b, qi) the active tiles in increasing order, then its last one repeated, so
    a step past the list re-fetches nothing (tile 0 for a query tile with none); counts int32 [B * nq + 1]: the
    rows' active tiles, then the longest row's count, at least 1: the grid's pass-1 extent)."""
    nk = active.shape[-1]
    order = jnp.argsort(jnp.logical_not(active), axis=-1, stable=True).astype(jnp.int32)  # active tiles first
    counts = jnp.sum(active, axis=-1, dtype=jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    lists = jnp.where(jnp.arange(nk, dtype=jnp.int32) < counts[..., None], order, last)
    longest = jnp.maximum(jnp.max(counts), 1).reshape(1)
    return lists.reshape(-1), jnp.concatenate([counts.reshape(-1), longest])


# Benchmark switches for static estimates (`benchmarks`), never changed by the library. A static estimator cannot
# read the scalar-prefetched flags, so it counts every flag-guarded region of every grid step. _ESTIMATE_TILES = "all"
# compiles the tile flag out (every walked tile selected: exact for a selection touching every causally visible
# tile, e.g. uniform), "none" compiles no tile body (the fixed cost); a derived estimate interpolates between the
# two by a selection's real count of selected tiles. _EXACT_COUNTS_BRANCH = False compiles the exact-count branch
# out (a tile with duplicates then gets NaN weights: loud, never a finite wrong number).
_ESTIMATE_TILES: Optional[str] = None
_EXACT_COUNTS_BRANCH = True


@dataclasses.dataclass(frozen=True)
class SlotSelection:
    """Sparse mode inside the teacher kernel (static part): K_p slots, the words per query tile of the
    `tile_tables` row, and the exact counts' layout (`slot_counts`: slot groups folded into 128 lanes, 0 = the
    row-major loop)."""

    width_p: int
    table_words: int
    fold: int
    # P in block order ([bq, N_p], each block weighted by its slot count) instead of slot order: the sparse
    # student kernels' KL takes the target over blocks (`ops_sparse.block_target`).
    block_order: bool = False


class InKernel:
    """The selection as one teacher kernel step reads it. tables_ref: `tile_tables` (scalar prefetch); bits_ref
    [bq, W_p], idxq_ref [bq, K_p] and vbitsq_ref [bq, K_p/32]: the pass-1 query tile's block bits, top-k indices
    and slot bits; idx_ref [bq, K_p] and vbits_ref: the output tile's indices and slot bits; weight_ref f32
    [bq, bk]: the exact log2 slot counts of a tile with duplicates (0 on any other query tile); idx_t_ref: the
    transposed indices for those counts."""

    def __init__(self, sel: SlotSelection, tables_ref, bits_ref, idx_ref, idxq_ref, vbits_ref, vbitsq_ref,
                 weight_ref, idx_t_ref, *, b, qi, tile, nq: int, block_q: int, block_k: int):
        self.sel, self.tables_ref, self.bits_ref = sel, tables_ref, bits_ref
        self.idx_ref, self.idxq_ref = idx_ref, idxq_ref
        self.vbits_ref, self.vbitsq_ref = vbits_ref, vbitsq_ref
        self.weight_ref, self.idx_t_ref = weight_ref, idx_t_ref
        self.b, self.qi, self.tile, self.nq, self.block_q, self.block_k = b, qi, tile, nq, block_q, block_k
        self.duplicates = tables_ref[self._row(qi)] != 0

    def _row(self, query_tile):
        return (self.b * self.nq + query_tile) * self.sel.table_words

    def tile_selected(self, query_tile, tile):
        """Some query of `query_tile` selected a block of kv tile `tile` (scalar bool)."""
        flags = self.tables_ref[self._row(query_tile) + 1 + lax.shift_right_logical(tile, 5)]
        return (lax.shift_right_logical(flags, tile & (WORD_BITS - 1)) & 1) != 0

    def when_selected(self, query_tile, tile, body: Callable, otherwise: Optional[Callable] = None):
        """body() when the tile is selected, otherwise() when not (see the benchmark switches above); their
        results, if any, are dropped."""
        if _ESTIMATE_TILES == "none":
            if otherwise is not None:
                otherwise()
            return
        if _ESTIMATE_TILES == "all":
            body()
            return
        selected = self.tile_selected(query_tile, tile)
        pl.when(selected)(_dropping_result(body))
        if otherwise is not None:
            pl.when(jnp.logical_not(selected))(_dropping_result(otherwise))

    def prepare(self):
        """At the pass-1 tile's first step: a tile with duplicates transposes its indices for the exact counts,
        any other leaves weight 0 (an add of 0 in the LSE)."""
        @pl.when(self.duplicates)
        def _():
            if self.sel.fold:
                self.idx_t_ref[...] = slot_counts.transpose_slots(self.idxq_ref[...], self.sel.fold)

        @pl.when(jnp.logical_not(self.duplicates))
        def _():
            self.weight_ref[...] = jnp.zeros(self.weight_ref.shape, jnp.float32)

    def mask(self, width: int):
        """bool [bq, width]: the blocks of the pass-1 kv tile (its first `width` lanes) each query selected."""
        return expand_bits(self.bits_ref, self.tile * self.block_k, width)

    def valid_slots(self, start, width: int):
        """bool [bq, width]: the output tile's slots [start, start + width) in V(t)."""
        return expand_bits(self.vbits_ref, start, width)

    def rows_with_slots(self):
        """bool [bq, 1]: the pass-1 tile's rows with a valid slot (the rows that see a block)."""
        return jnp.max((self.vbitsq_ref[...] != 0).astype(jnp.float32), axis=1, keepdims=True) > 0

    def exact_weights(self, cond):
        """Under cond, on a selected tile of a query tile with duplicates: weight_ref = log2 of each block's slot
        count among the valid slots (-inf where none), K compares per (query, block) (`slot_counts`) kept where the
        block bit is set (a slot holding an index the query may not see counts for nothing)."""
        block_q, block_k, fold = self.block_q, self.block_k, self.sel.fold

        def body():
            if not _EXACT_COUNTS_BRANCH:
                self.weight_ref[...] = jnp.full(self.weight_ref.shape, jnp.nan, jnp.float32)
                return
            base = self.tile * block_k
            if fold:
                mult = slot_counts.multiplicity_transposed(self.idx_t_ref, base, block_q=block_q, block_k=block_k,
                                                           fold=fold)
            else:
                mult = slot_counts.multiplicity(self.idxq_ref, base, block_q=block_q, block_k=block_k,
                                                width_p=self.sel.width_p)
            mult = jnp.where(self.mask(block_k), mult, 0)  # the raw indices count empty slots too
            self.weight_ref[...] = jnp.where(mult > 0, jnp.log2(jnp.maximum(mult, 1).astype(jnp.float32)), -jnp.inf)

        pl.when(cond & self.duplicates)(lambda: self.when_selected(self.qi, self.tile, body))

    def weighted(self, z, width: int, layout):
        """The LSE input of the pass-1 scores z [*view, width] (unselected already -inf): z + log2(slot count)."""
        return z + layout.expand_mask(self.weight_ref[:, :width])

    def gather_to_slots(self, out_ref, probs, tile):
        """out_ref[t, k] += probs[t, idx[t, k] - tile * bk] for the output tile's slots whose block lies in the
        first probs.shape[1] blocks of kv tile `tile` (each slot's block lies in exactly one tile). probs: f32
        [bq, width]; an in-vreg lane gather per 128-lane chunk of probs and of the slots."""
        block_q = self.block_q
        base = tile * self.block_k
        src = [probs[:, j:j + LANES] for j in range(0, probs.shape[1], LANES)]

        def body(ci, carry):
            lanes = pl.ds(pl.multiple_of(ci * LANES, LANES), LANES)
            local = self.idx_ref[:, lanes] - base  # [bq, 128]: each slot's block inside the tile (empty slots are
            # masked at the end by the slot bits: their block is not selected, or lies elsewhere)
            acc = jnp.zeros((block_q, LANES), jnp.float32)
            for j, pj in enumerate(src):
                off = local - j * LANES
                inside = (off >= 0) & (off < LANES)
                acc = acc + jnp.where(inside, jnp.take_along_axis(pj, jnp.where(inside, off, 0), axis=1), 0.0)
            out_ref[:, lanes] += acc
            return carry

        lax.fori_loop(0, self.sel.width_p // LANES, body, 0, unroll=True)
