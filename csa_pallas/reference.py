"""Pure-JAX f32 reference of SPEC.md: the executable spec every kernel is tested against.

Clarity over memory: this materialises [B, H, S, N] (dense) or [B, S, K, D] / [B, H, S, K] (sparse) tensors and
[B, H, S, S_kv] window logits. It is differentiable with `jax.grad` and gives the SPEC §5 gradients: the teacher is
built under `stop_gradient` (exact zeros for q, compressed_kv, window_kv, sinks) and the student log-softmax is
shielded with `where` so masked slots and empty rows get exactly zero gradient and no NaN, even when the masked
logits are NaN or -inf.

All functions take a validated `Problem` (see `validation.py`); the public entry points live in `api.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from csa_pallas import masks
from csa_pallas.validation import Problem

F32_TINY = float(jnp.finfo(jnp.float32).tiny)


def _masked_logsumexp(x, mask, axis):
    """logsumexp of x over the True entries of mask; -inf where none. Safe to differentiate (no NaN)."""
    any_true = jnp.any(mask, axis=axis, keepdims=True)
    x = jnp.where(mask, x, -jnp.inf)
    x = jnp.where(any_true, x, 0.0)  # an all-masked row would give exp(-inf - -inf) = NaN in the gradient
    lse = jax.nn.logsumexp(x, axis=axis)
    return jnp.where(jnp.squeeze(any_true, axis), lse, -jnp.inf)


def block_keys(problem: Problem):
    return masks.block_keys(problem.kv_segment_ids, problem.kv_positions, problem.compress_ratio, problem.num_blocks)


def support(problem: Problem) -> jax.Array:
    """V(t) membership: bool [B, S, N] (dense) or [B, S, K] (sparse, per slot)."""
    block_segment, block_end = block_keys(problem)
    if problem.sparse:
        return masks.slot_visible(problem.topk_indices, problem.segment_ids, problem.positions, block_segment,
                                  block_end)
    return masks.block_visible(problem.segment_ids, problem.positions, block_segment, block_end)


def noncompressed_lse(problem: Problem) -> jax.Array:
    """u[b, t, h] = logaddexp(logsumexp_{j in Win(t)} tau q[t,h].window_kv[j], sinks[h]); f32 [B, S, H]."""
    q = problem.q.astype(jnp.float32)
    kv = problem.window_kv.astype(jnp.float32)
    logits = problem.softmax_scale * jnp.einsum("bshd,bjd->bhsj", q, kv)  # [B, H, S, S_kv]
    window = masks.window_visible(problem.segment_ids, problem.positions, problem.kv_segment_ids,
                                  problem.kv_positions, problem.window_size)
    lse = _masked_logsumexp(logits, window[:, None], axis=-1)  # [B, H, S]
    if problem.sinks is not None:
        lse = jnp.logaddexp(lse, problem.sinks.astype(jnp.float32)[None, :, None])
    return jnp.transpose(lse, (0, 2, 1))


def teacher_logits(problem: Problem) -> jax.Array:
    """z[b, h, t, s] = tau q[t,h].c[s] over blocks (dense, [B,H,S,N]) or selected slots (sparse, [B,H,S,K])."""
    q = problem.q.astype(jnp.float32)
    kv = problem.compressed_kv.astype(jnp.float32)
    if not problem.sparse:
        return problem.softmax_scale * jnp.einsum("bshd,bnd->bhsn", q, kv)
    if problem.num_blocks == 0:  # S_kv < m: every slot is empty, there is nothing to gather from
        b, s, h, _ = problem.q.shape
        return jnp.zeros((b, h, s, problem.width), jnp.float32)
    safe, _ = masks.slot_blocks(problem.topk_indices, problem.num_blocks)
    gathered = jax.vmap(lambda kv_b, idx_b: kv_b[idx_b])(kv, safe)  # [B, S, K, D]
    return problem.softmax_scale * jnp.einsum("bshd,bskd->bhsk", q, gathered)


def teacher(problem: Problem):
    """The target P (SPEC §3), f32 [B, S, N|K], and its support V(t) (bool, same shape). Detached."""
    valid = support(problem)
    z = teacher_logits(problem)
    compressed_lse = _masked_logsumexp(z, valid[:, None], axis=-1)  # C: [B, H, S]
    if problem.target == "per_head":
        full = compressed_lse
    elif problem.full_lse is not None:
        full = jnp.transpose(problem.full_lse.astype(jnp.float32), (0, 2, 1))
    else:
        u = problem.noncompressed_lse if problem.noncompressed_lse is not None else noncompressed_lse(problem)
        full = jnp.logaddexp(jnp.transpose(u.astype(jnp.float32), (0, 2, 1)), compressed_lse)
    # Only rows with an empty V(t) have F = -inf, and their probabilities are masked to 0 anyway.
    full = jnp.where(jnp.isfinite(full), full, 0.0)
    probs = jnp.where(valid[:, None], jnp.exp(z - full[..., None]), 0.0)  # pi_h: [B, H, S, W]
    head_sum = jnp.sum(probs, axis=1)
    total = jnp.sum(head_sum, axis=-1, keepdims=True)
    target = head_sum / jnp.maximum(total, F32_TINY)
    return jax.lax.stop_gradient(target), valid


def kl_rows(indexer_logits, target, valid):
    """Per-row KL(P || softmax_V(I)), f32 [B, S]; rows with empty V(t) give 0.

    Logits outside V(t) never enter the arithmetic (they may be NaN or -inf). The gradient wrt indexer_logits is
    Q * sum(P) - P on V(t), i.e. Q - P on every row whose teacher mass is 1, and 0 elsewhere.
    """
    logits = jnp.where(valid, indexer_logits.astype(jnp.float32), 0.0)
    lse = _masked_logsumexp(logits, valid, axis=-1)
    nonempty = jnp.any(valid, axis=-1)
    log_q = logits - jnp.where(nonempty, lse, 0.0)[..., None]
    positive = target > 0
    log_p = jnp.log(jnp.where(positive, target, 1.0))
    terms = jnp.where(positive & valid, target * (log_p - log_q), 0.0)
    return jnp.sum(terms, axis=-1)


def reduce_rows(rows, nonempty, reduction: str, scale):
    """SPEC §4 reduction of the per-row KL [B, S] times `scale`."""
    if reduction == "none":
        out = rows
    elif reduction == "sum":
        out = jnp.sum(rows)
    elif reduction == "mean_all":
        out = jnp.sum(rows) / rows.size
    else:  # "mean": over the rows with a non-empty V(t)
        out = jnp.sum(rows) / jnp.maximum(1.0, jnp.sum(nonempty.astype(jnp.float32)))
    return out * scale


def indexer_distill_loss(indexer_logits, problem: Problem, *, reduction: str = "mean", scale=1.0):
    """The full loss (SPEC §4): scalar f32, or [B, S] f32 for reduction='none'."""
    target, valid = teacher(problem)
    rows = kl_rows(indexer_logits, target, valid)
    return reduce_rows(rows, jnp.any(valid, axis=-1), reduction, scale)
