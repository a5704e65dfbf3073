"""The fused student's Pallas path (SPEC §8): the loss over query chunks, so no [B, S, N] array exists.

A `lax.scan` walks the queries in chunks of `query_chunk` rows (which student, and the chunk size:
`student_plan`). Each step computes the chunk's student scores (dense mode: the student kernels,
`kernels/student_scores.py`, which keep the [rows, H_I, N] ReLU terms in VMEM forward and backward; sparse mode:
the same kernels over the blocks with the KL over blocks (the visit student, `sparse_blocks`), or the gather
kernels over the slots; student="xla": `student.scores`, XLA) and its per-row KL with the teacher + fused KL
kernel (`plans.Plan.fused_kl_rows`: P stays in VMEM; the visit student: the teacher's block-order P and the KL
kernels). The KL is row-local, so a chunk's rows need only its
own queries against every key; u (the window LSE of the joint target) is computed once for all queries by the
window kernel before the scan (it needs each query's preceding keys).

Two ways to the gradient:
  * Scalar reductions ("mean", "mean_all", "sum"): the gradient in the forward pass. The loss is
    weight * sum_t KL_t with one weight for every row, so under differentiation each step takes the fused KL
    kernel's G = d KL_t / d I (emitted by the same launch) straight through the student's backward and keeps
    d sum_t KL_t / d (index_q, index_k, index_weights); the custom_vjp's backward only scales them by the
    cotangent. One teacher launch and one student forward + backward per chunk, nothing recomputed. With the
    sparse gather kernels (`StudentGatherConfig.fuse_kl`, the default) the teacher writes its slot-order P instead
    and one student kernel per query tile takes the scores, the KL and the gradients (`student_gather_kl`), so
    each slot's index_k row is gathered once, not twice.
  * reduction="none" (a cotangent per row, unknown in the forward): each step under `jax.checkpoint`; the backward
    recomputes the chunk's scores and teacher and runs the kernels' backward for the chunk alone.
What exists at any time is [B, query_chunk, N] (scores, their gradient) plus, with the XLA student, its
[B, query_chunk, index_head_chunk, N] ReLU terms, whatever S is.

With more than one chunk the chunk problems carry explicit key-side ids (the chunk's rows are not the key
sequence), so the kernels take their metadata-table schedule, as with packed documents; one chunk is the problem
itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from csa_pallas import (loss_vjp, placement, plans, reference, sparse_blocks, student as student_lib, student_plan,
                        validation)
from csa_pallas.kernels import student_gather, student_gather_kl, student_scores
from csa_pallas.validation import Problem

def _chunk_problem(problem: Problem, rows: dict) -> Problem:
    """The teacher problem of one chunk of query rows against every key (u or F given per row)."""
    stats = {name: rows[name] for name in ("noncompressed_lse", "full_lse") if name in rows}
    chunk = validation.validate(
        rows["q"], problem.compressed_kv, topk_indices=rows.get("topk_indices"), loss_mask=rows.get("loss_mask"),
        segment_ids=rows["segment_ids"], positions=rows["positions"], kv_segment_ids=problem.kv_segment_ids,
        kv_positions=problem.kv_positions, compress_ratio=problem.compress_ratio, window_size=problem.window_size,
        softmax_scale=problem.softmax_scale, target=problem.target, head_chunk=problem.head_chunk,
        implementation="pallas", **stats)
    return dataclasses.replace(chunk, kv_ready=problem.kv_ready, default_keys=problem.one_document_prefix,
                               teacher_config=problem.teacher_config)


def _poisoned(chunk: Problem, bad_block) -> Problem:
    """The chunk with q NaN on every row that has a block flagged in bad_block (bool [B, N]) in V(t): such a row's
    scores are then all NaN, as a NaN-filled key row would make them (SPEC §3: the rows that read a non-finite value
    are NaN, the others untouched). Dense mode only: V(t) is compares there, while sparse mode's would be XLA
    gathers of [B, rows, K] (~45 ms of estimate over the chunks at S = 32K, K = 512)."""
    hit = reference.reads_bad_block(chunk, reference.support(chunk), bad_block)
    return dataclasses.replace(chunk, q=jnp.where(hit[:, :, None, None], jnp.nan, chunk.q).astype(chunk.q.dtype))


# The Problem fields that hold arrays: they travel into the custom_vjp as arguments (a static template keeps the
# rest), so nothing traced is closed over.
_ARRAY_FIELDS = ("q", "compressed_kv", "segment_ids", "positions", "kv_segment_ids", "kv_positions", "topk_indices",
                 "window_kv", "sinks", "noncompressed_lse", "full_lse", "loss_mask")
_ROW_FIELDS = ("q", "segment_ids", "positions", "topk_indices", "loss_mask", "noncompressed_lse", "full_lse")


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """The static side of one chunked loss: the problem without its arrays, the chunking and the student."""

    template: Problem  # every _ARRAY_FIELDS entry None
    num_chunks: int
    chunk: int
    kernel_config: object  # StudentKernelConfig (dense), StudentGatherConfig (sparse), None: the XLA student
    index_head_chunk: int
    # Every row's static weight in the loss (`loss_vjp.uniform_row_weight`): the KL sum is returned times it and
    # the fused KL kernel writes G times it, so the gradients come out final (a constant-1 cotangent is free).
    row_weight: float = 1.0
    poison_rows: bool = False  # compressed_kv as given: the chunks make the readers of a non-finite block NaN
    key_dtype: object = jnp.float32  # index_k's values (`Student.key_values_dtype`): decides the MXU operands


def _stack_chunks(x, num_chunks: int, chunk: int):
    """[B, S, ...] -> [S / chunk, B, chunk, ...] (what the scan walks)."""
    return jnp.moveaxis(x.reshape(x.shape[0], num_chunks, chunk, *x.shape[2:]), 1, 0)


def _unstack_chunks(x):
    """[S / chunk, B, chunk, ...] -> [B, S, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _scan_rows(ctx: _Chunks, index_q, index_k, index_weights, teacher: dict, with_gradient: bool):
    """Per-row KL [B, S] and non-empty rows [B, S] (differentiable by JAX, each step rematerialised); with_gradient:
    also d sum_t KL_t / d (index_q, index_k, index_weights), computed in this pass (index_q's dtype; index_k's,
    f32, summed over the chunks in f32; index_weights' dtype). index_k: f32 (`student.with_f32_keys`)."""
    problem = dataclasses.replace(ctx.template, **teacher)
    _, block_end = reference.block_keys(problem)
    rows = {name: teacher[name] for name in _ROW_FIELDS if name in teacher}
    chunk, num_chunks = ctx.chunk, ctx.num_chunks
    kernels = ctx.kernel_config is not None
    # The student kernels' keys, padded and cast once for every chunk (`student_scores.Keys`): f32 (an exact
    # upcast) so their cotangent sums over chunks in f32; the MXU takes bf16 when both indexer inputs are bf16.
    operands = student_scores.operand_dtype(index_q.dtype, ctx.key_dtype)
    gathers = isinstance(ctx.kernel_config, student_gather.StudentGatherConfig)
    visit = problem.sparse and kernels and not gathers  # the KL over blocks (`sparse_blocks`)
    if gathers:  # sparse: index_k resident in VMEM, f32 (its cotangent sums over chunks in f32)
        keys = student_gather.resident_keys(index_k)
    else:
        prepared = None if not kernels else student_scores.prepare_keys(index_k, ctx.kernel_config, operands)
        keys = index_k if not kernels else prepared.padded  # what each chunk differentiates
    # One chunk of default ids: the student kernels' skipped tiles come from the grid, like the teacher's schedule.
    causal_ratio = problem.compress_ratio if num_chunks == 1 and problem.default_ids else None

    # The keys are not NaN-filled (`_prepare`): the blocks holding a non-finite value, once.
    bad_block = reference.non_finite_blocks(problem.compressed_kv) if ctx.poison_rows else None

    def chunk_shard(part, start):
        # One chunk: the problem itself (default ids keep the kernels' causal schedule, computed from the grid).
        if num_chunks == 1:
            return dataclasses.replace(problem, noncompressed_lse=part.get("noncompressed_lse"))
        shard = _chunk_problem(problem, part)
        if problem.sparse:  # the gather path's teacher reads the chunk's q rows in place (`Problem.q_window`)
            shard = dataclasses.replace(shard, q_window=(problem.q, start))
        return _poisoned(shard, bad_block) if ctx.poison_rows else shard

    def student_fn(part, shard, q_rows, k, w_rows):
        if not kernels:
            return student_lib.scores(student_lib.Student(q_rows, k, w_rows, ctx.index_head_chunk, ctx.key_dtype),
                                      shard)
        if gathers:
            return student_gather.scores(q_rows, k, w_rows, part["topk_indices"], operands, ctx.kernel_config)
        k = dataclasses.replace(prepared, padded=k, operand=lax.stop_gradient(prepared.operand))
        return student_scores.scores(q_rows, k, w_rows, part["positions"], block_end, ctx.kernel_config,
                                     causal_ratio=causal_ratio)

    def chunk_rows(start, q_rows, k, w_rows, dk_partials=None, rows_in_place=None):
        part = {name: lax.dynamic_slice_in_dim(v, start, chunk, axis=1) for name, v in rows.items()}
        shard = chunk_shard(part, start)
        plan = plans.plan_for(shard)
        fn = functools.partial(student_fn, part, shard)
        if visit:  # block-order scores against the block-order target; nothing in slot order
            layout = sparse_blocks.layout_of(shard)
            target, sel = sparse_blocks.block_target(shard, layout)
            kl_of = lambda logits: sparse_blocks.kl_rows(logits, target, sel, layout)
            if not with_gradient:
                return kl_of(fn(q_rows, k, w_rows))
            logits, student_vjp = jax.vjp(fn, q_rows, k, w_rows)
            kl, kl_vjp, nonempty = jax.vjp(kl_of, logits, has_aux=True)
            (grad,) = kl_vjp(jnp.full_like(kl, ctx.row_weight))
            return (kl, nonempty), student_vjp(grad)
        if not with_gradient:
            logits = fn(q_rows, k, w_rows)
            return plan.fused_kl_rows(logits, shard, plan.layout(shard, kl_logits_dtype=logits.dtype))
        if gathers and ctx.kernel_config.fuse_kl:
            # One student kernel per query tile against the teacher's P' (`student_gather_kl`): rows gathered once.
            target = plan.teacher(shard, plan.layout(shard, kl_logits_dtype=jnp.float32))
            kl, nonempty, grads = student_gather_kl.loss_and_grads(
                q_rows, k, w_rows, part["topk_indices"], target, operands, ctx.kernel_config,
                grad_scale=ctx.row_weight, dk_partials=dk_partials, rows_in_place=rows_in_place)
            return (kl, nonempty), grads
        logits, student_vjp = jax.vjp(fn, q_rows, k, w_rows)
        kl, nonempty, grad = plan.fused_kl_rows(logits, shard, plan.layout(shard, kl_logits_dtype=logits.dtype),
                                                with_gradient=True, grad_scale=ctx.row_weight)
        return (kl, nonempty), student_vjp(grad)

    starts = jnp.arange(num_chunks) * chunk
    if not with_gradient:
        _in_place_operands(ctx.kernel_config if gathers else None, index_q, chunk, False)  # forced fields: checked
        # The student's rows are scanned over so that autodiff returns their cotangents stacked, chunk by chunk
        # (a dynamic slice of the whole array would transpose to a full-size update per chunk).
        scanned = (_stack_chunks(index_q, num_chunks, chunk), _stack_chunks(index_weights, num_chunks, chunk))
        remat = jax.checkpoint(chunk_rows)  # the backward recomputes one chunk at a time
        _, (kl, nonempty) = lax.scan(lambda c, xs: (c, remat(xs[0], xs[1], keys, xs[2])), None,
                                     (starts, *scanned))
        return _unstack_chunks(kl), _unstack_chunks(nonempty)

    # The one-kernel gradient pass adds each chunk's dk to the TensorCores' running sums in place (the carry is
    # aliased to its output): no [R, d_p] partial sums written, re-read and added in XLA per chunk; and where
    # index_q's layout allows, it reads the chunk's index_q rows and writes their gradient where they lie in the
    # whole arrays (no [chunk, H_I, d_I] copies: 8 MiB each at S = 128K).
    in_kernel_dk, q_in_place = _in_place_operands(ctx.kernel_config if gathers else None, index_q, chunk, True)

    def step(carry, start):
        # No autodiff here: the rows are sliced in place and their gradients written in place (no stacked copies).
        dk_total, dq_all, dw_all = carry
        rows_of = lambda x: lax.dynamic_slice_in_dim(x, start, chunk, axis=1)
        (kl, nonempty), (dq, dk, dw) = chunk_rows(
            start, None if q_in_place else rows_of(index_q), keys, rows_of(index_weights),
            dk_partials=dk_total if in_kernel_dk else None,
            rows_in_place=(index_q, dq_all, start) if q_in_place else None)
        dq_all = dq if q_in_place else lax.dynamic_update_slice_in_dim(dq_all, dq.astype(dq_all.dtype), start, axis=1)
        dw_all = lax.dynamic_update_slice_in_dim(dw_all, dw.astype(dw_all.dtype), start, axis=1)
        return (dk if in_kernel_dk else dk_total + dk, dq_all, dw_all), (kl, nonempty)

    dk_init = student_gather_kl.dk_partials_zeros(keys) if in_kernel_dk else jnp.zeros_like(keys)
    init = (dk_init, jnp.zeros_like(index_q), jnp.zeros_like(index_weights))
    (dk_total, dq, dw), (kl, nonempty) = lax.scan(step, init, starts)
    if in_kernel_dk:
        dk_total = student_gather_kl.finish_dk_partials(dk_total)
    if kernels:  # the padded keys' cotangent -> index_k's
        dk_total = dk_total[:, :index_k.shape[1], :index_k.shape[2]]
    return _unstack_chunks(kl), _unstack_chunks(nonempty), (dq, dk_total, dw)


def _in_place_operands(cfg, index_q, chunk: int, with_gradient: bool) -> tuple:
    """(dk in place, index_q rows in place) for the one-kernel gradient pass over chunks of `chunk` rows, from a
    `StudentGatherConfig`'s dk_in_place / rows_in_place (None: wherever they apply) or None (other students: no);
    a field forced True where it cannot apply is a ValueError naming it."""
    if cfg is None:
        return False, False
    why = None  # why the one-kernel pass's operands cannot be in place
    if not cfg.fuse_kl:
        why = "fuse_kl=True"
    elif not with_gradient:
        why = "a scalar reduction (reduction='none' differentiates through the rematerialised chunks)"
    rows_why = why
    if why is None and not student_gather_kl.rows_in_place_ok(index_q, chunk, cfg):
        rows_why = (f"index_q with d_I a multiple of 128 in bf16 or f32 and chunks of whole query tiles of both "
                    f"TensorCores; got d_I={index_q.shape[3]}, {index_q.dtype}, chunks of {chunk} rows")
    for name, reason in (("dk_in_place", why), ("rows_in_place", rows_why)):
        if getattr(cfg, name) is True and reason is not None:
            raise ValueError(f"student: StudentGatherConfig.{name}=True needs {reason}")
    return why is None and cfg.dk_in_place is not False, rows_why is None and cfg.rows_in_place is not False


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kl_sum(ctx: _Chunks, index_q, index_k, index_weights, teacher: dict):
    """(ctx.row_weight * sum_t KL_t, non-empty rows [B, S]); differentiable wrt the student's three tensors (the
    gradient taken in the forward pass, see the module docstring); the teacher's arrays get exact zero cotangents."""
    kl, nonempty = _scan_rows(ctx, index_q, index_k, index_weights, teacher, with_gradient=False)
    return ctx.row_weight * jnp.sum(kl), nonempty


def _kl_sum_fwd(ctx, index_q, index_k, index_weights, teacher):
    kl, nonempty, grads = _scan_rows(ctx, index_q, index_k, index_weights, teacher, with_gradient=True)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (index_q, index_k, index_weights, teacher))
    outputs, grads = loss_vjp.named_residuals(((ctx.row_weight * jnp.sum(kl), nonempty), grads))
    return outputs, (grads, like)


