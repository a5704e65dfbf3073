"""The fused student (SPEC §8) under SPMD: `sharded_fused_indexer_distill_loss`, sharded like
`sharding.sharded_indexer_distill_loss` (batch, attention heads, query sequence); the indexer heads stay whole on
every device (index_q [B, S, H_I, d_I] is sharded like the queries' rows, index_k [B, N, d_I] like the keys).

Inside `jax.shard_map`, per device:
  * no head axis: the shard's queries against every key through `fused_student` (query chunks, the student kernels
    (sparse mode: the visit student or the gather kernels, `student_plan.visit_rule`), the gradient in the
    forward pass for scalar reductions), so no [B, S, N] array exists on any device beyond a chunk's;
  * head axis: the teacher's head sums are reduce-scattered as in `sharding._local_target` (each head shard owns
    1/n_heads of the shard's rows, normalised there); the device scores its owned rows with the student (its
    kernels, or XLA where they do not fit) and takes their KL from that P, as the plain sharded loss does with
    given logits (sparse mode: the gather kernels, whatever `visit_rule` says: that P is in slot order); sparse
    mode with a scalar reduction instead runs one gather kernel per query tile for the
    scores, the KL against that P and the gradients, taken in the forward pass (`student_gather_kl`,
    `StudentGatherConfig.fuse_kl`).
Each device returns its sum_t KL_t (or its rows, for reduction="none") and its non-empty rows; the reduction is
global, in XLA (the plain op's mean over the non-empty rows of the whole batch). index_k enters replicated over
the sequence and head axes, index_q / index_weights over the head axis: shard_map's transpose sums their
cotangents over those axes.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from csa_pallas import api, fused_student, placement, plans, reference, sharding, student as student_lib
from csa_pallas import loss_vjp, student_plan
from csa_pallas import teacher_args, validation
from csa_pallas.kernels import student_gather, student_gather_kl, student_scores


def _owned_rows_scores(st: student_lib.Student, rows_problem, start, student):
    """The student's scores of the rows a head shard owns (rows_problem: their ids): f32 [B, rows, W]."""
    rows = rows_problem.seq_len
    take = lambda x: lax.dynamic_slice_in_dim(x, start, rows, axis=1)
    owned = student_lib.Student(take(st.index_q), st.index_k, take(st.index_weights), st.head_chunk, st.key_dtype)
    operand = student_scores.operand_dtype(st.index_q.dtype, st.key_values_dtype)
    if rows_problem.sparse:
        cfg = student_plan.slot_order_config(student, rows_problem, st.index_q.shape)
    else:
        cfg = student_plan.kernel_config(student, rows_problem, st.index_q.shape)
    if cfg is None:
        return student_lib.scores(owned, rows_problem)
    if rows_problem.sparse:
        return student_gather.scores(owned.index_q, student_gather.resident_keys(owned.index_k),
                                     owned.index_weights, rows_problem.topk_indices, operand, cfg)
    _, block_end = reference.block_keys(rows_problem)
    return student_scores.scores(owned.index_q, student_scores.prepare_keys(owned.index_k, cfg, operand),
                                 owned.index_weights, rows_problem.positions, block_end, cfg)


def _owned_gather_config(st: student_lib.Student, rows_problem, student):
    """The gather kernels' config when the owned rows' gradient pass takes the one-kernel route, else None."""
    if not rows_problem.sparse:
        return None
    cfg = student_plan.slot_order_config(student, rows_problem, st.index_q.shape)
    return cfg if cfg is not None and cfg.fuse_kl else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _owned_kl_total(cfg, operand, layout, index_q, keys, index_weights, topk_indices, target):
    """(sum_t KL_t f32 scalar, non-empty rows bool [B, rows]) of the owned rows against their target P (padded,
    -1 on empty slots, `layout`); differentiable wrt index_q [B, rows, H_I, d_I], the resident keys and
    index_weights, the gradient taken in the forward pass (`student_gather_kl.loss_and_grads`). Undifferentiated,
    only the scores kernel and the stand-alone KL run (no gradient work)."""
    logits = student_gather.scores(index_q, keys, index_weights, topk_indices, operand, cfg)
    kl, nonempty = plans.SPARSE.kl_rows(logits, target, layout)
    return jnp.sum(kl), nonempty


def _owned_kl_total_fwd(cfg, operand, layout, index_q, keys, index_weights, topk_indices, target):
    kl, nonempty, grads = student_gather_kl.loss_and_grads(index_q, keys, index_weights, topk_indices, target,
                                                           operand, cfg)
    outputs, grads = loss_vjp.named_residuals(((jnp.sum(kl), nonempty), grads))
    return outputs, (grads, jnp.zeros((), index_weights.dtype))  # (index_weights' dtype travels as a scalar)


def _owned_kl_total_bwd(cfg, operand, layout, residuals, cotangents):
    (dq, dk, dw), w_like = residuals
    ct = cotangents[0]
    return ((ct * dq.astype(jnp.float32)).astype(dq.dtype), ct * dk, (ct * dw).astype(w_like.dtype), None, None)


_owned_kl_total.defvjp(_owned_kl_total_fwd, _owned_kl_total_bwd)


