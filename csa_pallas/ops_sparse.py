"""Sparse (top-k) mode through the Pallas kernels: input preparation, kernel launches and the loss's custom_vjp.

Data flow of `indexer_distill_loss` (sparse mode):

  q, compressed_kv, topk_indices, ids ──> [window_lse kernel ─> u] ──> sparse teacher kernel
      ──> P' (f32 [B,S,K], slot order, -1 on empty slots, stop-gradient)
  P', indexer_logits ──> KL forward kernel (target_mask: V(t) = {P' >= 0}) ──> per-row KL, lse, sum P, non-empty
  backward: KL backward kernel(P', logits, lse, cotangent) ──> dI;  zeros for every teacher input.

The raw top-k indices go to the kernel untouched (no validity pre-folding, which would cost a second [B, S, K]
int32 array in HBM): the kernel matches them against the ids of the blocks of each kv tile and masks the match with
the dense visibility, so -1 / out-of-range / future / other-document slots are simply never matched. The slot
validity then travels to the KL inside P' itself (-1 sentinel), so the only [B, S, K]-sized temporary is P'.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from csa_pallas import masks
from csa_pallas import ops
from csa_pallas import reference
from csa_pallas.kernels import common
from csa_pallas.kernels import fused_kl
from csa_pallas.kernels import runtime
from csa_pallas.kernels import schedule as schedule_lib
from csa_pallas.kernels import sparse_teacher
from csa_pallas.kernels import teacher as teacher_kernel
from csa_pallas.validation import Problem

# Widest KL tile along the slots (lanes); K_p above it is walked in 128-lane tiles.
MAX_KL_LANES = 2048


@dataclasses.dataclass(frozen=True)
class SparseLayout:
    cfg: teacher_kernel.TeacherConfig
    schedule: schedule_lib.TileSchedule
    qmeta: jax.Array  # int32 [B, S_p, 128]
    kmeta: jax.Array  # int32 [B, 8, N_p]
    tiles: jax.Array  # int32 [B*nq] first kv tile of each query tile
    counts: jax.Array  # int32 [B*nq] number of kv tiles from there
    padded_seq: int
    padded_blocks: int
    padded_width: int


def _tile_need(problem: Problem, qmeta, kmeta, cfg, s_p: int, n_p: int):
    """Dense-style conservative table, intersected with [min, max] of each query tile's in-range indices."""
    need = common.tile_need(qmeta, kmeta, cfg.block_q, cfg.block_k)  # [B, nq, nk]
    b, s, k = problem.topk_indices.shape
    n = problem.num_blocks
    idx = ops.pad_axis(problem.topk_indices.astype(jnp.int32), 1, s_p, -1)
    idx = idx.reshape(b, s_p // cfg.block_q, cfg.block_q * k)
    in_range = (idx >= 0) & (idx < n)
    lo = jnp.min(jnp.where(in_range, idx, n_p), axis=-1)  # [B, nq]
    hi = jnp.max(jnp.where(in_range, idx, -1), axis=-1)
    tile_lo = jnp.arange(n_p // cfg.block_k, dtype=jnp.int32) * cfg.block_k
    tile_hi = tile_lo + cfg.block_k - 1
    overlap = (tile_hi[None, None, :] >= lo[..., None]) & (tile_lo[None, None, :] <= hi[..., None])
    return need & overlap


def sparse_layout(problem: Problem, cfg=None, kl_logits_dtype=None) -> SparseLayout:
    """cfg: a `TeacherConfig`, or a Mapping of its fields overriding the heuristic default (None: the default).
    kl_logits_dtype: size the default tiles for the fused-KL kernel (the loss path)."""
    dtype = ops.compute_dtype(problem.q, problem.compressed_kv)
    overrides = None if isinstance(cfg, teacher_kernel.TeacherConfig) else cfg
    cfg = sparse_teacher.sparse_config(num_heads=problem.num_heads, head_dim=problem.head_dim,
                                       seq_len=problem.seq_len, num_blocks=problem.num_blocks,
                                       width=problem.width, dtype=dtype, mode=ops.teacher_mode(problem),
                                       head_chunk=problem.head_chunk, cfg=None if overrides is not None else cfg,
                                       kl_logits_dtype=kl_logits_dtype)
    cfg = teacher_kernel.with_overrides(cfg, overrides)
    s_p = common.round_up(problem.seq_len, cfg.block_q)
    n_p = teacher_kernel.padded_blocks(problem.num_blocks, cfg.block_k)
    k_p = common.round_up(problem.width, common.LANES)
    qmeta = common.query_meta(problem.segment_ids, ops.query_positions(problem), s_p)
    block_segment, block_end = reference.block_keys(problem)
    kmeta = common.key_meta(block_segment, block_end, n_p, masks.INVALID_BLOCK_END)
    tiles, counts = common.tile_ranges(_tile_need(problem, qmeta, kmeta, cfg, s_p, n_p))
    schedule = schedule_lib.TileSchedule(causal=ops.causal_schedule(problem), nq=s_p // cfg.block_q,
                                         nk=n_p // cfg.block_k, block_q=cfg.block_q, block_k=cfg.block_k,
                                         ratio=problem.compress_ratio, num_blocks=problem.num_blocks)
    return SparseLayout(cfg=cfg, schedule=schedule, qmeta=qmeta, kmeta=kmeta, tiles=tiles, counts=counts,
                        padded_seq=s_p, padded_blocks=n_p, padded_width=k_p)


def teacher_inputs(problem: Problem, layout: SparseLayout, reduce_low=None):
    """(mode, q, kv, idx, lse_in): the sparse teacher kernel's padded operands (stop-gradient); reduce_low: see
    `ops.lse_blocks`."""
    cfg = layout.cfg
    mode = ops.teacher_mode(problem)
    dtype = ops.compute_dtype(problem.q, problem.compressed_kv)
    q = ops.pad_axis(jax.lax.stop_gradient(problem.q).astype(dtype), 1, layout.padded_seq)
    kv = ops.nan_filled_rows(jax.lax.stop_gradient(problem.compressed_kv).astype(dtype))
    kv = ops.pad_axis(kv, 1, layout.padded_blocks)
    idx = problem.topk_indices.astype(jnp.int32)
    idx = ops.pad_axis(ops.pad_axis(idx, 1, layout.padded_seq, -1), 2, layout.padded_width, -1)
    lse_in = ops.lse_blocks(ops.teacher_lse(problem), problem, cfg, layout.padded_seq, dtype, reduce_low)
    return mode, q, kv, idx, lse_in


def teacher_padded(problem: Problem, layout: SparseLayout, normalize: bool = True, reduce_low=None):
    """P' f32 [B, S_p, K_p]: slot-order target on valid slots, -1 on empty slots (and padding). normalize=False:
    (the unnormalised slot head sum, the rows' M f32 [B, S_p], base 2), see `ops.teacher_padded`."""
    mode, q, kv, idx, lse_in = teacher_inputs(problem, layout, reduce_low)
    out = sparse_teacher.sparse_teacher_pallas(q, kv, layout.qmeta, layout.kmeta, idx, layout.tiles,
                                               layout.counts, lse_in, mode=mode, cfg=layout.cfg,
                                               scale=problem.softmax_scale, schedule=layout.schedule,
                                               normalize=normalize, interpret=runtime.interpret_mode())
    if normalize:
        return jax.lax.stop_gradient(out)
    head_sum, rowmax = out
    return jax.lax.stop_gradient(head_sum), jax.lax.stop_gradient(rowmax[:, :, 0, :].reshape(problem.batch, -1))


def teacher_distribution(problem: Problem, cfg=None) -> jax.Array:
    """P, f32 [B, S, K] in slot order (0 on empty slots and empty rows)."""
    b, s, k = problem.batch, problem.seq_len, problem.width
    if problem.num_blocks == 0:
        return jnp.zeros((b, s, k), jnp.float32)
    layout = sparse_layout(problem, cfg)
    return jnp.maximum(teacher_padded(problem, layout)[:, :s, :k], 0.0)


def _kl_schedule(batch: int, s_p: int, k_p: int, block_q: int):
    bk = k_p if k_p <= MAX_KL_LANES else common.LANES
    nq, nk = s_p // block_q, k_p // bk
    schedule = schedule_lib.TileSchedule(causal=False, nq=nq, nk=nk, block_q=block_q, block_k=bk, ratio=1,
                                         num_blocks=k_p)
    firsts = jnp.zeros((batch * nq,), jnp.int32)  # every query tile visits every slot tile
    counts = jnp.full((batch * nq,), nk, jnp.int32)
    return schedule, firsts, counts


def kl_rows(indexer_logits, target_padded, layout: SparseLayout):
    """Per-row KL [B, S] over the K slots and the non-empty row mask [B, S] (validity read from P >= 0)."""
    schedule, firsts, counts = _kl_schedule(indexer_logits.shape[0], layout.padded_seq, layout.padded_width,
                                            layout.cfg.block_q)
    return ops.padded_kl_rows(indexer_logits, target_padded, qmeta=None, kmeta=None, firsts=firsts, counts=counts,
                              schedule=schedule, target_mask=True)


def _run_sparse(static: ops.FusedStatic, kl, logits, operands):
    q, kv, idx, lse_in, qmeta, kmeta, tiles, counts = operands
    return sparse_teacher.sparse_teacher_pallas(q, kv, qmeta, kmeta, idx, tiles, counts, lse_in, mode=static.mode,
                                                cfg=static.cfg, scale=static.scale, schedule=static.schedule,
                                                kl=kl, logits=logits, interpret=static.interpret)


def fused_kl_rows(indexer_logits, problem: Problem, layout: SparseLayout,
                  kl_chunk: int = fused_kl.FusedKL.chunk):
    """Per-row KL over the K slots [B, S] and the non-empty mask [B, S] from the sparse teacher kernel with the
    fused KL (P stays in VMEM; V(t) = the row's valid slots)."""
    mode, q, kv, idx, lse_in = teacher_inputs(problem, layout)
    static = ops.FusedStatic(_run_sparse, mode, layout.cfg, layout.schedule, problem.softmax_scale,
                             problem.seq_len, runtime.interpret_mode(), layout.cfg.kl_chunk or kl_chunk)
    operands = (q, kv, idx, lse_in, layout.qmeta, layout.kmeta, layout.tiles, layout.counts)
    return ops.fused_rows(indexer_logits, static, operands, padded_seq=layout.padded_seq,
                          padded_width=layout.padded_width)


def indexer_distill_loss(indexer_logits, problem: Problem, *, reduction: str = "mean", scale=1.0, cfg=None):
    """Sparse-mode loss through the fused sparse teacher + KL kernel; same contract as
    `reference.indexer_distill_loss`."""
    return ops.loss_through_kernels(
        indexer_logits, problem,
        make_layout=lambda pr: sparse_layout(pr, cfg, kl_logits_dtype=ops.logits_dtype(indexer_logits)),
        make_target=lambda pr, layout: pr,
        make_kl_rows=lambda logits, pr, layout: fused_kl_rows(logits, pr, layout), reduction=reduction,
        scale=scale)