def _kl_sum_bwd(ctx, residuals, cotangents):
    grads, (q_like, k_like, w_like, teacher_like) = residuals
    ct = cotangents[0]
    # One rounding more for 16-bit inputs when ct is not a power of two (the kernel rounded its f32 gradient once);
    # a constant-1 cotangent (the loss itself differentiated, row_weight folded into G) leaves XLA nothing to do.
    out = tuple((ct * g.astype(jnp.float32)).astype(like.dtype) for g, like in zip(grads, (q_like, k_like, w_like)))
    zeros = jax.tree.map(lambda like: placement.zeros_varying_like(like, ct), teacher_like)  # SPEC §8: exact zeros
    return out + (zeros,)


_kl_sum.defvjp(_kl_sum_fwd, _kl_sum_bwd)


def _prepare(st: student_lib.Student, problem: Problem, query_chunk, student, row_weight: float = 1.0):
    """(the static `_Chunks`, the teacher's arrays) of one chunked loss; u computed here for a joint target."""
    from csa_pallas import ops, ops_sparse
    use_kernels, _ = student_plan.resolve_student(student, problem, st.index_q.shape)
    visit = student_plan.visit_student(student, problem, st.index_q.shape)
    if query_chunk is None:
        chunk = student_plan.default_query_chunk(problem, st.head_chunk, st.index_q.shape[3],
                                                 student_kernels=use_kernels, index_heads=st.index_q.shape[2],
                                                 visit=visit)
    else:
        chunk = student_plan.check_query_chunk(query_chunk, problem.seq_len)
    kernel_cfg = student_plan.kernel_config(student, problem, st.index_q.shape, rows=chunk)
    if problem.target == "joint" and problem.full_lse is None and problem.noncompressed_lse is None:
        problem = dataclasses.replace(problem, noncompressed_lse=lax.stop_gradient(ops.noncompressed_lse(problem)))
    # The teacher's key operands once for every chunk (not a cast and NaN fill per chunk), without a NaN-filled
    # copy of compressed_kv where the chunks can do without (at S = 128K it was the largest temp, 32 MiB):
    #  * one chunk: the problem itself, `ops.kernel_keys` (non-finite rows NaN-filled, a copy);
    #  * dense, several chunks: the keys as given; each chunk makes its rows that read a non-finite block NaN
    #    through their query rows (`_poisoned`; the chunk's q rows are a copy anyway): the same rows NaN (SPEC §3);
    #  * sparse gather path, several chunks: the keys as given (the gather kernel makes +-inf NaN as it packs its
    #    resident copy in VMEM; a packed copy in HBM was a 32 MiB temp at 128K);
    #  * sparse visit path: the NaN-filled keys (short context: N is small there).
    many = chunk < problem.seq_len
    gather = False
    if many and problem.sparse and not visit:  # the path depends on N, H and K only: the chunks take this one
        gather = ops_sparse.sparse_layout(problem, kl_logits_dtype=jnp.float32).path == "gather"
    poison_rows = many and not problem.sparse
    keys = ops.cast_keys(problem) if poison_rows or gather else ops.kernel_keys(problem)
    problem = dataclasses.replace(problem, compressed_kv=keys, kv_ready=True)
    teacher = {name: getattr(problem, name) for name in _ARRAY_FIELDS if getattr(problem, name) is not None}
    template = dataclasses.replace(problem, **dict.fromkeys(_ARRAY_FIELDS))
    return _Chunks(template, problem.seq_len // chunk, chunk, kernel_cfg, st.head_chunk, row_weight,
                   poison_rows, st.key_values_dtype), teacher


