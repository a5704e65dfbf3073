"""The Pallas implementation of the public ops: input preparation, kernel launches, and the loss's custom_vjp.

Data flow of `indexer_distill_loss` (dense mode):

  q, compressed_kv, ids ──> [window_lse kernel ─> u] ──┐
  indexer_logits ──────────────────────────────────────┴─> teacher kernel with the KL fused into its last step
      ──> per-row KL, lse, sum P, non-empty (f32 [B, nq, 8, bq]) ──> reduction (XLA)
      ──> (under jax.grad) G = softmax_V(I) * sum P - P, logits dtype [B, S, N]: the only saved residual
  backward: dI = per-row cotangent * G (one XLA multiply); zeros for every teacher input (stop-gradient).

What is saved between forward and backward: neither P (f32 [B, S, N]) nor the logits, but G in the logits'
dtype, written by the forward kernel while P and the student LSE are still in VMEM. Recomputing P would repeat
the teacher (the dominant cost); saving P costs one f32 [B, S, N] array plus a backward kernel re-reading P and I.
Saving G halves that array for bf16 logits and leaves the backward a single elementwise multiply. The price is one
extra rounding of G to the logits' dtype before the multiply (<= 1 ulp of the bf16 gradient; none in f32).

`teacher_distribution` and the heads-sharded loss (`csa_pallas.sharding`) still materialise P and use the
stand-alone KL kernels (`loss_vjp.padded_kl_rows`): the public op returns P, and with heads sharded the head sums
must be reduced across devices before the KL. The custom_vjps both modes share live in `csa_pallas.loss_vjp`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from csa_pallas import masks
from csa_pallas import reference
from csa_pallas import validation
from csa_pallas.kernels import common
from csa_pallas.kernels import fused_kl
from csa_pallas.kernels import runtime
from csa_pallas.kernels import schedule as schedule_lib
from csa_pallas.kernels import teacher as teacher_kernel
from csa_pallas.kernels import teacher_config
from csa_pallas.kernels import window_lse as window_kernel
from csa_pallas.validation import Problem
from csa_pallas.loss_vjp import (FusedStatic, fused_rows, fused_weighted_loss, logits_dtype,  # noqa: F401
                                 loss_through_kernels, pad_axis, padded_kl_rows, uniform_row_weight)


def compute_dtype(*arrays):
    """The kernels' MXU input dtype: bf16 when every input is bf16, else f32 (float16 is computed as its exact f32
    upcast: Mosaic on v5p has no f16 vector loads)."""
    dtype = jnp.result_type(*[a.dtype for a in arrays if a is not None])
    return jnp.dtype(jnp.bfloat16) if dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)


def kernel_keys(problem: Problem):
    """compressed_kv as the teacher kernels read it: stop-gradient, in `compute_dtype`, every row holding a
    non-finite value NaN (`nan_filled_rows`); as given when problem.kv_ready says it already is."""
    if problem.kv_ready:
        return problem.compressed_kv
    return nan_filled_rows(cast_keys(problem))


def cast_keys(problem: Problem):
    """compressed_kv stop-gradient in `compute_dtype` (no copy when it already is), non-finite rows as given."""
    return jax.lax.stop_gradient(problem.compressed_kv).astype(compute_dtype(problem.q, problem.compressed_kv))


def nan_filled_rows(x):
    """x [B, R, D] with every row that holds a NaN or +-inf replaced by NaN: the rows that read it then become
    NaN through their scores (SPEC §3), whatever the signs (a lone -inf score would otherwise silently vanish)."""
    return jnp.where(jnp.all(jnp.isfinite(x), axis=-1, keepdims=True), x, jnp.nan).astype(x.dtype)


def causal_schedule(problem: Problem) -> bool:
    """The kernels' static causal schedule (iota masks, no metadata) applies: default ids and no loss_mask."""
    return problem.default_ids and problem.loss_mask is None


def query_positions(problem: Problem):
    """Query positions for the kernels' metadata: a row with loss_mask False gets PAD_POSITION, so it sees
    nothing (no block, no window key) and is an empty row everywhere."""
    if problem.loss_mask is None:
        return problem.positions
    return jnp.where(problem.loss_mask, problem.positions, common.PAD_POSITION)


