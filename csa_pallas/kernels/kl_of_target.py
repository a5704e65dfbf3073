"""KL(P || softmax_V(I)) of a target P already in HBM: forward and backward kernels (SPEC §4-§5).

Used where P must exist before the KL (the heads-sharded loss reduces head sums across devices first); everywhere
else the KL is fused into the teacher's last step (`fused_kl.py`).

Forward, grid (B*nq "parallel", nk "arbitrary") over the kv tiles a query tile needs (same compacted table as the
teacher): one pass over P and I tiles keeps, per lane, the student's running max/sum and the partial sums
  s1 = sum P log P,   a = sum P (I - m),   s3 = sum P,   count = |V(t)|
where m is the lane's running max (re-based when m grows, so no large terms cancel). At the end
  lse = logsumexp_V(I),   KL = s1 - sum_lanes (a + s3 (m - lse)).
Outputs per row (stats [B, nq, 8, bq]): row 0 KL, row 1 lse, row 2 sum P, row 3 non-empty flag.

Backward, grid (B*nq, nk) over every kv tile (it writes the whole gradient):
  dI = coef * (exp(I - lse) * sum P - P) on V(t), 0 elsewhere,
with coef = the incoming per-row cotangent (scale * g / n after the reduction's own VJP). exp(I - lse)*sum P - P
is the exact derivative of the KL actually computed; it equals SPEC §5's Q - P whenever the teacher row has mass 1.
Tiles no query of the tile can see are written as zeros without reading P or I.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, runtime
from csa_pallas.kernels import schedule as schedule_lib

STAT_ROWS = 8  # KL, lse, sum P, non-empty, padding to one sublane tile
MiB = common.MiB


def _visible(qmeta_ref, kmeta_ref):
    return (kmeta_ref[0:1, :] == qmeta_ref[:, 0:1]) & (kmeta_ref[1:2, :] <= qmeta_ref[:, 1:2])


def _fwd_kernel(firsts_ref, counts_ref, p_ref, i_ref, *refs, schedule, target_mask=False):
    if target_mask:  # sparse mode: V(t) is encoded in the target itself (P >= 0 on valid slots, -1 elsewhere)
        qmeta_ref = kmeta_ref = None
        stats_ref, m_ref, l_ref, s1_ref, a_ref, s3_ref, cnt_ref = refs
    else:
        qmeta_ref, kmeta_ref, stats_ref, m_ref, l_ref, s1_ref, a_ref, s3_ref, cnt_ref = refs
    nq, nk = schedule.nq, schedule.nk
    lanes = min(common.LANES, schedule.block_k)
    pid = pl.program_id(0)
    k = pl.program_id(1)
    b = common.index_div(pid, nq)
    qi = common.zigzag(common.index_rem(pid, nq), nq)
    count = schedule.count(counts_ref, b, qi)

    @pl.when(k == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, common.STAT_FLOOR, jnp.float32)
        for ref in (l_ref, s1_ref, a_ref, s3_ref, cnt_ref):
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    @pl.when(k < count)
    def _():
        # Sparse targets mark empty slots with -1; a NaN P (a row that read a non-finite input) is visible.
        visible = jnp.logical_not(p_ref[...] < 0.0) if target_mask else _visible(qmeta_ref, kmeta_ref)
        x = jnp.where(visible, i_ref[...].astype(jnp.float32), -jnp.inf)
        prob = jnp.where(visible, p_ref[...], 0.0)
        xs = common.lane_chunks(x, lanes)
        ps = common.lane_chunks(prob, lanes)
        vs = common.lane_chunks(visible, lanes)
        m_old = m_ref[...]
        m_new = m_old
        for xc in xs:
            m_new = jnp.maximum(m_new, xc)
        l_acc = l_ref[...] * jnp.exp(m_old - m_new)
        a_acc = a_ref[...] + s3_ref[...] * (m_old - m_new)
        s1_acc, s3_acc, cnt_acc = s1_ref[...], s3_ref[...], cnt_ref[...]
        for xc, pc, vc in zip(xs, ps, vs):
            l_acc = l_acc + jnp.exp(xc - m_new)
            positive = pc != 0  # 0 log 0 = 0; a NaN is not 0
            a_acc = a_acc + jnp.where(positive, pc * (xc - m_new), 0.0)
            s1_acc = s1_acc + jnp.where(positive, pc * jnp.log(jnp.where(positive, pc, 1.0)), 0.0)
            s3_acc = s3_acc + pc
            cnt_acc = cnt_acc + vc.astype(jnp.float32)
        m_ref[...] = m_new
        l_ref[...] = l_acc
        a_ref[...] = a_acc
        s1_ref[...] = s1_acc
        s3_ref[...] = s3_acc
        cnt_ref[...] = cnt_acc

    @pl.when(k == nk - 1)
    def _():
        lse = common.finish_lse(m_ref[...], l_ref[...])  # [bq, 1]
        # A row whose target has no mass (every head's a_h = -inf) is empty; a NaN sum is not 0.
        nonempty = (jnp.sum(cnt_ref[...], axis=1, keepdims=True) > 0) & (
            jnp.sum(s3_ref[...], axis=1, keepdims=True) != 0)
        lse = jnp.where(nonempty, lse, 0.0)
        s3 = s3_ref[...]
        kl = jnp.sum(s1_ref[...], axis=1, keepdims=True) - jnp.sum(
            a_ref[...] + s3 * (m_ref[...] - lse), axis=1, keepdims=True)
        kl = jnp.where(nonempty, kl, 0.0)
        psum = jnp.sum(s3, axis=1, keepdims=True)
        zeros = jnp.zeros_like(kl)
        cols = jnp.concatenate([kl, lse, psum, nonempty.astype(jnp.float32)] + [zeros] * (STAT_ROWS - 4), axis=0)
        stats_ref[...] = common.column_to_rows(cols, STAT_ROWS)


def _tile_inputs(target, logits, qmeta, kmeta, bq: int, bk: int, tile_map, row_map, kmeta_map, target_mask: bool):
    """BlockSpecs and operands both KL kernels read per (query tile, kv tile): the P and I tiles and, for dense
    targets, the rows' and blocks' visibility metadata."""
    in_specs = [pl.BlockSpec((None, bq, bk), tile_map), pl.BlockSpec((None, bq, bk), tile_map)]
    operands = [target, logits]
    if not target_mask:
        in_specs += [pl.BlockSpec((None, bq, common.LANES), row_map),
                     pl.BlockSpec((None, common.SUBLANES, bk), kmeta_map)]
        operands += [qmeta, kmeta]
    return in_specs, operands


def _cost(target, logits, schedule: schedule_lib.TileSchedule, *, target_mask: bool, backward: bool,
          rowstats_bytes: int) -> pl.CostEstimate:
    """HBM bytes and element work of one KL launch: the P and I tiles of the visited kv tiles (every tile the
    schedule allows; the backward's other steps keep a visited tile resident), the rows' int32 [bq, 128] and the
    fetched tiles' int32 [8, bk] visibility metadata for dense targets (the backward fetches a kmeta block at
    every kv step), the row statistics, and the backward's whole gradient written."""
    b, s_p, n_p = target.shape
    tiles = schedule.visited_tiles(b)
    elements = tiles * schedule.block_q * schedule.block_k
    moved = elements * (target.dtype.itemsize + logits.dtype.itemsize) + rowstats_bytes
    if not target_mask:
        kmeta_fetches = b * schedule.nq * schedule.nk if backward else tiles
        moved += common.ids_metadata_bytes(b * s_p, kmeta_fetches, schedule.block_k)
    if backward:
        moved += b * s_p * n_p * logits.dtype.itemsize
    # forward: max, exp, two products and a log per element; backward: an exp and three products
    return pl.CostEstimate(flops=8 * elements, transcendentals=(1 if backward else 2) * elements,
                           bytes_accessed=moved)


