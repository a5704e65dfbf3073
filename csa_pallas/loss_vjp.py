"""The loss's differentiable machinery, shared by dense and sparse mode (`ops`, `ops_sparse`, `sharding`).

  * `fused_rows` / `fused_weighted_loss`: a teacher kernel with the KL fused into its last step (`FusedStatic.run`
    launches the dense or sparse kernel) behind a custom_vjp whose only residual is G (see `ops`' docstring).
  * `padded_kl_rows`: the stand-alone KL kernels on a materialised target P (teacher_distribution's P, the
    heads-sharded loss) behind a custom_vjp whose backward is the KL backward kernel.
  * `loss_through_kernels`: layout -> teacher -> KL -> reduction, the driver each mode fills with its own plan.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from csa_pallas import reference
from csa_pallas.kernels import fused_kl
from csa_pallas.kernels import kl_of_target as kl_kernels
from csa_pallas.kernels import runtime
from csa_pallas.kernels import schedule as schedule_lib
from csa_pallas.kernels import teacher_config
from csa_pallas.validation import Problem


# The checkpoint name of what the kernels' forward passes give the backward: the residuals (G, the KL's gradient
# with respect to the logits; the heads-sharded loss's P; the fused op's three indexer gradients) and the kernels'
# own outputs (the rows' statistics, which a data-dependent reduction's backward reads). Under `jax.checkpoint` /
# `nn.remat` a policy naming it (`save_only_these_names`, or `save_and_offload_only_these_names` to host memory)
# keeps them, and the backward launches no teacher kernel; any other policy recomputes the loss in the backward.
RESIDUAL_NAME = "csa_indexer_loss_residuals"


def named_residuals(tree):
    """`tree` with every array marked `checkpoint_name(x, RESIDUAL_NAME)` (identity outside a remat)."""
    return jax.tree.map(lambda x: checkpoint_name(x, RESIDUAL_NAME), tree)


def logits_dtype(indexer_logits):
    """The dtype the kernels read the student logits in (and write G in): f16 goes in as f32."""
    return jnp.dtype(jnp.float32) if indexer_logits.dtype == jnp.float16 else jnp.dtype(indexer_logits.dtype)


def pad_axis(x, axis: int, size: int, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)



@dataclasses.dataclass(frozen=True)
class _KLStatic:
    schedule: schedule_lib.TileSchedule
    interpret: object
    target_mask: bool = False  # sparse mode: validity read from P (-1 on empty slots) instead of qmeta/kmeta


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kl_stats(static: _KLStatic, logits, target, qmeta, kmeta, firsts, counts):
    return kl_kernels.kl_forward_pallas(target, logits, qmeta, kmeta, firsts, counts, schedule=static.schedule,
                                        interpret=static.interpret, target_mask=static.target_mask)


def _kl_stats_fwd(static, logits, target, qmeta, kmeta, firsts, counts):
    stats = _kl_stats(static, logits, target, qmeta, kmeta, firsts, counts)
    return named_residuals((stats, (logits, target, qmeta, kmeta, firsts, counts, stats)))


def _kl_stats_bwd(static, residuals, cotangent):
    logits, target, qmeta, kmeta, firsts, counts, stats = residuals
    # Only row 0 (the KL) is differentiable; rows 1-3 (lse, sum P, non-empty) are statistics for the backward.
    coef = cotangent[:, :, 0, :]
    rowstats = jnp.zeros_like(stats).at[:, :, 0].set(stats[:, :, 1]).at[:, :, 1].set(coef).at[:, :, 2].set(
        stats[:, :, 2])
    grad = kl_kernels.kl_backward_pallas(target, logits, qmeta, kmeta, firsts, counts, rowstats,
                                         schedule=static.schedule, interpret=static.interpret,
                                         target_mask=static.target_mask)
    return grad, None, None, None, None, None


_kl_stats.defvjp(_kl_stats_fwd, _kl_stats_bwd)


def padded_kl_rows(indexer_logits, target_padded, *, qmeta, kmeta, firsts, counts, schedule: schedule_lib.TileSchedule,
                   target_mask: bool = False):
    """Per-row KL [B, S] (differentiable wrt indexer_logits) and the non-empty row mask [B, S], from the KL kernels
    on the padded target [B, S_p, W_p] (shared by dense and sparse mode)."""
    b, s, _ = indexer_logits.shape
    logits = pad_axis(pad_axis(indexer_logits, 1, target_padded.shape[1]), 2, target_padded.shape[2])
    static = _KLStatic(schedule, runtime.interpret_mode(), target_mask)
    stats = _kl_stats(static, logits, target_padded, qmeta, kmeta, firsts, counts)
    rows = stats[:, :, 0, :].reshape(b, -1)[:, :s]
    nonempty = jax.lax.stop_gradient(stats[:, :, 3, :].reshape(b, -1)[:, :s]) > 0
    return rows, nonempty


@dataclasses.dataclass(frozen=True)
class FusedStatic:
    """Static arguments of the fused teacher + KL custom_vjp. run(static, kl, logits, operands) launches the
    teacher kernel (dense or sparse) with `kl` (a `fused_kl.FusedKL`) and returns its outputs."""

    run: Callable
    mode: str
    cfg: teacher_config.TeacherConfig
    schedule: schedule_lib.TileSchedule
    scale: float
    seq_len: int
    interpret: object
    kl_chunk: int = fused_kl.FusedKL.chunk
    grad_scale: float = 1.0  # `fused_kl.FusedKL.grad_scale`

    def launch(self, emit_gradient: bool, logits, operands):
        return _launch(self, emit_gradient, logits, operands)


SECOND_ORDER_MESSAGE = (
    "csa_pallas: second-order derivatives of the loss (grad of grad, jax.hessian) are not supported by the Pallas "
    "kernels (their forward kernel has no derivative of its own); implementation='xla' (the pure-JAX reference) "
    "supports them")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _launch(static: "FusedStatic", emit_gradient: bool, logits, operands):
    kl = fused_kl.FusedKL(emit_gradient=emit_gradient, seq_len=static.seq_len, chunk=static.kl_chunk,
                          grad_scale=static.grad_scale)
    return static.run(static, kl, logits, operands)


@_launch.defjvp
def _launch_jvp(static, emit_gradient, primals, tangents):
    # First-order gradients never differentiate the kernel (the custom_vjp backward reads G); getting here means
    # a derivative of that backward was asked for.
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_kl_stats(static: FusedStatic, logits, operands):
    """KL statistics f32 [B, nq, 8, bq] of a fused teacher + KL kernel (differentiable wrt logits only; the
    teacher operands are constants)."""
    (stats,) = static.launch(False, logits, operands)
    return stats


def _fused_kl_stats_fwd(static, logits, operands):
    stats, grad = static.launch(True, logits, operands)
    return named_residuals((stats, grad))


def _fused_kl_stats_bwd(static, grad, cotangent):
    b, s_p, _ = grad.shape
    # Only row 0 (the KL) is differentiable; rows 1-3 (lse, sum P, non-empty) are statistics.
    coef = cotangent[:, :, 0, :].reshape(b, s_p, 1)
    return (coef * grad.astype(jnp.float32)).astype(grad.dtype), None


_fused_kl_stats.defvjp(_fused_kl_stats_fwd, _fused_kl_stats_bwd)


def _weighted_total(static: FusedStatic, stats):
    return static.grad_scale * jnp.sum(stats[:, :, 0, :])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_weighted_loss(static: FusedStatic, logits, operands):
    """static.grad_scale * the sum of the rows' KL (scalar f32): a loss whose every row has the same static weight.
    Its backward is cotangent * G with G saved pre-scaled, so a constant-1 cotangent leaves no work at all."""
    (stats,) = static.launch(False, logits, operands)
    return _weighted_total(static, stats)


def _fused_weighted_loss_fwd(static, logits, operands):
    stats, grad = static.launch(True, logits, operands)
    return named_residuals((_weighted_total(static, stats), grad))


def _fused_weighted_loss_bwd(static, grad, cotangent):
    return cotangent.astype(grad.dtype) * grad, None


_fused_weighted_loss.defvjp(_fused_weighted_loss_fwd, _fused_weighted_loss_bwd)


def fused_rows(indexer_logits, static: FusedStatic, operands, *, padded_seq: int, padded_width: int,
               with_gradient: bool = False, grad_scale: float = 1.0):
    """Per-row KL [B, S] (differentiable wrt indexer_logits) and the non-empty row mask [B, S] from a fused
    teacher + KL kernel (shared by dense and sparse mode). with_gradient: also the gradient of
    grad_scale * sum_t KL_t wrt the logits, f32 [B, S, W] (the kernel's G written times grad_scale, emitted by the
    same launch; not differentiable), for callers that take the gradient in the forward pass (`fused_student`)."""
    b, s, w = indexer_logits.shape
    logits = pad_axis(pad_axis(indexer_logits.astype(logits_dtype(indexer_logits)), 1, padded_seq), 2,
                      padded_width)
    if with_gradient:
        stats, grad = dataclasses.replace(static, grad_scale=grad_scale).launch(True, logits, operands)
    else:
        stats = _fused_kl_stats(static, logits, operands)
    rows = stats[:, :, 0, :].reshape(b, -1)[:, :s]
    nonempty = jax.lax.stop_gradient(stats[:, :, 3, :].reshape(b, -1)[:, :s]) > 0
    if with_gradient:
        return rows, nonempty, grad[:, :s, :w].astype(jnp.float32)
    return rows, nonempty


def fused_weighted_loss(indexer_logits, static: FusedStatic, operands, *, padded_seq: int, padded_width: int,
                        row_weight: float):
    """row_weight * sum_t KL_t (scalar f32, differentiable wrt indexer_logits) from a fused teacher + KL kernel,
    for reductions that weigh every row by the same static number (padding rows have KL 0)."""
    logits = pad_axis(pad_axis(indexer_logits.astype(logits_dtype(indexer_logits)), 1, padded_seq), 2,
                      padded_width)
    return _fused_weighted_loss(dataclasses.replace(static, grad_scale=row_weight), logits, operands)


def uniform_row_weight(reduction: str, scale, batch: int, seq_len: int, nonempty_rows: Optional[int]):
    """(w, traced scale or None) when the reduction weighs every row by one static number w (times the traced
    scale): "sum", "mean_all", and "mean" when the number of non-empty rows is static; else None."""
    if reduction == "sum":
        weight = 1.0
    elif reduction == "mean_all":
        weight = 1.0 / max(batch * seq_len, 1)
    elif reduction == "mean" and nonempty_rows is not None:
        weight = 1.0 / max(nonempty_rows, 1)
    else:
        return None
    if isinstance(scale, (int, float, np.number)) or (isinstance(scale, np.ndarray) and scale.ndim == 0):
        return weight * float(scale), None
    return weight, scale


def uniformly_weighted_loss(reduction: str, scale, batch: int, seq_len: int, nonempty_rows: Optional[int],
                            weighted_sum):
    """weighted_sum(w) (w * the rows' KL sum, w folded into the kernels' G) times the traced scale when every row
    has one static weight w (`uniform_row_weight`); None otherwise (the caller reduces per-row KL instead)."""
    uniform = uniform_row_weight(reduction, scale, batch, seq_len, nonempty_rows)
    if uniform is None:
        return None
    weight, traced_scale = uniform
    loss = weighted_sum(weight)
    return loss if traced_scale is None else loss * traced_scale


def loss_through_kernels(indexer_logits, problem: Problem, *, make_layout, make_target, make_kl_rows,
                         reduction: str, scale, make_weighted_loss=None, static_nonempty_rows=None):
    """The loss driver of both modes: layout -> teacher -> KL -> reduction (XLA).

    make_layout(problem), make_target(problem, layout) (P, or the fused kernel's inputs) and
    make_kl_rows(logits, target, layout) come from `ops` (dense) or `ops_sparse` (sparse); same contract as
    `reference.indexer_distill_loss`. make_weighted_loss(logits, target, layout, w) (w * sum of the rows' KL) is
    used instead when every row has the same static weight (`uniform_row_weight`; static_nonempty_rows(layout):
    the number of non-empty rows when it is known before the kernel runs, else None)."""
    if problem.num_blocks == 0:  # S_kv < m: no block exists, every row is empty
        rows = jnp.zeros(indexer_logits.shape[:2], jnp.float32)
        return reference.reduce_rows(rows, jnp.zeros(rows.shape, bool), reduction, scale)
    layout = make_layout(problem)
    target = make_target(problem, layout)
    if make_weighted_loss is not None:
        known = static_nonempty_rows(layout) if static_nonempty_rows is not None else None
        loss = uniformly_weighted_loss(reduction, scale, problem.batch, problem.seq_len, known,
                                       lambda w: make_weighted_loss(indexer_logits, target, layout, w))
        if loss is not None:
            return loss
    rows, nonempty = make_kl_rows(indexer_logits, target, layout)
    return reference.reduce_rows(rows, nonempty, reduction, scale)
