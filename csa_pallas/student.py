"""The lightning indexer's scores from its inputs (SPEC §8): validation and the pure-JAX student.

    I[t, s] = sum_j index_weights[t, j] * ReLU(index_q[t, j] . index_k[s])

`scores` computes I in f32 (exact products, f32 accumulation; bf16 inputs through `_split_dots`) as a
`lax.scan` over chunks of the indexer heads that accumulates the head-weighted sum, each step under
`jax.checkpoint` (MaxText PR #5116's memory pattern: the [B, S, chunk, N] ReLU terms exist one chunk at a time,
forward and backward). With every head in one chunk it is the plain reference; with matmul="native" it is the
MaxText-style XLA indexer the benchmarks compare against. The derivative of ReLU at exactly 0 is 0 (SPEC §8's
indicator [q . k > 0]).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from csa_pallas import validation
from csa_pallas.kernels.common import finite_or_zero  # the kernels' own rule (SPEC §6: the two must agree)
from csa_pallas.validation import Problem


@dataclasses.dataclass(frozen=True)
class Student:
    """Validated student inputs (caller dtypes)."""

    index_q: jax.Array  # [B, S, H_I, d_I]
    index_k: jax.Array  # [B, N, d_I]
    index_weights: jax.Array  # [B, S, H_I]
    head_chunk: int  # indexer heads per scan step (a divisor of H_I)
    key_dtype: object = None  # the dtype index_k's values come in when it was upcast (`with_f32_keys`); None: its own

    @property
    def num_heads(self) -> int:
        return self.index_q.shape[2]

    @property
    def key_values_dtype(self):
        """The dtype of index_k's values, which decides the MXU operands (`_splits`, `student_scores.operand_dtype`)."""
        return jnp.dtype(self.index_k.dtype if self.key_dtype is None else self.key_dtype)


def with_f32_keys(student: Student) -> Student:
    """The student with index_k upcast to f32 (exact), its values' dtype kept in key_dtype: for a caller that sums
    index_k's cotangent over query chunks or devices, so the sum runs in f32 and the gradient is rounded to index_k's
    dtype once, by the upcast's transpose (SPEC §6: all accumulation in f32)."""
    if student.index_k.dtype == jnp.float32:
        return student
    return dataclasses.replace(student, index_k=student.index_k.astype(jnp.float32),
                               key_dtype=student.key_values_dtype)


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
    a slot outside V(t) gets a zero row, so a non-finite index_k row it does not see never meets its zero
    cotangent in a product: only the rows that select a non-finite block see it, as in the gather kernels)."""
    from csa_pallas import ops_sparse
    keys = student.index_k.astype(_compute_dtype(student, matmul))
    if not problem.sparse:
        return keys
    idx = jnp.clip(problem.topk_indices, 0, max(problem.num_blocks - 1, 0))
    rows = jax.vmap(lambda k, i: k[i])(keys, idx)
    return jnp.where(ops_sparse.slot_validity(problem)[..., None], rows, jnp.zeros((), rows.dtype))


MATMULS = ("exact", "native")


def _compute_dtype(student: Student, matmul: str):
    """The matmul operands' dtype. "exact": f32 (an exact upcast) at full precision, so the backward's f32
    cotangents are not rounded either (what SPEC §6 asks). "native": the inputs' own dtype at the MXU's default
    precision with f32 accumulation - MaxText's numerics (its backward rounds the f32 cotangents of the scores to
    bf16), several times cheaper on a TPU; the benchmarks' baseline indexer."""
    dt = jnp.promote_types(student.index_q.dtype, student.key_values_dtype)
    return jnp.float32 if matmul == "exact" or dt == jnp.float16 else dt


def _splits(student: Student, matmul: str) -> bool:
    """"exact" with bf16 indexer queries and keys: `_split_dots` (as exact, a third of the MXU passes)."""
    return matmul == "exact" and student.index_q.dtype == jnp.bfloat16 and student.key_values_dtype == jnp.bfloat16


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _split_dots(a, b, spec: str):
    """einsum(spec, a, b) in f32 for f32 operands that hold bf16 values (the exact upcast of bf16 inputs): one
    bf16 MXU pass (the products are exact, the accumulation f32). The backward splits each f32 cotangent into two
    bf16 terms (hi + lo, ~2^-17 relative) for two bf16 passes with f32 accumulation, instead of the six passes of
    a full-precision f32 matmul; the operands' cotangents stay f32 (they accumulate over chunks)."""
    return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _split_dots_fwd(a, b, spec):
    return _split_dots(a, b, spec), (a, b)


def _split_dots_bwd(spec, residuals, g):
    a, b = residuals
    operands, out = spec.split("->")
    a_spec, b_spec = operands.split(",")
    return (_products(f"{out},{b_spec}->{a_spec}", g, b, split=True),
            _products(f"{out},{a_spec}->{b_spec}", g, a, split=True))


