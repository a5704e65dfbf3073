"""One plan interface per mode: what `sharding.py` (and any caller above the kernels) asks of dense or sparse mode,
without knowing which it is.

A plan answers, for a validated `Problem`:
  layout(problem, kl_logits_dtype=None)           the padded shapes, tiles and metadata of the mode's kernels
  teacher(problem, layout, normalize, reduce_low) P padded [B, S_p, W_p]; normalize=False: (head sum, row max M)
  fused_kl_rows(logits, problem, layout, with_gradient=False, grad_scale=1.0)
                                                  per-row KL [B, S] and non-empty rows [B, S], P kept in VMEM
                                                  (with_gradient: also d (grad_scale sum_t KL_t) / d logits,
                                                  f32 [B, S, W])
  kl_rows(logits, target, layout)                 the same from a materialised, padded P
  normalize(head_sum)                             a head sum reduced over shards -> P (`finish_head_sum` pads it)
  valid_entries(head_sum)                         where a head sum holds a real entry (sparse: empty slots < 0)
W_p is N_p (dense) or K_p (sparse: slot order).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from csa_pallas import ops, ops_sparse
from csa_pallas.kernels import selection
from csa_pallas.kernels import teacher as teacher_kernel
from csa_pallas.validation import Problem


@dataclasses.dataclass(frozen=True)
class Plan:
    """The operations of one mode (see the module docstring); `DENSE` and `SPARSE` are the two instances."""

    name: str
    layout: Callable  # (problem, kl_logits_dtype=None) -> layout
    teacher: Callable  # (problem, layout, normalize=True, reduce_low=None) -> P padded, or (head sum, M)
    # (logits, problem, layout, with_gradient=False, grad_scale=1.0) -> (rows, nonempty[, gradient])
    fused_kl_rows: Callable
    kl_rows: Callable  # (logits, target padded, layout) -> (rows, nonempty)
    normalize: Callable  # head sum over all heads -> P
    padded_width: Callable  # layout -> W_p
    valid_entries: Callable  # head sum -> bool mask (or True)
    empty_value: float  # P's value outside V(t) in the padded target


DENSE = Plan(
    name="dense",
    layout=lambda problem, kl_logits_dtype=None: ops.dense_layout(problem, kl_logits_dtype=kl_logits_dtype),
    teacher=ops.teacher_padded,
    fused_kl_rows=lambda logits, problem, layout, with_gradient=False, grad_scale=1.0: ops.fused_kl_rows(
        logits, ops.teacher_inputs(problem, layout), layout, problem, with_gradient=with_gradient,
        grad_scale=grad_scale),
    kl_rows=ops.kl_rows,
    normalize=teacher_kernel.normalize_rows,
    padded_width=lambda layout: layout.padded_blocks,
    valid_entries=lambda head_sum: True,
    empty_value=0.0,
)

SPARSE = Plan(
    name="sparse",
    layout=lambda problem, kl_logits_dtype=None: ops_sparse.sparse_layout(problem, kl_logits_dtype=kl_logits_dtype),
    teacher=ops_sparse.teacher_padded,
    fused_kl_rows=ops_sparse.fused_kl_rows,
    kl_rows=ops_sparse.kl_rows,
    normalize=ops_sparse.normalize_slots,  # empty slots (negative sums) become EMPTY_SLOT
    padded_width=lambda layout: layout.padded_width,
    valid_entries=lambda head_sum: jnp.logical_not(head_sum < 0.0),  # empty slots carry negative values; NaN stays
    empty_value=selection.EMPTY_SLOT,
)


def plan_for(problem: Problem) -> Plan:
    """The plan of the problem's mode."""
    return SPARSE if problem.sparse else DENSE


def finish_head_sum(plan: Plan, head_sum: jax.Array, layout) -> jax.Array:
    """A head sum over all heads (rows [B, S], unpadded) -> the normalised P padded to `layout`, empty entries
    `plan.empty_value`: f32 [B, S_p, W_p]."""
    target = plan.normalize(head_sum)
    fill = plan.empty_value
    target = ops.pad_axis(target, 1, layout.padded_seq, fill)
    return ops.pad_axis(target, 2, plan.padded_width(layout), fill)


def positive_part(target: jax.Array) -> jax.Array:
    """P with the empty-slot marker (sparse: -1) read as 0, for callers that return P."""
    return jnp.maximum(target, 0.0)
