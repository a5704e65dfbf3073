"""Public entry points: validate, pick an implementation, run.

`implementation`:
  * "xla"    - the pure-JAX reference (`csa_pallas.reference`), any configuration.
  * "pallas" - the Pallas TPU kernels (`csa_pallas.ops`); interpret mode on a non-TPU backend. A configuration the
               kernels do not cover raises NotImplementedError naming what is missing.
  * None     - "pallas" when the kernels cover the configuration, else "xla" (see `choose_implementation`).

On the Pallas path, inputs on a multi-device mesh make the op partition itself (`csa_pallas.placement` finds the
layout, `csa_pallas.sharding` runs the kernels under shard_map); one device or none: the kernels directly.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from csa_pallas import masks
from csa_pallas import placement
from csa_pallas import reference
from csa_pallas import teacher_args
from csa_pallas import validation
from csa_pallas.validation import Problem


def pallas_unsupported_reason(problem: Problem) -> Optional[str]:
    """Why the Pallas kernels cannot run this problem, or None when they can."""
    from csa_pallas import ops
    return ops.window_supported_reason(problem)


def check_config(config, implementation: str) -> None:
    """config selects a kernel variant: it needs the Pallas path."""
    if config is not None and implementation != "pallas":
        raise ValueError("config: a kernel variant was given but the call runs the XLA reference "
                         "(implementation='xla', or a configuration the kernels do not cover); drop config or use "
                         "implementation='pallas'")


def trivial_result(problem: Problem, reduction: str, scale) -> Optional[jax.Array]:
    """The loss without any computation, else None: exact zeros (and zero gradients) when the static scale is 0
    (SPEC §4: whatever the inputs hold, no kernel runs) or nothing can contribute (B = 0, S = 0 or N = 0)."""
    if not validation.switched_off(scale) and problem.batch and problem.seq_len and problem.num_blocks:
        return None
    return jnp.zeros((problem.batch, problem.seq_len), jnp.float32) if reduction == "none" else jnp.float32(0.0)


def check_window_layout(segment_ids, positions):
    """Opt-in `checkify` check of the window-LSE kernel's contract (`masks.window_layout_ok`): every document is
    one contiguous run of the sequence with strictly increasing positions (MaxText packing). Call it inside a
    function you wrap with `jax.experimental.checkify.checkify` (or eagerly); concrete ids are checked
    automatically. segment_ids, positions: int [B, S]."""
    from jax.experimental import checkify
    checkify.check(masks.window_layout_ok(jnp.asarray(segment_ids), jnp.asarray(positions)),
                   "csa_pallas: the window-LSE kernel needs every document to be one contiguous run of the sequence "
                   "with strictly increasing positions; pass noncompressed_lse or implementation='xla' otherwise")


def _placed(problem: Problem, run_sharded):
    """The op's result through `sharding.py` when its inputs live on a multi-device mesh (`placement.resolve`),
    else None. run_sharded(mesh, axes_kwargs) makes the sharded call (the caller's config= included)."""
    where = placement.resolve(problem.q)
    if where is None:
        return None
    axes = dict(batch_axes=where.batch_axes, head_axis=where.head_axis, seq_axis=where.seq_axis)
    try:
        return run_sharded(where.mesh, axes)
    except ValueError as e:
        if str(e).split(":", 1)[0] not in ("batch_axes", "head_axis", "seq_axis", "head_chunk"):
            raise  # not about the derived mesh axes: the caller's own argument
        raise ValueError(f"{e} [the op derived this layout: {where.describe()}; reshard the inputs or call "
                         f"{placement.ENTRY_POINT}]") from e


def choose_implementation(problem: Problem) -> str:
    if problem.implementation == "xla":
        return "xla"
    reason = pallas_unsupported_reason(problem)
    if problem.implementation == "pallas":
        if reason is not None:
            raise NotImplementedError(f"implementation='pallas': {reason}")
        return "pallas"
    return "xla" if reason is not None else "pallas"


@teacher_args.takes_teacher_args
def indexer_distill_loss(
    indexer_logits: jax.Array,
    q: jax.Array,
    compressed_kv: jax.Array,
    *,
    teacher: dict,
    reduction: str = "mean",
    scale=1.0,
    config=None,
) -> jax.Array:
    """DeepSeek-V4 CSA lightning-indexer distillation loss KL(P || softmax_V(I)) (SPEC §3-§5).

    Args:
      indexer_logits: the student scores I, float [B, S, N] (dense) or [B, S, K] (sparse, slot k of
        `topk_indices`). The only differentiable input.
      q: attention queries after RoPE, float [B, S, H, D] (bf16 or f32). Teacher side, gets zero gradient.
      compressed_kv: the CSA compressed KV blocks, float [B, N, D] with N = S_kv // compress_ratio.
      {teacher_args}
      reduction: "mean" (over non-empty rows), "mean_all" (over B*S), "sum" or "none" ([B, S] rows).
      scale: loss coefficient multiplying the result. A static 0 (Python/NumPy number) returns exact zeros (and
        zero gradients) without computing anything.
      config: the teacher kernel's variant (`csa_pallas.kernels.teacher_config.TeacherConfig`, or a dict of its fields
        overriding the heuristics, e.g. {"walk": "plain", "cache_scores": False}); Pallas path only.

    Returns:
      f32 scalar, or f32 [B, S] for reduction="none".
    """
    problem = validation.validate(q, compressed_kv, **teacher)
    validation.validate_logits(indexer_logits, problem)
    validation.check_reduction_args(reduction, scale)
    implementation = choose_implementation(problem)
    check_config(config, implementation)
    trivial = trivial_result(problem, reduction, scale)
    if trivial is not None:
        return trivial
    if implementation == "xla":
        run = lambda pr, logits: reference.indexer_distill_loss(logits, pr, reduction=reduction, scale=scale)
        return placement.on_auto_axes(run, problem, indexer_logits, row_dims=2 if reduction == "none" else 0)

    def run_sharded(mesh, axes):
        from csa_pallas import sharding
        return sharding.sharded_indexer_distill_loss(mesh, indexer_logits, q, compressed_kv, **axes, **teacher,
                                                     reduction=reduction, scale=scale, config=config)
    placed = _placed(problem, run_sharded)
    if placed is not None:
        return placed
    problem, indexer_logits = placement.vary_alike(problem, indexer_logits)
    if problem.sparse:
        from csa_pallas import ops_sparse
        return ops_sparse.indexer_distill_loss(indexer_logits, problem, reduction=reduction, scale=scale,
                                               cfg=config)
    from csa_pallas import ops
    return ops.indexer_distill_loss(indexer_logits, problem, reduction=reduction, scale=scale, cfg=config)


@teacher_args.takes_teacher_args
def teacher_distribution(
    q: jax.Array,
    compressed_kv: jax.Array,
    *,
    teacher: dict,
    config=None,
) -> jax.Array:
    """The detached target P of SPEC §3: f32 [B, S, N] (dense) or [B, S, K] (sparse, slot order).

    Same teacher-side arguments as `indexer_distill_loss`. Entries outside V(t) and empty rows are 0; a row that
    reads a non-finite input is NaN (SPEC §3).
    """
    problem = validation.validate(q, compressed_kv, **teacher)
    implementation = choose_implementation(problem)
    check_config(config, implementation)
    if not (problem.batch and problem.seq_len and problem.num_blocks):
        return jnp.zeros((problem.batch, problem.seq_len, problem.width), jnp.float32)
    if implementation == "xla":
        return placement.on_auto_axes(lambda pr: reference.teacher(pr)[0], problem, row_dims=3)

    def run_sharded(mesh, axes):
        from csa_pallas import sharding
        return sharding.sharded_teacher_distribution(mesh, q, compressed_kv, **axes, **teacher, config=config)
    placed = _placed(problem, run_sharded)
    if placed is not None:
        return placed
    problem, = placement.vary_alike(problem)
    if problem.sparse:
        from csa_pallas import ops_sparse
        return ops_sparse.teacher_distribution(problem, config)
    from csa_pallas import ops
    return ops.teacher_distribution(problem, config)


def noncompressed_lse(
    q: jax.Array,
    window_kv: jax.Array,
    *,
    sinks=None,
    segment_ids=None,
    positions=None,
    kv_segment_ids=None,
    kv_positions=None,
    window_size: int = 128,
    softmax_scale: Optional[float] = None,
    head_chunk: Optional[int] = None,
    implementation: Optional[str] = None,
) -> jax.Array:
    """u of SPEC §3: logaddexp(logsumexp over the query's window keys of tau q.k, sink); f32 [B, S, H].

    Args as in `indexer_distill_loss`; window_kv is float [B, S_kv, D].
    """
    problem = validation.validate_window_args(
        q, window_kv, sinks=sinks, segment_ids=segment_ids, positions=positions, kv_segment_ids=kv_segment_ids,
        kv_positions=kv_positions, window_size=window_size, softmax_scale=softmax_scale, head_chunk=head_chunk,
        implementation=implementation)
    implementation = choose_implementation(problem)
    if not (problem.batch and problem.seq_len):
        return jnp.zeros((problem.batch, problem.seq_len, problem.num_heads), jnp.float32)
    if implementation == "xla":
        return placement.on_auto_axes(reference.noncompressed_lse, problem, row_dims=3)

    def run_sharded(mesh, axes):
        from csa_pallas import sharding
        return sharding.sharded_noncompressed_lse(
            mesh, q, window_kv, **axes, sinks=sinks, segment_ids=segment_ids, positions=positions,
            kv_segment_ids=kv_segment_ids, kv_positions=kv_positions, window_size=window_size,
            softmax_scale=softmax_scale, head_chunk=head_chunk)
    placed = _placed(problem, run_sharded)
    if placed is not None:
        return placed
    from csa_pallas import ops
    problem, = placement.vary_alike(problem)
    return ops.noncompressed_lse(problem)


def _vary_alike_with_student(problem: Problem, st):
    """`placement.vary_alike` over the problem and the student's three arrays (a `student.Student`)."""
    problem, *arrays = placement.vary_alike(problem, st.index_q, st.index_k, st.index_weights)
    return problem, dataclasses.replace(st, **dict(zip(("index_q", "index_k", "index_weights"), arrays)))


def _student_problem(index_q, index_k, **kwargs):
    """V(t) of the indexer's tensors: `validation.validate` on placeholders with their shapes, its messages naming
    the indexer's arguments."""
    b, s, _, d_i = index_q.shape
    q = jax.ShapeDtypeStruct((b, s, 1, d_i), jnp.float32)  # one head: no layout guess about the indexer's heads
    kv = jax.ShapeDtypeStruct((b, index_k.shape[1], d_i), jnp.float32)
    try:
        return validation.validate(q, kv, target="per_head", **kwargs)
    except ValueError as e:
        message = str(e)
        for ours, theirs in (("index_q", "q"), ("index_k", "compressed_kv")):
            if message.startswith(theirs + ":"):
                raise ValueError(ours + message[len(theirs):]) from e
        raise


@teacher_args.takes_teacher_args(only=("topk_indices", "segment_ids", "positions", "kv_segment_ids", "kv_positions",
                                        "loss_mask", "compress_ratio", "implementation"))
def indexer_scores(
    index_q: jax.Array,
    index_k: jax.Array,
    index_weights: jax.Array,
    *,
    teacher: dict,
    index_head_chunk: Optional[int] = None,
) -> jax.Array:
    """The lightning indexer's scores I (SPEC §8), f32, -inf outside V(t): what a model's top-k selection reads and
    the student of the distillation loss.

    Args:
      index_q: float [B, S, H_I, d_I] indexer queries (after RoPE). index_k: float [B, N, d_I] indexer keys of the
        compressed blocks. index_weights: float [B, S, H_I] per-query head weights (every scale folded in).
      topk_indices: int [B, S, K]: the scores of the selected slots ([B, S, K], slot order) instead of all blocks.
      segment_ids, positions, kv_segment_ids, kv_positions, loss_mask, compress_ratio: V(t) as in
        `indexer_distill_loss`.
      index_head_chunk: indexer heads per step of the head-chunked computation (a divisor of H_I; default all).
      implementation: None or "xla" (the head-chunked XLA student), or "pallas": the student kernels (inputs on
        one device; dense mode `kernels/student_scores.py`, sparse mode the gather kernels,
        `kernels/student_gather.py`).

    Returns:
      f32 [B, S, N] (dense) or [B, S, K] (sparse); differentiable wrt the three indexer tensors.
    """
    from csa_pallas import student as student_lib
    st = student_lib.validate_student(index_q, index_k, index_weights, index_head_chunk=index_head_chunk)
    problem = _student_problem(st.index_q, st.index_k, **teacher)
    if teacher["implementation"] == "pallas":
        from csa_pallas.kernels import student_gather, student_scores
        problem, st = _vary_alike_with_student(problem, st)
        if placement.resolve(st.index_q) is not None:
            raise ValueError("implementation='pallas': the student kernels run on one device's inputs; on inputs "
                             "living on a mesh use None or 'xla' (XLA partitions the XLA student)")
        if problem.sparse:
            from csa_pallas import student_plan
            cfg = student_plan.gather_config(problem, st.index_q.shape)
            if cfg is None:
                raise ValueError(f"implementation='pallas': the sparse student kernels keep index_k resident in "
                                 f"VMEM, which N={problem.num_blocks} does not fit; use None or 'xla'")
            scores = student_gather.scores_of_one_chunk(st.index_q, st.index_k, st.index_weights,
                                                        problem.topk_indices, cfg)
            return jnp.where(reference.support(problem), scores, -jnp.inf)
        _, block_end = reference.block_keys(problem)
        scores = student_scores.scores(st.index_q, st.index_k, st.index_weights, problem.positions, block_end,
                                       causal_ratio=problem.compress_ratio if problem.default_ids else None)
        return jnp.where(reference.support(problem), scores, -jnp.inf)
    return student_lib.masked_scores(st, problem)


@teacher_args.takes_teacher_args
def fused_indexer_distill_loss(
    index_q: jax.Array,
    index_k: jax.Array,
    index_weights: jax.Array,
    q: jax.Array,
    compressed_kv: jax.Array,
    *,
    teacher: dict,
    reduction: str = "mean",
    scale=1.0,
    index_head_chunk: Optional[int] = None,
    query_chunk: Optional[int] = None,
    student="auto",
    config=None,
) -> jax.Array:
    """`indexer_distill_loss` with the student given by the indexer's inputs (SPEC §8): I = sum_j w ReLU(q_I . k_I).

    Args:
      index_q: float [B, S, H_I, d_I]; index_k: float [B, N, d_I]; index_weights: float [B, S, H_I] (as in
        `indexer_scores`). The differentiable inputs (f32 accumulation; gradients in their dtypes).
      q: float [B, S, H, D] attention queries; compressed_kv: float [B, N, D]. Teacher side: exact zero gradients.
      {teacher_args}
      reduction, scale: as in `indexer_distill_loss`.
      index_head_chunk: indexer heads per step of the student (a divisor of H_I; default all, on the chunked
        Pallas path the largest divisor <= 8).
      query_chunk: query rows per step of the Pallas path (a divisor of S; default: S when the unchunked
        program fits ~64 MiB per batch row, else the largest chunk whose arrays do,
        `student_plan.default_query_chunk`).
      student: how the chunked Pallas path computes the scores: "auto" (the student kernels: dense mode's tiled
        kernels; sparse mode at short context the visit student, the tiled kernels with the KL over blocks
        (`student_plan.visit_rule`), else the gather kernels while index_k fits resident in VMEM, else XLA),
        "pallas" (the kernels), "xla" (`student.scores`), or a `StudentKernelConfig` (the tiled kernels; sparse:
        the visit student) / `StudentGatherConfig` (sparse: the gather kernels) with that config.
        implementation="xla" takes "auto" or "xla".
      config: the teacher kernels' variant, as `indexer_distill_loss`'s config (a `TeacherConfig` or a dict of
        its fields; sparse mode: "path" and the path's fields, e.g. the gather path's `q_in_place`, how each query
        chunk's q rows reach the kernel). Pallas path only; on a mesh, every device's teacher takes it
        (`sharded_fused_indexer_distill_loss`).

    Pallas path: the loss is taken over chunks of query rows (`fused_student`), each chunk's scores (the student
    kernels, `kernels/student_scores.py`: the ReLU terms stay in VMEM, forward and backward) feeding the teacher +
    fused KL kernel, with the gradient taken in the forward pass for scalar reductions, so no [B, S, N] array
    exists. Inputs on a multi-device mesh: the same per device through `sharded_fused_indexer_distill_loss`, with
    the mesh axes read off the inputs (`csa_pallas.placement`). "xla": the reference throughout (`student.scores`
    and `indexer_distill_loss`'s reference, partitioned by XLA).

    Returns:
      f32 scalar, or f32 [B, S] for reduction="none".
    """
    from csa_pallas import student as student_lib
    problem = validation.validate(q, compressed_kv, **teacher)
    st = student_lib.validate_student(index_q, index_k, index_weights, batch=problem.batch,
                                      seq_len=problem.seq_len, num_blocks=problem.num_blocks,
                                      index_head_chunk=index_head_chunk)
    validation.check_reduction_args(reduction, scale)
    problem = dataclasses.replace(problem, teacher_config=validation.freeze_config(config))
    implementation = choose_implementation(problem)
    check_config(config, implementation)
    from csa_pallas import fused_student, student_plan
    use_kernels, _ = student_plan.resolve_student(student, problem, st.index_q.shape)
    if use_kernels and implementation != "pallas" and student != "auto":
        raise ValueError(f"student: the student kernels run on the Pallas path; with implementation="
                         f"{implementation!r} take 'auto' or 'xla', got {student!r}")
    trivial = trivial_result(problem, reduction, scale)
    if trivial is not None:
        return trivial
    if implementation == "xla":
        return indexer_distill_loss(student_lib.scores(st, problem), q, compressed_kv, **teacher,
                                    reduction=reduction, scale=scale)

    def run_sharded(mesh, axes):
        from csa_pallas import sharded_student
        return sharded_student.sharded_fused_indexer_distill_loss(
            mesh, index_q, index_k, index_weights, q, compressed_kv, **axes, **teacher, reduction=reduction,
            scale=scale, index_head_chunk=index_head_chunk, query_chunk=query_chunk, student=student, config=config)
    placed = _placed(problem, run_sharded)
    if placed is not None:
        return placed
    problem, st = _vary_alike_with_student(problem, st)
    if index_head_chunk is None:
        st = dataclasses.replace(st, head_chunk=student_plan.default_index_head_chunk(st.num_heads,
                                                                                               problem.sparse))
    return fused_student.loss(st, problem, reduction=reduction, scale=scale, query_chunk=query_chunk,
                              student=student)
