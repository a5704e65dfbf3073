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

from typing import Optional

import jax
import jax.numpy as jnp

from csa_pallas import masks
from csa_pallas import placement
from csa_pallas import reference
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


def empty_result(problem: Problem, reduction: str) -> Optional[jax.Array]:
    """The loss when nothing can contribute (static: B = 0, S = 0 or N = 0): exact zeros; else None."""
    if problem.batch and problem.seq_len and problem.num_blocks:
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


def _placed(problem: Problem, config, run_sharded):
    """The op's result through `sharding.py` when its inputs live on a multi-device mesh (`placement.resolve`),
    else None. run_sharded(mesh, axes_kwargs) makes the sharded call."""
    where = placement.resolve(problem.q)
    if where is None:
        return None
    if config is not None:
        raise ValueError(f"config: kernel variants are not forwarded to the sharded path ({where.describe()}); drop "
                         f"config or call the op on unsharded inputs")
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


# Keyword arguments of `validation.validate` (the teacher side shared by both public ops).
_TEACHER_ARGS = ("topk_indices", "window_kv", "sinks", "noncompressed_lse", "full_lse", "segment_ids", "positions",
                 "kv_segment_ids", "kv_positions", "loss_mask", "compress_ratio", "window_size", "softmax_scale",
                 "target", "head_chunk", "implementation")


def _problem(q, compressed_kv, arguments: dict) -> Problem:
    """Validates the teacher-side arguments, picked by name from a public op's `locals()`."""
    return validation.validate(q, compressed_kv, **{name: arguments[name] for name in _TEACHER_ARGS})


def indexer_distill_loss(
    indexer_logits: jax.Array,
    q: jax.Array,
    compressed_kv: jax.Array,
    *,
    topk_indices=None,
    window_kv=None,
    sinks=None,
    noncompressed_lse=None,
    full_lse=None,
    segment_ids=None,
    positions=None,
    kv_segment_ids=None,
    kv_positions=None,
    loss_mask=None,
    compress_ratio: int = 4,
    window_size: int = 128,
    softmax_scale: Optional[float] = None,
    target: str = "joint",
    reduction: str = "mean",
    scale=1.0,
    head_chunk: Optional[int] = None,
    implementation: Optional[str] = None,
    config=None,
) -> jax.Array:
    """DeepSeek-V4 CSA lightning-indexer distillation loss KL(P || softmax_V(I)) (SPEC §3-§5).

    Args:
      indexer_logits: the student scores I, float [B, S, N] (dense) or [B, S, K] (sparse, slot k of
        `topk_indices`). The only differentiable input.
      q: attention queries after RoPE, float [B, S, H, D] (bf16 or f32). Teacher side, gets zero gradient.
      compressed_kv: the CSA compressed KV blocks, float [B, N, D] with N = S_kv // compress_ratio.
      topk_indices: int [B, S, K] selected blocks (-1 = empty slot); switches to sparse mode.
      window_kv: float [B, S_kv, D] keys of the sliding-window branch (joint target).
      sinks: float [H] per-head sink logits (joint target, with window_kv).
      noncompressed_lse: f32 [B, S, H], u of SPEC §3 when the caller has it (instead of window_kv/sinks).
      full_lse: f32 [B, S, H], the layer's full log-partition F; skips the teacher's LSE pass.
      segment_ids, positions: int [B, S] packing (default one document, positions 0..S-1).
      kv_segment_ids, kv_positions: int [B, S_kv] key side (default: the query side's).
      loss_mask: bool [B, S], False = the row takes no part in the loss (padding: MaxText's segment id 0); it is
        an empty row (0, not counted by "mean", zero gradient, nothing it reads matters).
      compress_ratio: m, tokens per compressed block. window_size: W, sliding window keys incl. the query.
      softmax_scale: tau (default D**-0.5). target: "joint" (layer's joint softmax) or "per_head".
      reduction: "mean" (over non-empty rows), "mean_all" (over B*S), "sum" or "none" ([B, S] rows).
      scale: loss coefficient multiplying the result. A static 0 (Python/NumPy number) returns exact zeros (and
        zero gradients) without computing anything.
      head_chunk: heads per VMEM tile (any divisor of H; default from the kernel config).
      implementation: None, "xla" or "pallas" (module docstring).
      config: the teacher kernel's variant (`csa_pallas.kernels.teacher_config.TeacherConfig`, or a dict of its fields
        overriding the heuristics, e.g. {"walk": "plain", "cache_scores": False}); Pallas path only.

    Returns:
      f32 scalar, or f32 [B, S] for reduction="none".
    """
    problem = _problem(q, compressed_kv, locals())
    validation.validate_logits(indexer_logits, problem)
    validation.check_reduction_args(reduction, scale)
    implementation = choose_implementation(problem)
    check_config(config, implementation)
    if validation.switched_off(scale):  # SPEC §4: exact zeros, no kernel, whatever the inputs hold
        b, s = problem.batch, problem.seq_len
        return jnp.zeros((b, s), jnp.float32) if reduction == "none" else jnp.float32(0.0)
    empty = empty_result(problem, reduction)
    if empty is not None:
        return empty
    if implementation == "xla":
        run = lambda pr, logits: reference.indexer_distill_loss(logits, pr, reduction=reduction, scale=scale)
        return placement.on_auto_axes(run, problem, indexer_logits, row_dims=2 if reduction == "none" else 0)
    arguments = locals()

    def run_sharded(mesh, axes):
        from csa_pallas import sharding
        return sharding.sharded_indexer_distill_loss(
            mesh, indexer_logits, q, compressed_kv, **axes, reduction=reduction, scale=scale,
            **{name: arguments[name] for name in _TEACHER_ARGS})
    placed = _placed(problem, config, run_sharded)
    if placed is not None:
        return placed
    placement.check_kernels_can_run_here(problem)
    if problem.sparse:
        from csa_pallas import ops_sparse
        return ops_sparse.indexer_distill_loss(indexer_logits, problem, reduction=reduction, scale=scale,
                                               cfg=config)
    from csa_pallas import ops
    return ops.indexer_distill_loss(indexer_logits, problem, reduction=reduction, scale=scale, cfg=config)