def kl_forward_pallas(target, logits, qmeta, kmeta, firsts, counts, *, schedule: schedule_lib.TileSchedule,
                      interpret=False, target_mask: bool = False):
    """Per-row KL and student statistics.

    Args:
      target: P, f32 [B, S_p, N_p]; logits: I, float [B, S_p, N_p]; qmeta [B, S_p, 128], kmeta [B, 8, N_p];
      firsts, counts, schedule: the teacher's kv-tile schedule (same block_q, block_k).
      target_mask: sparse mode: V(t) = {P >= 0} (the sparse teacher writes -1 on empty slots); qmeta and kmeta
        must then be None.

    Returns:
      f32 [B, nq, 8, bq]: row 0 KL, row 1 lse (0 on empty rows), row 2 sum P, row 3 non-empty (1/0).
    """
    b, s_p, n_p = target.shape
    bq, bk = schedule.block_q, schedule.block_k
    nq, nk = schedule.nq, schedule.nk
    lanes = min(common.LANES, bk)

    def tile_map(pid, k, firsts_ref, counts_ref):
        bb = common.index_div(pid, nq)
        qi = common.zigzag(common.index_rem(pid, nq), nq)
        return bb, qi, schedule.tile(firsts_ref, counts_ref, bb, qi, k)

    def p_map(pid, k, firsts_ref, counts_ref):
        return tile_map(pid, k, firsts_ref, counts_ref)

    def kmeta_map(pid, k, firsts_ref, counts_ref):
        bb, _, tile = tile_map(pid, k, firsts_ref, counts_ref)
        return bb, 0, tile

    def row_map(pid, k, firsts_ref, counts_ref):
        bb, qi, _ = tile_map(pid, k, firsts_ref, counts_ref)
        return bb, qi, 0

    def stats_map(pid, k, firsts_ref, counts_ref):
        bb, qi, _ = tile_map(pid, k, firsts_ref, counts_ref)
        return bb, qi, 0, 0

    kernel = functools.partial(_fwd_kernel, schedule=schedule, target_mask=target_mask)
    vmem = 2 * (2 * bq * bk * 4 + bq * common.LANES * 4 + common.SUBLANES * max(bk, 128) * 4) + 6 * bq * 128 * 4
    in_specs, operands = _tile_inputs(target, logits, qmeta, kmeta, bq, bk, p_map, row_map, kmeta_map, target_mask)
    return runtime.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b * nq, nk),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, STAT_ROWS, bq), stats_map),
            scratch_shapes=[pltpu.VMEM((bq, lanes), jnp.float32) for _ in range(6)],
        ),
        out_shape=jax.ShapeDtypeStruct((b, nq, STAT_ROWS, bq), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=max(32 * MiB, 2 * vmem + 8 * MiB)),
        cost_estimate=_cost(target, logits, schedule, target_mask=target_mask, backward=False,
                            rowstats_bytes=b * nq * STAT_ROWS * bq * 4),
        interpret=interpret,
        name=f"csa_kl_fwd_bq{bq}_bk{bk}{'_sparse' if target_mask else ''}",
    )(firsts, counts, *operands)


