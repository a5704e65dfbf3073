"""Sparse (top-k) teacher P over each query's K selected slots (SPEC §2-§3) as one Pallas TPU kernel.

Why not gather the K selected blocks per query: every query selects its own K blocks, so a per-query gather is a
[K, D] x [D] matrix-vector product per (query, head) (MXU-hostile) and would need per-row DMAs (bf16 single-row
DMAs do not compile on v5p). Instead the kernel walks the kv tiles like the dense teacher (MXU-friendly
[hc*bq, D] x [D, bk] products) and turns the top-k indices into a per-tile *multiplicity*:

    mult[t, s] = #{ k : topk[t, k] == s }   for the bk blocks s of the current kv tile,

masked by the dense visibility of block s for query t (segment, completeness, causality from qmeta/kmeta), so
-1, out-of-range (never equal to a block id < N; ids in the padding [N, N_p) are invisible), future and
other-document slots never match and are never read. Each slot is its own entry of the softmaxes (duplicates count
once per slot), which is exactly sum_s mult[t, s] * exp(z[t, s]):

  * pass 1 (skipped with full_lse): per-lane online LSE of z + log(mult) over mult > 0 -> C, F = logaddexp(u, C)
    (joint) or C (per_head);
  * pass 2: q[t, s] = sum_h exp(z[t, h, s] - F[t, h]) on mult > 0, then the slot-ordered output
    p[t, k] += q[t, topk[t, k]] by a lane gather (`take_along_axis` within each 128-lane chunk of the tile, which
    Mosaic supports for f32 sources of one vreg width) - each slot's block lies in exactly one kv tile, so it is
    written exactly once per head chunk. The same gather of mult > 0 marks the slot valid.

Grid (B*nq "parallel", H/hc "arbitrary", passes*nk "arbitrary"). With default ids the kv tiles of a query tile are
the static causal prefix (`schedule.TileSchedule(causal=True)`, like the dense teacher), so the compiler and static
estimators see which steps run; otherwise they come from a conservative dense-style table (segment/causal overlap,
intersected with the range [min, max] of the tile's in-range indices), reduced to one contiguous range
[first, first + count) per query tile (`common.tile_ranges`) and passed by scalar prefetch as two [B*nq] vectors
(a per-tile list overflows SMEM at S=131072).

The multiplicity is K int32 compares per (query, block), more VPU work than the matmul's MXU work at the Flash
shape, so it is laid out for the VPU: the [bq, K_p] index block is transposed once per query tile into
[K_p/fold, fold*bq] (blocks on sublanes, queries on all 128 lanes; `slot_fold_width`), so each slot row is one loaded
row broadcast over sublanes (no cross-lane permutes), and four 8-bit counters share each int32 word (a quarter of
the compare/select/add lanes); the [bk, 128] counts are transposed back once per tile. Query tiles that do not fold
into 128 lanes use a row-major loop instead. The weights log(mult) are computed once per (query tile, kv tile),
unrolled in pass 1's basic block (the LLO scheduler overlaps part of them with the matmul), and kept in a VMEM
cache [nk, bq, bk] for pass 2 and the other head chunks (when <= 8 MiB). When they fit in VMEM (`cache_scores`),
pass 1 also keeps the masked scores z + log(mult) so pass 2 needs no second matmul; it divides the head sum by
mult again.

Output: f32 [B, S_p, K_p] in slot order, rows L1-normalised over their valid slots, and -1.0 on empty slots: the
sentinel carries V(t) to the KL kernels (`kl.py`, target_mask=True) without a separate [B, S, K] mask array.
Callers of the public teacher clamp it to 0. No [B, S, K, D], [B, H, S, K] or [B, S, N] array exists in HBM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common
from csa_pallas.kernels import fused_kl
from csa_pallas.kernels import rebase
from csa_pallas.kernels import schedule as schedule_lib
from csa_pallas.kernels import teacher as dense_teacher

MODES = dense_teacher.MODES
LANES = common.LANES
EMPTY_SLOT = -1.0  # value of empty slots in the kernel output (the KL kernels' support mask is P >= 0)
MiB = 1 << 20
# VMEM for the per-(query tile, kv tile) slot weights log(mult), [nk, bq, bk] f32, re-used by pass 2 and the
# other head chunks (the multiplicity is K int32 compares per (query, block): more VPU work than the matmul).
MAX_WEIGHT_CACHE_BYTES = 8 * MiB


def sparse_config(*, num_heads: int, head_dim: int, seq_len: int, num_blocks: int, width: int, dtype, mode: str,
                  head_chunk=None, cfg: dense_teacher.TeacherConfig = None,
                  kl_logits_dtype=None) -> dense_teacher.TeacherConfig:
    """The dense teacher's tiling with kv tiles of a multiple of 128 lanes (the lane gather works per 128-lane
    chunk) and VMEM for the [bq, K_p] index/output blocks, the transposed index block, the multiplicity
    temporaries and the weight cache; the score cache only when all of that still fits in VMEM.
    kl_logits_dtype: the fused-KL variant (logits in, G out, epilogue temporaries)."""
    if cfg is None:
        cfg = dense_teacher.default_config(num_heads=num_heads, head_dim=head_dim, seq_len=seq_len,
                                           num_blocks=max(num_blocks, 129), dtype=dtype, mode=mode,
                                           head_chunk=head_chunk)
        k_p = common.round_up(width, LANES)
        bk = 128 if num_blocks <= 128 else cfg.block_k
        n_p = common.round_up(max(num_blocks, 1), bk)
        cache = cfg.block_q * n_p * 4
        extra = 7 * cfg.block_q * k_p * 4 + 8 * cfg.block_q * bk * 4
        extra += cache if cache <= MAX_WEIGHT_CACHE_BYTES else 0
        if kl_logits_dtype is not None:
            lsz = jnp.dtype(kl_logits_dtype).itemsize
            extra += 4 * cfg.block_q * k_p * lsz + 8 * cfg.block_q * fused_kl.kl_chunk(k_p, fused_kl.FusedKL.chunk) * 4
        if cfg.cache_scores:
            # The dense calculator is an upper estimate (the Flash shape: 59 MiB + 1.7 MiB extra compiles under
            # 64 MiB), so compare against the physical VMEM rather than its usable fraction.
            need = dense_teacher.vmem_bytes(dataclasses.replace(cfg, block_k=bk), num_heads=num_heads,
                                            head_dim=head_dim, num_blocks=max(num_blocks, 1), dtype=dtype,
                                            mode=mode)
            if need + extra > dense_teacher.CHIPS[dense_teacher.DEFAULT_CHIP].vmem_bytes:
                cfg = dataclasses.replace(cfg, cache_scores=False)
        limit = min(cfg.vmem_limit_bytes + extra + 4 * MiB, 64 * MiB)
        return dataclasses.replace(cfg, block_k=bk, vmem_limit_bytes=limit)
    if cfg.block_k % LANES:
        raise ValueError(f"sparse mode needs block_k to be a multiple of {LANES}, got {cfg.block_k}")
    return cfg


def _multiplicity(idx_ref, base, *, block_q: int, block_k: int, width_p: int):
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


def _multiplicity_transposed(idx_t_ref, base, *, block_q: int, block_k: int, fold: int):
    """int32 [bq, bk] like `_multiplicity`, from the transposed index block idx_t_ref [K_p/fold, fold*bq].

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