def row_low(stats):
    """The smallest value over heads of u or F [B, S, H] (not yet made finite: shards of the heads reduce it first,
    see `row_shift_from_low`): f32 [B, S]."""
    return jnp.min(stats.astype(jnp.float32), axis=-1)


def row_shift_from_low(low):
    """sigma = the row's smallest u (or F) over all heads, 0 when not finite (`reference.row_shift`)."""
    return jnp.where(jnp.isfinite(low), low, 0.0)


def row_stats_to_hbm(x, padded_seq: int, block_q: int):
    """A per-row value f32 [B, S] -> the kernels' lane-dense row-statistics layout [B, nq, 8, bq] (row 0)."""
    b = x.shape[0]
    x = pad_axis(x, 1, padded_seq).reshape(b, padded_seq // block_q, 1, block_q)
    return jnp.pad(x, ((0, 0), (0, 0), (0, common.SUBLANES - 1), (0, 0)))


@dataclasses.dataclass(frozen=True)
class DenseLayout:
    """Padded kernel inputs shared by the teacher and KL kernels (block sizes from the teacher config)."""

    cfg: teacher_config.TeacherConfig
    schedule: schedule_lib.TileSchedule
    seq_len: int
    num_blocks: int
    qmeta: jax.Array  # int32 [B, S_p, 128]
    kmeta: jax.Array  # int32 [B, 8, N_p]
    firsts: jax.Array  # int32 [B*nq] first kv tile each query tile visits
    counts: jax.Array  # int32 [B*nq] number of kv tiles it visits

    @property
    def padded_seq(self) -> int:
        return self.qmeta.shape[1]

    @property
    def padded_blocks(self) -> int:
        return self.kmeta.shape[2]


def teacher_mode(problem: Problem) -> str:
    if problem.target == "per_head":
        return "per_head"
    return "full_lse" if problem.full_lse is not None else "joint"


def dense_layout(problem: Problem, cfg=None, kl_logits_dtype=None) -> DenseLayout:
    """cfg: a `TeacherConfig`, or a Mapping of its fields overriding the heuristic default (None: the default).
    kl_logits_dtype: size the default tiles for the fused-KL teacher (the loss path) with logits of that dtype."""
    dtype = compute_dtype(problem.q, problem.compressed_kv)
    cfg = problem.layout_config if cfg is None else cfg  # the fused op's config=
    if not isinstance(cfg, teacher_config.TeacherConfig):
        default = teacher_config.default_config(num_heads=problem.num_heads, head_dim=problem.head_dim,
                                                seq_len=problem.seq_len, num_blocks=problem.num_blocks, dtype=dtype,
                                                mode=teacher_mode(problem), head_chunk=problem.head_chunk,
                                                kl_logits_dtype=kl_logits_dtype)
        cfg = teacher_config.with_overrides(default, cfg)
    s_p = common.round_up(problem.seq_len, cfg.block_q)
    n_p = teacher_config.padded_blocks(problem.num_blocks, cfg.block_k)
    qmeta = common.query_meta(problem.segment_ids, query_positions(problem), s_p)
    block_segment, block_end = reference.block_keys(problem)
    kmeta = common.key_meta(block_segment, block_end, n_p, masks.INVALID_BLOCK_END)
    need = common.tile_need(qmeta, kmeta, cfg.block_q, cfg.block_k)
    firsts, counts = common.tile_ranges(need)
    schedule = schedule_lib.TileSchedule(causal=causal_schedule(problem), nq=s_p // cfg.block_q,
                                         nk=n_p // cfg.block_k, block_q=cfg.block_q, block_k=cfg.block_k,
                                         ratio=problem.compress_ratio, num_blocks=problem.num_blocks)
    return DenseLayout(cfg=cfg, schedule=schedule, seq_len=problem.seq_len, num_blocks=problem.num_blocks,
                       qmeta=qmeta, kmeta=kmeta, firsts=firsts, counts=counts)


def window_supported_reason(problem: Problem) -> Optional[str]:
    """Why the window-LSE kernel cannot serve this problem, or None. Its contract: the key sequence is the query
    sequence and every document is one contiguous run with strictly increasing positions (`masks.window_layout_ok`,
    MaxText packing), so a window key of query t lies in [t - W + 1, t]. Checked here when the ids are concrete;
    traced ids are the caller's promise (`csa_pallas.check_window_layout` checks it under checkify)."""
    if problem.window_kv is None or problem.target != "joint":
        return None
    if problem.kv_len != problem.seq_len:
        return (f"the window-LSE kernel needs the key sequence to be the query sequence (S_kv == S), got "
                f"S_kv={problem.kv_len}, S={problem.seq_len}; pass noncompressed_lse or implementation='xla'")
    if problem.default_ids:
        return None
    ids = [validation._concrete(x) for x in (problem.segment_ids, problem.positions, problem.kv_segment_ids,
                                              problem.kv_positions)]
    if any(x is None for x in ids):
        return None
    seg, pos, kv_seg, kv_pos = ids
    same_keys = np.array_equal(seg, kv_seg) and np.array_equal(pos, kv_pos)
    if not same_keys or not bool(masks.window_layout_ok(seg, pos, xp=np)):
        return ("the window-LSE kernel needs every document to be one contiguous run of the sequence with strictly "
                "increasing positions (and the key ids equal to the query ids); these ids are not; pass "
                "noncompressed_lse or implementation='xla'")
    return None


def noncompressed_lse(problem: Problem, cfg: Optional[window_kernel.WindowConfig] = None,
                      key_offset: int = 0, key_valid: Optional[jax.Array] = None) -> jax.Array:
    """u, f32 [B, S, H], from the window-LSE kernel plus the sinks (XLA).

    key_offset: 0 when the key sequence is the query sequence; W - 1 when window_kv (and the kv ids) carry a halo
    of the W - 1 keys before the first query (a context-parallel shard, `csa_pallas.sharding`).
    key_valid: optional bool [B, S_kv], False for key rows that do not exist (the halo of the first shard).
    """
    reason = window_supported_reason(problem) if key_offset == 0 else None
    if reason is not None:
        raise NotImplementedError(f"implementation='pallas': {reason}")
    dtype = compute_dtype(problem.q, problem.window_kv)
    b, s, h, _ = problem.q.shape
    if cfg is None:
        cfg = window_kernel.default_config(num_heads=h, head_dim=problem.head_dim, seq_len=s, dtype=dtype,
                                           head_chunk=problem.head_chunk)
    s_p = window_kernel.padded_len(s, cfg)
    kv_p = common.round_up(max(problem.kv_len, s_p + key_offset), cfg.block_k)
    # Teacher side: stop_gradient before the kernels, so differentiating wrt these inputs gives exact zeros.
    q = pad_axis(jax.lax.stop_gradient(problem.q).astype(dtype), 1, s_p)
    kv = pad_axis(jax.lax.stop_gradient(problem.window_kv).astype(dtype), 1, kv_p)  # NaN-filled per tile in-kernel
    if problem.default_ids and key_offset == 0 and key_valid is None:
        qmeta = wmeta = None  # the kernel masks from iota positions
        seq_len = s
    else:
        qmeta = common.query_meta(problem.segment_ids, problem.positions, s_p)
        wmeta = common.key_meta(problem.kv_segment_ids, problem.kv_positions, kv_p, 0)
        if key_valid is None:
            key_valid = jnp.ones((b, problem.kv_len), bool)
        wmeta = wmeta.at[:, 2, :].set(pad_axis(key_valid.astype(jnp.int32), 1, kv_p))
        seq_len = None
    sinks = None if problem.sinks is None else jax.lax.stop_gradient(problem.sinks).astype(jnp.float32)
    lse = window_kernel.window_lse_pallas(q, kv, qmeta, wmeta, sinks, cfg=cfg, window_size=problem.window_size,
                                          scale=problem.softmax_scale, key_offset=key_offset, seq_len=seq_len,
                                          interpret=runtime.interpret_mode())
    return lse[:, :s]


@dataclasses.dataclass(frozen=True)
class TeacherInputs:
    """The dense teacher kernel's padded operands (teacher side: stop-gradient)."""

    mode: str
    q: jax.Array  # [B, S_p, H, D]
    kv: jax.Array  # [B, N_p, D], rows holding a non-finite value NaN-filled
    lse_in: Optional[tuple]  # ((u or F) - sigma, sigma) in the row layout's HBM form; None for per_head


def teacher_lse(problem: Problem) -> Optional[jax.Array]:
    """u (joint: given, or from the window kernel) or F (full_lse), f32 [B, S, H]; None for per_head."""
    mode = teacher_mode(problem)
    if mode == "per_head":
        return None
    if mode == "full_lse":
        return problem.full_lse
    if problem.noncompressed_lse is not None:
        return problem.noncompressed_lse
    return noncompressed_lse(problem)


def lse_blocks(stats, problem: Problem, cfg, padded_seq: int, dtype, reduce_low=None, to_hbm=None):
    """The teacher's lse inputs: ((u or F) - sigma in the row layout's HBM form, sigma as row statistics
    [B, nq, 8, bq]), rows padded to padded_seq; None for per_head. sigma is the row's smallest u (or F) over all
    heads (`reference.row_shift`): it keeps every head weight an O(spread) number (`kernels.rebase`).
    reduce_low: combines the per-row minimum over the heads of this call with other shards of the heads (e.g. a
    `lax.pmin` over the head axis): sigma must be one number per row for all heads. to_hbm: the kernel's layout of
    the [B, S_p, H] shifted values (default: the teacher's row layout for cfg)."""
    if stats is None:
        return None
    if to_hbm is None:
        to_hbm = teacher_config.resolve_row_layout(cfg, problem.num_heads, dtype).stats_to_hbm
    stats = jax.lax.stop_gradient(stats).astype(jnp.float32)
    low = row_low(stats)
    if reduce_low is not None:
        low = reduce_low(low)
    sigma = row_shift_from_low(low)
    shifted = to_hbm(pad_axis(stats - sigma[..., None], 1, padded_seq))
    return shifted, row_stats_to_hbm(sigma, padded_seq, cfg.block_q)


def teacher_inputs(problem: Problem, layout: DenseLayout, reduce_low=None) -> TeacherInputs:
    """reduce_low: see `lse_blocks` (shards of the heads)."""
    cfg = layout.cfg
    dtype = compute_dtype(problem.q, problem.compressed_kv)
    q = pad_axis(jax.lax.stop_gradient(problem.q).astype(dtype), 1, layout.padded_seq)
    kv = pad_axis(kernel_keys(problem), 1, layout.padded_blocks)
    lse_in = lse_blocks(teacher_lse(problem), problem, cfg, layout.padded_seq, dtype, reduce_low)
    return TeacherInputs(teacher_mode(problem), q, kv, lse_in)


def teacher_padded(problem: Problem, layout: DenseLayout, normalize: bool = True, reduce_low=None):
    """P, f32 [B, S_p, N_p] (padding rows/columns are zero). normalize=False: (head sum f32 [B, S_p, N_p], the rows'
    max head weight M f32 [B, S_p], base 2) for shards of the heads to combine (`sharding`); reduce_low: see
    `lse_blocks`."""
    inputs = teacher_inputs(problem, layout, reduce_low)
    out = teacher_kernel.teacher_pallas(inputs.q, inputs.kv, layout.qmeta, layout.kmeta, layout.firsts,
                                        layout.counts, inputs.lse_in, mode=inputs.mode, cfg=layout.cfg,
                                        scale=problem.softmax_scale, schedule=layout.schedule, normalize=normalize,
                                        seq_len=problem.seq_len, interpret=runtime.interpret_mode())
    return detached_teacher_out(out, normalize, problem.batch)


def detached_teacher_out(out, normalize: bool, batch: int):
    """A teacher launch's outputs, detached: P, or (the head sum, the rows' M [B, S_p]) when not normalised."""
    if normalize:
        return jax.lax.stop_gradient(out)
    head_sum, rowmax = out
    return jax.lax.stop_gradient(head_sum), jax.lax.stop_gradient(rowmax[:, :, 0, :].reshape(batch, -1))


def teacher_distribution(problem: Problem, cfg=None) -> jax.Array:
    """P, f32 [B, S, N]."""
    b, s, n = problem.batch, problem.seq_len, problem.num_blocks
    if n == 0:
        return jnp.zeros((b, s, 0), jnp.float32)
    layout = dense_layout(problem, cfg)
    return teacher_padded(problem, layout)[:, :s, :n]


def kl_rows(indexer_logits, target_padded, layout: DenseLayout):
    """Dense mode: `padded_kl_rows` with the teacher's metadata and kv-tile schedule."""
    return padded_kl_rows(indexer_logits, target_padded, qmeta=layout.qmeta, kmeta=layout.kmeta,
                          firsts=layout.firsts, counts=layout.counts, schedule=layout.schedule)


def _run_dense(static: FusedStatic, kl, logits, operands):
    q, kv, lse_in, qmeta, kmeta, firsts, counts = operands
    return teacher_kernel.teacher_pallas(q, kv, qmeta, kmeta, firsts, counts, lse_in, mode=static.mode,
                                         cfg=static.cfg, scale=static.scale, schedule=static.schedule, kl=kl,
                                         logits=logits, interpret=static.interpret)


def _dense_fused(inputs: TeacherInputs, layout: DenseLayout, problem: Problem, kl_chunk: int):
    static = FusedStatic(_run_dense, inputs.mode, layout.cfg, layout.schedule, problem.softmax_scale,
                         problem.seq_len, runtime.interpret_mode(), layout.cfg.kl_chunk or kl_chunk)
    operands = (inputs.q, inputs.kv, inputs.lse_in, layout.qmeta, layout.kmeta, layout.firsts, layout.counts)
    return static, operands, dict(padded_seq=layout.padded_seq, padded_width=layout.padded_blocks)


def fused_kl_rows(indexer_logits, inputs: TeacherInputs, layout: DenseLayout, problem: Problem,
                  kl_chunk: int = fused_kl.FusedKL.chunk, with_gradient: bool = False, grad_scale: float = 1.0):
    """Dense mode: per-row KL [B, S] and non-empty mask [B, S] from the teacher kernel with the fused KL (P stays
    in VMEM). kl_chunk: lanes per epilogue step (see `fused_kl.FusedKL`); with_gradient, grad_scale: see
    `fused_rows`."""
    static, operands, padded = _dense_fused(inputs, layout, problem, kl_chunk)
    return fused_rows(indexer_logits, static, operands, **padded, with_gradient=with_gradient, grad_scale=grad_scale)


def fused_kl_loss(indexer_logits, inputs: TeacherInputs, layout: DenseLayout, problem: Problem, row_weight: float,
                  kl_chunk: int = fused_kl.FusedKL.chunk):
    """Dense mode: row_weight * sum_t KL_t (see `fused_weighted_loss`)."""
    static, operands, padded = _dense_fused(inputs, layout, problem, kl_chunk)
    return fused_weighted_loss(indexer_logits, static, operands, row_weight=row_weight, **padded)


def indexer_distill_loss(indexer_logits, problem: Problem, *, reduction: str = "mean", scale=1.0, cfg=None):
    """Dense-mode loss through the fused teacher + KL kernel; same contract as `reference.indexer_distill_loss`."""
    return loss_through_kernels(
        indexer_logits, problem,
        make_layout=lambda pr: dense_layout(pr, cfg, kl_logits_dtype=logits_dtype(indexer_logits)),
        make_target=teacher_inputs,
        make_kl_rows=lambda logits, inputs, layout: fused_kl_rows(logits, inputs, layout, problem),
        reduction=reduction, scale=scale,
        make_weighted_loss=lambda logits, inputs, layout, w: fused_kl_loss(logits, inputs, layout, problem, w),
        static_nonempty_rows=lambda layout: static_nonempty_rows(problem))


def default_ids_nonempty_rows(problem: Problem) -> int:
    """Default ids (one document, positions 0..S-1, S_kv == S): row t sees a block once t >= m - 1."""
    return problem.batch * max(problem.seq_len - problem.compress_ratio + 1, 0)


def static_nonempty_rows(problem: Problem) -> Optional[int]:
    """The number of non-empty rows when it is known before the kernel runs (dense mode's causal schedule: default
    ids, no loss_mask), else None. A row whose every head has a_h = -inf is empty too (SPEC §3): with window keys
    that needs every sink at +inf, which empties every row at once (the loss is then 0 however it is divided), but
    a given u or F can do it to single rows."""
    if not causal_schedule(problem) or problem.noncompressed_lse is not None or problem.full_lse is not None:
        return None
    return default_ids_nonempty_rows(problem)
