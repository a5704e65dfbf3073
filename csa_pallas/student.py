"""The lightning indexer's scores from its inputs (SPEC §8): validation and the pure-JAX student.

    I[t, s] = sum_j index_weights[t, j] * ReLU(index_q[t, j] . index_k[s])

`scores` computes I in f32 (f32 accumulation of exact bf16 products; f16 upcast) as a `lax.scan` over chunks of the indexer heads
that accumulates the head-weighted sum, each step under `jax.checkpoint` (MaxText PR #5116's memory pattern: the
[B, S, chunk, N] ReLU terms exist one chunk at a time, forward and backward). With every head in one chunk it is
the plain reference; with a chunk it is also the MaxText-style XLA indexer the benchmarks compare against. The
derivative of ReLU at exactly 0 is 0 (SPEC §8's indicator [q . k > 0]).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from csa_pallas import validation
from csa_pallas.validation import Problem


@dataclasses.dataclass(frozen=True)
class Student:
    """Validated student inputs (caller dtypes)."""

    index_q: jax.Array  # [B, S, H_I, d_I]
    index_k: jax.Array  # [B, N, d_I]
    index_weights: jax.Array  # [B, S, H_I]
    head_chunk: int  # indexer heads per scan step (a divisor of H_I)

    @property
    def num_heads(self) -> int:
        return self.index_q.shape[2]


def validate_student(index_q, index_k, index_weights, *, batch: Optional[int] = None, seq_len: Optional[int] = None,
                     num_blocks: Optional[int] = None, index_head_chunk=None) -> Student:
    """Checks the indexer's tensors against each other (and against the teacher's B, S, N when given), naming the
    argument; returns the `Student`."""
    validation._check_float("index_q", index_q)
    validation._check_rank("index_q", index_q, 4, "[B, S, H_I, d_I]")
    b, s, h_i, d_i = validation._shape(index_q)
    for name, expected, got in (("B", batch, b), ("S", seq_len, s)):
        if expected is not None and got != expected:
            raise ValueError(f"index_q: expected shape [B, S, H_I, d_I] with {name}={expected} like q, got "
                             f"{validation._shape(index_q)}")
    validation._check_float("index_k", index_k)
    validation._check_rank("index_k", index_k, 3, "[B, N, d_I]")
    n = validation._shape(index_k)[1] if num_blocks is None else num_blocks
    validation._check_shape("index_k", index_k, (b, n, d_i),
                            "[B, N, d_I]: B and d_I of index_q" + ("" if num_blocks is None else
                                                                   ", N of compressed_kv"))
    validation._check_float("index_weights", index_weights)
    validation._check_shape("index_weights", index_weights, (b, s, h_i), "[B, S, H_I] like index_q")
    if index_head_chunk is None:
        chunk = h_i
    else:
        chunk = validation._check_positive_int("index_head_chunk", index_head_chunk)
        if h_i % chunk:
            raise ValueError(f"index_head_chunk: expected a divisor of the indexer heads H_I={h_i}, got {chunk}")
    return Student(jnp.asarray(index_q), jnp.asarray(index_k), jnp.asarray(index_weights), chunk)


def _selected_keys(student: Student, problem: Problem, matmul: str) -> jax.Array:
    """The keys each score is taken against: [B, N, d_I] (dense), or [B, S, K, d_I] gathered per slot (sparse;
    an empty slot reads block 0 and is masked by V(t))."""
    keys = student.index_k.astype(_compute_dtype(student, matmul))
    if not problem.sparse:
        return keys
    idx = jnp.clip(problem.topk_indices, 0, max(problem.num_blocks - 1, 0))
    return jax.vmap(lambda k, i: k[i])(keys, idx)


MATMULS = ("exact", "native")


def _compute_dtype(student: Student, matmul: str):
    """The matmul operands' dtype. "exact": f32 (an exact upcast) at full precision, so the backward's f32
    cotangents are not rounded either (what SPEC §6 asks). "native": the inputs' own dtype at the MXU's default
    precision with f32 accumulation - MaxText's numerics (its backward rounds the f32 cotangents of the scores to
    bf16), several times cheaper on a TPU; the benchmarks' baseline indexer."""
    dt = jnp.promote_types(student.index_q.dtype, student.index_k.dtype)
    return jnp.float32 if matmul == "exact" or dt == jnp.float16 else dt


def _chunk_scores(q_chunk, w_chunk, keys, sparse: bool):
    """sum_j w[t, j] ReLU(q[t, j] . k), f32: q_chunk [B, S, c, d_I], w_chunk f32 [B, S, c]."""
    precision = jax.lax.Precision.HIGHEST if q_chunk.dtype == jnp.float32 else None
    spec = "bsjd,bskd->bsjk" if sparse else "bsjd,bnd->bsjn"
    dots = jnp.einsum(spec, q_chunk, keys, precision=precision, preferred_element_type=jnp.float32)
    return jnp.einsum("bsj,bsjn->bsn", w_chunk, jax.nn.relu(dots), precision=jax.lax.Precision.HIGHEST)


def scores(student: Student, problem: Problem, matmul: str = "exact") -> jax.Array:
    """I, f32 [B, S, N] (dense) or [B, S, K] (sparse, slot order), every entry computed (V(t) is the caller's to
    apply). Differentiable wrt the three indexer tensors. matmul: see `_compute_dtype`."""
    validation.check_choice("matmul", matmul, MATMULS)
    keys = _selected_keys(student, problem, matmul)
    q = student.index_q.astype(_compute_dtype(student, matmul))
    w = student.index_weights.astype(jnp.float32)
    c, h_i = student.head_chunk, student.num_heads
    body = jax.checkpoint(lambda q_c, w_c: _chunk_scores(q_c, w_c, keys, problem.sparse))
    if c == h_i:
        return body(q, w)
    b, s = q.shape[:2]
    q_chunks = jnp.moveaxis(q.reshape(b, s, h_i // c, c, -1), 2, 0)  # [H_I / c, B, S, c, d_I]
    w_chunks = jnp.moveaxis(w.reshape(b, s, h_i // c, c), 2, 0)

    def step(acc, chunk):
        return acc + body(*chunk), None

    total, _ = jax.lax.scan(step, jnp.zeros((b, s, problem.width), jnp.float32), (q_chunks, w_chunks))
    return total


def masked_scores(student: Student, problem: Problem) -> jax.Array:
    """I with -inf outside V(t) (what a model's top-k selection reads)."""
    from csa_pallas import reference
    return jnp.where(reference.support(problem), scores(student, problem), -jnp.inf)