def normalize_slots(head_sum: jax.Array) -> jax.Array:
    """L1 normalisation of slot-order head sums, f32 [..., K_p]; negative entries (empty slots, possibly summed
    over several shards) become EMPTY_SLOT."""
    valid = head_sum >= 0.0
    acc = jnp.where(valid, head_sum, 0.0)
    total = jnp.sum(acc, axis=-1, keepdims=True)
    return jnp.where(valid, acc / jnp.maximum(total, common.F32_TINY), EMPTY_SLOT)


def _kernel(tiles_ref, counts_ref, q_ref, kv_ref, qmeta_ref, kmeta_ref, idx_ref, *refs, mode, walk, nh, layout,
            group, scale, width_p, cache_weights, cache_scores, fold, normalize,
            kl: Optional[fused_kl.FusedKL] = None):
    schedule = walk.schedule
    refs = list(refs)
    lse_ref = shift_ref = None
    if mode != "per_head":
        lse_ref, shift_ref = refs.pop(0), refs.pop(0)  # (u or F) - sigma and sigma, see `rebase`
    rowmax_ref = None
    if kl is None:
        out_ref = refs.pop(0)  # the slot-order head sum accumulates in the resident output block
        if not normalize:
            rowmax_ref = refs.pop(0)
    else:
        logits_ref, stats_ref = refs.pop(0), refs.pop(0)
        grad_ref = refs.pop(0) if kl.emit_gradient else None
    m_ref, l_ref, f_ref, valid_ref, seen_ref, *extra = refs
    rows_ref = None if layout.token_major else extra.pop(0)
    weight_ref = extra.pop(0) if cache_weights else None
    score_ref = extra.pop(0) if cache_scores else None
    idx_t_ref = extra.pop(0) if fold else None
    if kl is not None:
        out_ref = extra.pop(0)  # f32 [bq, K_p] accumulator in scratch: the outputs are KL stats and dI
    top_ref = extra.pop(0) if (nh > 1 or rowmax_ref is not None) else None
    nk = schedule.nk
    bq, bk, hc = layout.block_q, schedule.block_k, layout.head_chunk
    n_chunks = width_p // LANES

    at = schedule_lib.kernel_view(walk, tiles_ref, counts_ref)
    c, step, in_pass1, k, tile, active = at.c, at.step, at.in_pass1, at.k, at.tile, at.active
    base = tile * bk

    @pl.when((c == 0) & (step == 0))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)
        valid_ref[...] = jnp.zeros_like(valid_ref)
        if top_ref is not None:
            top_ref[...] = jnp.full(top_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(step == 0)
    def _():
        if fold:
            idx_t_ref[...] = transpose_slots(idx_ref[...], fold)
        if not layout.token_major:
            common.gather_head_rows(q_ref, rows_ref, c, head_chunk=hc, group=group, block_q=bq)
        m_ref[...] = jnp.full(m_ref.shape, common.STAT_FLOOR, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        seen_ref[...] = jnp.zeros(seen_ref.shape, jnp.float32)

    def compute_weight():
        """log(multiplicity) of each block of the tile among the row's visible slots (-inf: not selected),
        f32 [bq, bk]. Reads the key metadata of `tile`: the walk keeps it resident wherever this runs."""
        if fold:
            mult = _multiplicity_transposed(idx_t_ref, base, block_q=bq, block_k=bk, fold=fold)
        else:
            mult = _multiplicity(idx_ref, base, block_q=bq, block_k=bk, width_p=width_p)
        visible = (kmeta_ref[0:1, :] == qmeta_ref[:, 0:1]) & (kmeta_ref[1:2, :] <= qmeta_ref[:, 1:2])
        mult = jnp.where(visible, mult, 0)
        return jnp.where(mult > 0, jnp.log(jnp.maximum(mult, 1).astype(jnp.float32)), -jnp.inf)

    def slot_weight(first_use):
        """The tile's weights; with the cache, computed once per (query tile, kv tile) at `first_use`."""
        if weight_ref is None:
            return compute_weight()
        if first_use is True:
            weight = compute_weight()
            weight_ref[k] = weight
            return weight

        @pl.when(first_use)
        def _():
            weight_ref[k] = compute_weight()

        return weight_ref[k]

    def scores():
        rows = q_ref[...].reshape(layout.rows, -1) if layout.token_major else rows_ref[...]
        z = lax.dot_general(rows, kv_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return (z * (scale * rebase.LOG2E)).reshape(*layout.view, bk)  # base 2

    @pl.when(in_pass1 & active)
    def _():
        weight = slot_weight(True if nh == 1 else c == 0)
        selected = jnp.max((weight >= 0.0).astype(jnp.float32), axis=1, keepdims=True)
        seen_ref[...] = jnp.maximum(seen_ref[...], selected)
        # sum_slots 2^z = sum_s mult * 2^z; a block no slot selects is -inf whatever its score (even a NaN one).
        z = jnp.where(layout.expand_mask(weight >= 0.0), scores() + layout.expand_mask(weight * rebase.LOG2E),
                      -jnp.inf)
        common.online_lse_update(m_ref, l_ref, z, LANES, base2=True)
        if cache_scores:
            score_ref[k] = z

    @pl.when(step == nk - 1)
    def _():  # the rebased finish (`rebase`): the pass-2 exponent shift G per (query, head)
        seen = layout.query_to_view(seen_ref[...] > 0)
        c2 = rebase.compressed_log2_mass(m_ref[...], l_ref[...], seen)
        lse2 = shift2 = None
        if mode != "per_head":
            lse2 = layout.block_to_column(lse_ref[...].astype(jnp.float32)) * rebase.LOG2E
            shift2 = layout.query_to_view(common.rows_to_column(shift_ref[0:1, :])) * rebase.LOG2E  # per row
        b = rebase.head_log2_mass(mode, c2, lse2, shift2)
        top = jnp.broadcast_to(layout.per_query_max(b), (bq, LANES))
        if top_ref is not None:
            previous = top_ref[...] if nh > 1 else jnp.full_like(top, -jnp.inf)
            top, factor = rebase.running_max(previous, top)
            top_ref[...] = top
            if nh > 1:
                @pl.when(c > 0)
                def _():
                    common.scale_rows(out_ref, factor)
        f_ref[...] = rebase.exponent_shift(c2, b, layout.query_to_view(top[:, :1]))

    @pl.when(jnp.logical_not(in_pass1) & active)
    def _():
        weight = slot_weight(False)
        sel = weight >= 0.0  # log(mult) >= 0 where selected
        if cache_scores:  # z + log2(mult), -inf where not selected: divide the head sum by mult again
            probs = jnp.sum(jnp.exp2(score_ref[k] - f_ref[...]), axis=layout.head_axis)  # [bq, bk]
            probs = jnp.where(sel, probs * jnp.exp(-jnp.where(sel, weight, 0.0)), 0.0)
        else:
            z = jnp.where(layout.expand_mask(sel), scores(), -jnp.inf)
            probs = jnp.sum(jnp.exp2(z - f_ref[...]), axis=layout.head_axis)  # [bq, bk]
            probs = jnp.where(sel, probs, 0.0)
        marks = sel.astype(jnp.float32)
        src = [(probs[:, j:j + LANES], marks[:, j:j + LANES]) for j in range(0, bk, LANES)]

        def body(ci, carry):
            lanes = pl.ds(pl.multiple_of(ci * LANES, LANES), LANES)
            local = idx_ref[:, lanes] - base  # [bq, 128] position of each slot's block inside the tile
            acc = jnp.zeros((bq, LANES), jnp.float32)
            hit = jnp.zeros((bq, LANES), jnp.float32)
            for j, (pj, mj) in enumerate(src):
                off = local - j * LANES
                inside = (off >= 0) & (off < LANES)
                safe = jnp.where(inside, off, 0)
                acc = acc + jnp.where(inside, jnp.take_along_axis(pj, safe, axis=1), 0.0)
                hit = hit + jnp.where(inside, jnp.take_along_axis(mj, safe, axis=1), 0.0)
            out_ref[:, lanes] += acc
            valid_ref[:, lanes] = jnp.maximum(valid_ref[:, lanes], hit)
            return carry

        lax.fori_loop(0, n_chunks, body, 0, unroll=True)

    if kl is not None:
        @pl.when((c == nh - 1) & (step == at.last_step))
        def _():
            fused_kl.kl_epilogue(kl, out_ref, logits_ref, stats_ref, grad_ref, mask_target=True,
                                 visible_at=lambda start, width: valid_ref[:, pl.ds(start, width)] > 0)
        return

    @pl.when((c == nh - 1) & (step == at.last_step))
    def _():
        valid = valid_ref[...] > 0
        acc = jnp.where(valid, out_ref[...], 0.0)
        if normalize:
            acc = acc / jnp.maximum(jnp.sum(acc, axis=1, keepdims=True), common.F32_TINY)
        else:
            rows = common.column_to_rows(top_ref[:, :1], 1)
            rowmax_ref[...] = jnp.concatenate([rows, jnp.zeros((common.SUBLANES - 1, bq), jnp.float32)], axis=0)
        out_ref[...] = jnp.where(valid, acc, EMPTY_SLOT)


def pass2_reads(*, cache_scores: bool, cache_weights: bool) -> dict:
    """What the kernel's pass 2 reads from the tile it walks: the kv block unless the scores are cached, the key
    metadata unless the slot weights are cached (it recomputes them)."""
    return dict(kv=not cache_scores, meta=not cache_weights)


def teacher_walk(schedule: schedule_lib.TileSchedule, *, cache_scores: bool, cache_weights: bool):
    """Both passes walk the tiles; what pass 2 does not read (`pass2_reads`) stays resident on the last pass-1
    tile, so nothing is re-fetched."""
    reads = pass2_reads(cache_scores=cache_scores, cache_weights=cache_weights)
    return schedule_lib.TeacherWalk(schedule, kind="plain", cached_pass2=False,
                                    pass2_kv="walk" if reads["kv"] else "resident",
                                    pass2_meta="walk" if reads["meta"] else "resident")


def sparse_teacher_pallas(q, kv, qmeta, kmeta, idx, tiles, counts, lse_in, *, mode: str,
                          cfg: dense_teacher.TeacherConfig, scale: float, schedule: schedule_lib.TileSchedule,
                          normalize: bool = True, kl: Optional[fused_kl.FusedKL] = None, logits=None,
                          interpret=False):
    """Runs the sparse teacher kernel on padded, prepared inputs.

    Args:
      q: [B, S_p, H, D] (bf16/f32), S_p a multiple of cfg.block_q.
      kv: [B, N_p, D] same dtype as q, N_p a multiple of cfg.block_k (a multiple of 128).
      qmeta: int32 [B, S_p, 128]; kmeta: int32 [B, 8, N_p] (see `common`; padding blocks invisible).
      idx: int32 [B, S_p, K_p] top-k indices (K_p a multiple of 128; padding slots -1). Any value is safe.
      tiles, counts: per-query-tile kv ranges from `common.tile_ranges` (firsts, counts), read by `schedule`
        (causal=True is also correct since the kernel masks exactly).
      lse_in: None (per_head), or ((u or F) - sigma, sigma) in the row layout's HBM form (see `teacher`).
      normalize: False leaves the valid slots as the unnormalised head sum and also returns the rows' M (heads
        sharded over devices; see `teacher.teacher_pallas`).
      kl, logits: the fused KL over the slots (the loss path), logits [B, S_p, K_p] (any float dtype); see
        `fused_kl.FusedKL` (V(t) = the row's valid slots).
      cfg.cache_weights / cfg.slot_fold: the variants of `teacher.TeacherConfig` (weights cache in VMEM, up to
        MAX_WEIGHT_CACHE_BYTES by default; transposed multiplicity).

    Returns:
      f32 [B, S_p, K_p]: P in slot order on valid slots (rows sum to 1; NaN on rows that read a non-finite input),
      EMPTY_SLOT (-1) on empty slots. normalize=False: (that head sum, M f32 [B, nq, 8, bq]). With `kl`: the KL
      statistics f32 [B, nq, 8, bq] and, with kl.emit_gradient, G [B, S_p, K_p] in the logits' dtype (as
      `teacher.teacher_pallas`).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    b, s_p, h, d = q.shape
    n_p = kv.shape[1]
    k_p = idx.shape[2]
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    if bk % LANES or k_p % LANES:
        raise ValueError(f"block_k ({bk}) and K_p ({k_p}) must be multiples of {LANES}")
    nq, nk, nh = s_p // bq, n_p // bk, h // hc
    group = common.head_group(h, hc, q.dtype)
    layout = dense_teacher.resolve_row_layout(cfg, h, q.dtype)
    if not layout.token_major and group != hc and hc % common.sublane_multiple(q.dtype) == 0:
        group = hc
    if cfg.walk not in ("auto", "plain"):
        raise ValueError(f"walk: the sparse teacher walks every query tile on its own ('plain'), got {cfg.walk!r}")
    cache_scores = cfg.cache_scores
    cache_weights = cfg.cache_weights
    if cache_weights is None:
        cache_weights = 2 * nh > 1 and bq * n_p * 4 <= MAX_WEIGHT_CACHE_BYTES
    can_fold = slot_fold_width(bq) if bk % (COUNTER_FIELDS * common.SUBLANES) == 0 else 0
    slot_fold = cfg.slot_fold
    if slot_fold and not can_fold:
        raise ValueError(f"slot_fold: the transposed multiplicity needs block_q ({bq}) to divide or be a multiple of "
                         f"128 and block_k ({bk}) a multiple of {COUNTER_FIELDS * common.SUBLANES}")
    fold = can_fold if slot_fold is None or slot_fold else 0
    walk = teacher_walk(schedule, cache_scores=cache_scores, cache_weights=cache_weights)
    maps = walk.index_maps(head_chunk=hc, group=group)

    in_specs = [
        pl.BlockSpec((None, bq, group, d), maps["q"]),
        pl.BlockSpec((None, bk, d), maps["kv"]),
        pl.BlockSpec((None, bq, LANES), maps["row"]),
        pl.BlockSpec((None, common.SUBLANES, bk), maps["kmeta"]),
        pl.BlockSpec((None, bq, k_p), maps["row"]),
    ]
    operands = [q, kv, qmeta, kmeta, idx]
    if mode != "per_head":
        in_specs += [pl.BlockSpec((None, None, None, *layout.view), maps["lse"]),
                     pl.BlockSpec((None, None, common.SUBLANES, bq), maps["qstats"])]
        operands += list(lse_in)
    out_specs = pl.BlockSpec((None, bq, k_p), maps["row"])
    out_shape = jax.ShapeDtypeStruct((b, s_p, k_p), jnp.float32)
    if kl is None and not normalize:
        out_specs = [out_specs, pl.BlockSpec((None, None, common.SUBLANES, bq), maps["stats"])]
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, nq, common.SUBLANES, bq), jnp.float32)]
    if kl is not None:
        logits_spec, out_specs, out_shape = fused_kl.fused_kl_blocks(kl, logits, maps["row"], block_q=bq)
        in_specs.append(logits_spec)
        operands.append(logits)
    scratch = [
        pltpu.VMEM((*layout.view, LANES), jnp.float32),
        pltpu.VMEM((*layout.view, LANES), jnp.float32),
        pltpu.VMEM((*layout.view, 1), jnp.float32),
        pltpu.VMEM((bq, k_p), jnp.float32),
        pltpu.VMEM((bq, 1), jnp.float32),  # rows with a selected visible block
    ]
    if not layout.token_major:
        scratch.append(pltpu.VMEM((hc * bq, d), q.dtype))
    if cache_weights:
        scratch.append(pltpu.VMEM((nk, bq, bk), jnp.float32))
    if cache_scores:
        scratch.append(pltpu.VMEM((nk, *layout.view, bk), jnp.float32))
    if fold:
        scratch.append(pltpu.VMEM((k_p // fold, fold * bq), jnp.int32))
    if kl is not None:
        scratch.append(pltpu.VMEM((bq, k_p), jnp.float32))
    if nh > 1 or (kl is None and not normalize):
        scratch.append(pltpu.VMEM((bq, LANES), jnp.float32))
    kernel = functools.partial(_kernel, mode=mode, walk=walk, nh=nh, layout=layout, group=group,
                               scale=scale, width_p=k_p, cache_weights=cache_weights, cache_scores=cache_scores,
                               fold=fold, normalize=normalize, kl=kl)
    order = "tok" if layout.token_major else "head"
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b * nq, nh, walk.steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=dense_teacher.cost_estimate(
            q, kv, schedule, batch=b, head_chunk=hc, matmuls=1 if cache_scores else 2,
            lse_inputs=0 if mode == "per_head" else 1, kl=kl, logits=logits,
            output_bytes=0 if kl is not None else b * s_p * k_p * 4, extra_bytes=idx.size * 4),
        interpret=interpret,
        name=f"csa_sparse_teacher_{mode}_bq{bq}_bk{bk}_hc{hc}_{order}{'_kl' if kl else ''}",
    )(tiles, counts, *operands)
