"""The fused student's Pallas path (SPEC §8): the loss over query chunks, so no [B, S, N] array exists.

A `lax.scan` walks the queries in chunks of `query_chunk` rows. Each step computes the chunk's student scores
(`student.scores`, XLA) and its per-row KL with the teacher + fused KL kernel (`plans.Plan.fused_kl_rows`: P stays
in VMEM), under `jax.checkpoint`: the backward recomputes the chunk's scores and runs the kernel's backward for the
chunk alone. What exists at any time is [B, query_chunk, N] (scores, their gradient) plus the student's
[B, query_chunk, index_head_chunk, N] ReLU terms, whatever S is. The KL is row-local, so a chunk's rows need only
its own queries against every key; u (the window LSE of the joint target) is computed once for all queries by the
window kernel before the scan (it needs each query's preceding keys).

The chunk problems carry explicit key-side ids (the chunk's rows are not the key sequence), so the kernels take
their metadata-table schedule, as with packed documents.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from csa_pallas import plans, reference, student as student_lib, validation
from csa_pallas.validation import Problem

TARGET_CHUNK_BYTES = 64 << 20  # the scores of one chunk, their gradient and the student terms, per batch row
MIN_QUERY_CHUNK = 64


def default_index_head_chunk(num_index_heads: int) -> int:
    """The student's heads per step on the chunked path: the largest divisor of H_I that is <= 8 (its
    [chunk, heads, N] terms are most of a chunk's memory)."""
    return max(c for c in range(1, min(num_index_heads, 8) + 1) if num_index_heads % c == 0)


def default_query_chunk(problem: Problem, index_head_chunk: int) -> int:
    """The largest divisor of S (a multiple of 8, or S itself) whose chunk keeps one batch row's f32 [chunk, N]
    arrays within TARGET_CHUNK_BYTES: measured on v5p compiles, ~2 index_head_chunk + 10 of them (the student's
    ReLU terms and dot products with their gradients, the scores and theirs, the kernel's operands)."""
    s, n = problem.seq_len, max(problem.width, 1)
    per_row = 4 * n * (2 * index_head_chunk + 10)
    # At least MIN_QUERY_CHUNK rows: below, the kernels' query tiles run part-empty and the fixed per-chunk memory
    # grows (v5p compiles at S = 128K: 16-row chunks took ~40% more temp than 64-row ones).
    limit = max(TARGET_CHUNK_BYTES // per_row, MIN_QUERY_CHUNK)
    if s <= limit:
        return s
    fits = [c for c in range(8, limit + 1, 8) if s % c == 0]
    return max(fits) if fits else s


def _check_query_chunk(query_chunk, seq_len: int) -> int:
    chunk = validation._check_positive_int("query_chunk", query_chunk)
    if seq_len % chunk:
        raise ValueError(f"query_chunk: expected a divisor of S={seq_len}, got {chunk}")
    return chunk


def _chunk_problem(problem: Problem, rows: dict) -> Problem:
    """The teacher problem of one chunk of query rows against every key (u or F given per row)."""
    stats = {name: rows[name] for name in ("noncompressed_lse", "full_lse") if name in rows}
    return validation.validate(
        rows["q"], problem.compressed_kv, topk_indices=rows.get("topk_indices"), loss_mask=rows.get("loss_mask"),
        segment_ids=rows["segment_ids"], positions=rows["positions"], kv_segment_ids=problem.kv_segment_ids,
        kv_positions=problem.kv_positions, compress_ratio=problem.compress_ratio, window_size=problem.window_size,
        softmax_scale=problem.softmax_scale, target=problem.target, head_chunk=problem.head_chunk,
        implementation="pallas", **stats)


def loss(st: student_lib.Student, problem: Problem, *, reduction: str, scale, query_chunk: Optional[int] = None):
    """The fused student's loss through the kernels, chunk by chunk (module docstring); the reduction of
    `reference.reduce_rows`. Differentiable wrt the student's three tensors."""
    from csa_pallas import ops
    chunk = default_query_chunk(problem, st.head_chunk) if query_chunk is None else _check_query_chunk(
        query_chunk, problem.seq_len)
    rows = dict(q=problem.q, segment_ids=problem.segment_ids, positions=problem.positions,
                index_q=st.index_q, index_weights=st.index_weights)
    for name in ("topk_indices", "loss_mask", "noncompressed_lse", "full_lse"):
        if getattr(problem, name) is not None:
            rows[name] = getattr(problem, name)
    if problem.target == "joint" and problem.full_lse is None and problem.noncompressed_lse is None:
        rows["noncompressed_lse"] = lax.stop_gradient(ops.noncompressed_lse(problem))
    num_chunks = problem.seq_len // chunk
    # The student's row inputs are scanned over (their gradients come back stacked, chunk by chunk); the teacher's
    # are sliced in place (no gradient, and no relayout copy of q).
    scanned = {k: rows.pop(k) for k in ("index_q", "index_weights")}
    scanned = {k: jnp.moveaxis(v.reshape(v.shape[0], num_chunks, chunk, *v.shape[2:]), 1, 0)
               for k, v in scanned.items()}

    @jax.checkpoint
    def chunk_rows(index_k, start, part):
        part = dict(part, **{k: lax.dynamic_slice_in_dim(v, start, chunk, axis=1) for k, v in rows.items()})
        shard = _chunk_problem(problem, part)
        local = student_lib.Student(part["index_q"], index_k, part["index_weights"], st.head_chunk)
        logits = student_lib.scores(local, shard)
        plan = plans.plan_for(shard)
        return plan.fused_kl_rows(logits, shard, plan.layout(shard, kl_logits_dtype=logits.dtype))

    def step(carry, xs):
        start, part = xs
        return carry, chunk_rows(st.index_k, start, part)

    _, (kl, nonempty) = lax.scan(step, None, (jnp.arange(num_chunks) * chunk, scanned))
    unstack = lambda x: jnp.moveaxis(x, 0, 1).reshape(problem.batch, problem.seq_len)
    return reference.reduce_rows(unstack(kl), unstack(nonempty), reduction, scale)