def _owned_rows_kl_total(st: student_lib.Student, rows_problem, start, cfg, target, layout):
    """`_owned_kl_total` of the rows a head shard owns, from the device's whole student."""
    rows = rows_problem.seq_len
    take = lambda x: lax.dynamic_slice_in_dim(x, start, rows, axis=1)
    operand = student_scores.operand_dtype(st.index_q.dtype, st.key_values_dtype)
    return _owned_kl_total(cfg, operand, layout, take(st.index_q), student_gather.resident_keys(st.index_k),
                           take(st.index_weights), rows_problem.topk_indices, target)


@teacher_args.takes_teacher_args
def sharded_fused_indexer_distill_loss(
    mesh: Mesh,
    index_q: jax.Array,
    index_k: jax.Array,
    index_weights: jax.Array,
    q: jax.Array,
    compressed_kv: jax.Array,
    *,
    teacher: dict,
    batch_axes: sharding.AxisNames = None,
    head_axis: Optional[str] = None,
    seq_axis: Optional[str] = None,
    reduction: str = "mean",
    scale=1.0,
    index_head_chunk: Optional[int] = None,
    query_chunk: Optional[int] = None,
    student="auto",
    config=None,
) -> jax.Array:
    """`csa_pallas.fused_indexer_distill_loss` with batch, attention heads and query sequence sharded over `mesh`.

    Args: the global arrays and arguments of `fused_indexer_distill_loss` plus `mesh`, `batch_axes`, `head_axis`
    and `seq_axis` as in `sharded_indexer_distill_loss`. query_chunk: query rows per step on each device (a divisor
    of the per-device S; no head axis only). config: the teacher kernels' variant on every device, as in
    `sharded_indexer_distill_loss`. Returns the value of the unsharded op (f32 scalar, or [B, S] for
    reduction="none"), differentiable wrt index_q, index_k and index_weights (exact zeros for the teacher side).
    """
    mesh, problem, axes = sharding._validate_sharded(mesh, batch_axes, head_axis, seq_axis, q, compressed_kv,
                                                     teacher, config)
    st = student_lib.validate_student(index_q, index_k, index_weights, batch=problem.batch, seq_len=problem.seq_len,
                                      num_blocks=problem.num_blocks, index_head_chunk=index_head_chunk)
    validation.check_reduction_args(reduction, scale)
    student_plan.resolve_student(student, problem, st.index_q.shape)
    if head_axis is not None and problem.sparse:  # the owned rows' target is in slot order
        student_plan.slot_order_config(student, problem, st.index_q.shape)
    if query_chunk is not None and head_axis is not None:
        raise ValueError("query_chunk: with head_axis each device scores only the rows it owns (no query chunks); "
                         "drop query_chunk")
    if not sharding._uses_pallas(problem) or api.trivial_result(problem, reduction, scale) is not None:
        return api.fused_indexer_distill_loss(index_q, index_k, index_weights, q, compressed_kv, **teacher,
                                              reduction=reduction, scale=scale, index_head_chunk=index_head_chunk,
                                              query_chunk=query_chunk, student=student, config=config)
    if index_head_chunk is None:
        st = student_lib.Student(st.index_q, st.index_k, st.index_weights,
                                 student_plan.default_index_head_chunk(st.num_heads, problem.sparse))
    # index_k enters every device in f32 (exact): its cotangent is summed over the devices it is replicated on in
    # f32 and rounded to index_k's dtype once, after the sum (SPEC §6: all accumulation in f32).
    st = student_lib.with_f32_keys(st)
    num_seq_shards, num_head_shards = sharding._axis_size(mesh, seq_axis), sharding._axis_size(mesh, head_axis)
    arrays, specs = sharding._shard_inputs(problem, axes)
    arrays.update(index_q=st.index_q, index_k=st.index_k, index_weights=st.index_weights)
    specs.update(index_q=P(axes.batch_entry, axes.seq, None, None), index_k=P(axes.batch_entry, None, None),
                 index_weights=P(axes.batch_entry, axes.seq, None))
    arrays = placement.reshard_for_shard_map(arrays, specs, mesh)
    per_row = reduction == "none"

    def per_shard(local):
        local_st = student_lib.Student(local["index_q"], local["index_k"], local["index_weights"], st.head_chunk,
                                       st.key_dtype)
        if axes.heads is None:
            shard = sharding._local_problem(local, problem, axes, num_seq_shards)
            if per_row:
                return fused_student.kl_rows(local_st, shard, query_chunk=query_chunk, student=student)
            total, nonempty = fused_student.kl_total(local_st, shard, query_chunk=query_chunk, student=student)
            return total.reshape(1, 1), nonempty
        target, layout, plan, rows_problem = sharding._local_target(local, problem, axes, num_seq_shards,
                                                                    num_head_shards)
        start = lax.axis_index(axes.heads) * rows_problem.seq_len
        one_kernel = None if per_row else _owned_gather_config(local_st, rows_problem, student)
        if one_kernel is not None:
            total, nonempty = _owned_rows_kl_total(local_st, rows_problem, start, one_kernel, target, layout)
            return total.reshape(1, 1), nonempty
        logits = _owned_rows_scores(local_st, rows_problem, start, student)
        kl, nonempty = plan.kl_rows(logits, target, layout)
        return (kl, nonempty) if per_row else (jnp.sum(kl).reshape(1, 1), nonempty)

    spec = axes.loss_rows_spec()
    out, nonempty = placement.shard_map(per_shard, mesh, in_specs=(specs,), out_specs=(spec, spec))(arrays)
    if per_row:
        return reference.reduce_rows(out, nonempty, reduction, scale)
    return reference.reduce_total(jnp.sum(out), nonempty, reduction, scale)