def kl_total(st: student_lib.Student, problem: Problem, *, query_chunk: Optional[int] = None, student="auto",
             row_weight: float = 1.0):
    """(row_weight * sum_t KL_t f32 scalar, non-empty rows bool [B, S]): the gradient taken in the forward pass
    (module docstring); what every scalar reduction is made of. row_weight: a static number (see `_Chunks`)."""
    st = student_lib.with_f32_keys(st)  # index_k's cotangent sums over the chunks in f32, rounded once
    ctx, teacher = _prepare(st, problem, query_chunk, student, row_weight)
    return _kl_sum(ctx, st.index_q, st.index_k, st.index_weights, teacher)


def kl_rows(st: student_lib.Student, problem: Problem, *, query_chunk: Optional[int] = None, student="auto"):
    """(per-row KL f32 [B, S], non-empty rows bool [B, S]), differentiated through the rematerialised scan (for
    per-row cotangents)."""
    st = student_lib.with_f32_keys(st)  # index_k's cotangent sums over the chunks in f32, rounded once
    ctx, teacher = _prepare(st, problem, query_chunk, student)
    return _scan_rows(ctx, st.index_q, st.index_k, st.index_weights, teacher, with_gradient=False)


def loss(st: student_lib.Student, problem: Problem, *, reduction: str, scale, query_chunk: Optional[int] = None,
         student="auto"):
    """The fused student's loss through the kernels, chunk by chunk (module docstring); the reduction of
    `reference.reduce_rows`. Differentiable wrt the student's three tensors. student: see `resolve_student`."""
    if reduction == "none":  # a cotangent per row: autodiff through the rematerialised scan
        kl, nonempty = kl_rows(st, problem, query_chunk=query_chunk, student=student)
        return reference.reduce_rows(kl, nonempty, reduction, scale)
    from csa_pallas import ops
    # Every row weighed by one static number (sum, mean_all, mean with default ids): folded into the kernels' G.
    known = None if problem.sparse else ops.static_nonempty_rows(problem)
    weighted = loss_vjp.uniformly_weighted_loss(
        reduction, scale, problem.batch, problem.seq_len, known,
        lambda w: kl_total(st, problem, query_chunk=query_chunk, student=student, row_weight=w)[0])
    if weighted is not None:
        return weighted
    total, nonempty = kl_total(st, problem, query_chunk=query_chunk, student=student)
    return reference.reduce_total(total, nonempty, reduction, scale)