def teacher_distribution(
    q: jax.Array,
    compressed_kv: jax.Array,
    *,
    topk_indices=None,
    window_kv=None,
    sinks=None,
    noncompressed_lse=None,
    full_lse=None,
    segment_ids=None,
    positions=None,
    kv_segment_ids=None,
    kv_positions=None,
    loss_mask=None,
    compress_ratio: int = 4,
    window_size: int = 128,
    softmax_scale: Optional[float] = None,
    target: str = "joint",
    head_chunk: Optional[int] = None,
    implementation: Optional[str] = None,
    config=None,
) -> jax.Array:
    """The detached target P of SPEC §3: f32 [B, S, N] (dense) or [B, S, K] (sparse, slot order).

    Same teacher-side arguments as `indexer_distill_loss`. Entries outside V(t) and empty rows are 0; a row that
    reads a non-finite input is NaN (SPEC §3).
    """
    problem = _problem(q, compressed_kv, locals())
    implementation = choose_implementation(problem)
    check_config(config, implementation)
    if not (problem.batch and problem.seq_len and problem.num_blocks):
        return jnp.zeros((problem.batch, problem.seq_len, problem.width), jnp.float32)
    if implementation == "xla":
        return placement.on_auto_axes(lambda pr: reference.teacher(pr)[0], problem, row_dims=3)
    arguments = locals()

    def run_sharded(mesh, axes):
        from csa_pallas import sharding
        return sharding.sharded_teacher_distribution(mesh, q, compressed_kv, **axes,
                                                     **{name: arguments[name] for name in _TEACHER_ARGS})
    placed = _placed(problem, config, run_sharded)
    if placed is not None:
        return placed
    placement.check_kernels_can_run_here(problem)
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
    placed = _placed(problem, None, run_sharded)
    if placed is not None:
        return placed
    from csa_pallas import ops
    placement.check_kernels_can_run_here(problem)
    return ops.noncompressed_lse(problem)