_split_dots.defvjp(_split_dots_fwd, _split_dots_bwd)


def _dots(q_chunk, keys, sparse: bool, split: bool):
    """q . k, f32 [B, S, c, N or K]: q_chunk [B, S, c, d_I], keys [B, N, d_I] or [B, S, K, d_I]."""
    spec = "bsjd,bskd->bsjk" if sparse else "bsjd,bnd->bsjn"
    if split:
        return _split_dots(q_chunk, keys, spec)
    precision = jax.lax.Precision.HIGHEST if q_chunk.dtype == jnp.float32 else None
    return jnp.einsum(spec, q_chunk, keys, precision=precision, preferred_element_type=jnp.float32)


def _chunk_scores(q_chunk, w_chunk, keys, sparse: bool, split: bool):
    """sum_j w[t, j] ReLU(q[t, j] . k), f32: q_chunk [B, S, c, d_I], w_chunk f32 [B, S, c]. Differentiated by
    plain autodiff (the "native" baseline's numerics)."""
    dots = _dots(q_chunk, keys, sparse, split)
    return jnp.einsum("bsj,bsjn->bsn", w_chunk, jax.nn.relu(dots), precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _exact_chunk_scores(q_chunk, w_chunk, keys, sparse: bool, split: bool):
    """`_chunk_scores` with the backward SPEC §8's chain rule defines on every input, finite or not (SPEC §6: the
    kernels compute the same):
        d w[t, j] = sum_s [G != 0] G ReLU(z),   C = [z > 0] G w',   d q = C k',   d k = C^T q',
    z = q . k from the inputs as given (the forward's scores), G the cotangent of I, and w', k', q' the inputs with
    non-finite entries replaced by 0: a term whose cotangent is 0 (outside V(t), a masked or empty row) is 0 even
    against a NaN or inf input, so a non-finite value reaches exactly the gradients of the rows whose loss reads
    it (those rows' G is NaN) instead of every row that meets it in a product (0 x NaN)."""
    return _chunk_scores(q_chunk, w_chunk, keys, sparse, split)


def _exact_chunk_scores_fwd(q_chunk, w_chunk, keys, sparse, split):
    return _chunk_scores(q_chunk, w_chunk, keys, sparse, split), (q_chunk, w_chunk, keys)


def _exact_chunk_scores_bwd(sparse, split, residuals, g):
    q_chunk, w_chunk, keys = residuals
    dots = _dots(q_chunk, keys, sparse, split)  # [B, S, c, N or K]
    g = g[:, :, None, :]
    dw = jnp.sum(jnp.where(g != 0.0, g * jnp.maximum(dots, 0.0), 0.0), axis=-1)
    coef = jnp.where(dots > 0.0, g * finite_or_zero(w_chunk)[..., None], 0.0)
    dq_spec, dk_spec = (("bsjk,bskd->bsjd", "bsjk,bsjd->bskd") if sparse else
                        ("bsjn,bnd->bsjd", "bsjn,bsjd->bnd"))
    dq = _products(dq_spec, coef, finite_or_zero(keys), split)
    dk = _products(dk_spec, coef, finite_or_zero(q_chunk), split)
    return dq.astype(q_chunk.dtype), dw, dk.astype(keys.dtype)


def _products(spec: str, coef, operand, split: bool):
    """einsum(spec, coef f32, operand) with f32 accumulation: the f32 cotangent split into bf16 hi + lo passes
    when the operand holds bf16 values (`_split_dots`'s backward), else at HIGHEST precision."""
    if not split:
        return jnp.einsum(spec, coef, operand, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    hi = coef.astype(jnp.bfloat16)
    lo = (coef - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    return sum(jnp.einsum(spec, part, operand.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
               for part in (hi, lo))


_exact_chunk_scores.defvjp(_exact_chunk_scores_fwd, _exact_chunk_scores_bwd)


def scores(student: Student, problem: Problem, matmul: str = "exact") -> jax.Array:
    """I, f32 [B, S, N] (dense) or [B, S, K] (sparse, slot order), every entry computed (V(t) is the caller's to
    apply). Differentiable wrt the three indexer tensors. matmul: see `_compute_dtype`."""
    validation.check_choice("matmul", matmul, MATMULS)
    keys = _selected_keys(student, problem, matmul)
    q = student.index_q.astype(_compute_dtype(student, matmul))
    w = student.index_weights.astype(jnp.float32)
    c, h_i = student.head_chunk, student.num_heads
    split = _splits(student, matmul)
    chunk_scores = _exact_chunk_scores if matmul == "exact" else _chunk_scores
    body = jax.checkpoint(lambda q_c, w_c: chunk_scores(q_c, w_c, keys, problem.sparse, split))
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