def _bwd_kernel(firsts_ref, counts_ref, p_ref, i_ref, *refs, schedule, target_mask=False):
    if target_mask:
        qmeta_ref = kmeta_ref = None
        rowstats_ref, grad_ref, cols_ref = refs
    else:
        qmeta_ref, kmeta_ref, rowstats_ref, grad_ref, cols_ref = refs
    nq, block_q = schedule.nq, schedule.block_q
    pid = pl.program_id(0)
    k = pl.program_id(1)
    b = common.index_div(pid, nq)
    qi = common.index_rem(pid, nq)

    @pl.when(k == 0)
    def _():
        cols_ref[...] = common.rows_to_column(rowstats_ref[...]).reshape(STAT_ROWS, block_q, 1)

    _, needed = schedule.natural(firsts_ref, counts_ref, b, qi, k)

    @pl.when(needed)
    def _():
        visible = jnp.logical_not(p_ref[...] < 0.0) if target_mask else _visible(qmeta_ref, kmeta_ref)
        lse, coef, psum = cols_ref[0], cols_ref[1], cols_ref[2]  # [bq, 1] each
        logits = jnp.where(visible, i_ref[...].astype(jnp.float32), 0.0)
        student = jnp.exp(logits - lse)
        grad = jnp.where(visible, coef * (student * psum - p_ref[...]), 0.0)
        grad_ref[...] = grad.astype(grad_ref.dtype)

    @pl.when(jnp.logical_not(needed))
    def _():
        grad_ref[...] = jnp.zeros(grad_ref.shape, grad_ref.dtype)


def kl_backward_pallas(target, logits, qmeta, kmeta, firsts, counts, rowstats, *, schedule: schedule_lib.TileSchedule,
                       interpret=False, target_mask: bool = False):
    """Gradient of sum_t coef[t] * KL[t] wrt the logits.

    Args:
      target, logits, qmeta, kmeta: as in `kl_forward_pallas`.
      firsts, counts, schedule: the teacher's kv-tile schedule; the backward walks every kv tile in natural order.
      rowstats: f32 [B, nq, 8, bq]: row 0 lse, row 1 coef, row 2 sum P (rest unused).
      target_mask: as in `kl_forward_pallas`.

    Returns:
      dI with the logits' dtype, [B, S_p, N_p].
    """
    b, s_p, n_p = target.shape
    bq, bk = schedule.block_q, schedule.block_k
    nq, nk = schedule.nq, schedule.nk

    def in_map(pid, k, firsts_ref, counts_ref):
        bb = common.index_div(pid, nq)
        qi = common.index_rem(pid, nq)
        return bb, qi, schedule.natural(firsts_ref, counts_ref, bb, qi, k)[0]

    def kmeta_map(pid, k, firsts_ref, counts_ref):
        return common.index_div(pid, nq), 0, k

    def row_map(pid, k, firsts_ref, counts_ref):
        return common.index_div(pid, nq), common.index_rem(pid, nq), 0

    def stats_map(pid, k, firsts_ref, counts_ref):
        return common.index_div(pid, nq), common.index_rem(pid, nq), 0, 0

    def out_map(pid, k, firsts_ref, counts_ref):
        return common.index_div(pid, nq), common.index_rem(pid, nq), k

    kernel = functools.partial(_bwd_kernel, schedule=schedule, target_mask=target_mask)
    vmem = 2 * (3 * bq * bk * 4 + bq * common.LANES * 4 + common.SUBLANES * max(bk, 128) * 4)
    in_specs, operands = _tile_inputs(target, logits, qmeta, kmeta, bq, bk, in_map, row_map, kmeta_map, target_mask)
    in_specs.append(pl.BlockSpec((None, None, STAT_ROWS, bq), stats_map))
    operands.append(rowstats)
    return runtime.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b * nq, nk),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, bq, bk), out_map),
            scratch_shapes=[pltpu.VMEM((STAT_ROWS, bq, 1), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((b, s_p, n_p), logits.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=max(32 * MiB, 2 * vmem + 8 * MiB)),
        cost_estimate=_cost(target, logits, schedule, target_mask=target_mask, backward=True,
                            rowstats_bytes=rowstats.size * 4),
        interpret=interpret,
        name=f"csa_kl_bwd_bq{bq}_bk{bk}{'_sparse' if target_mask else ''}",
    )(firsts, counts, *operands)
