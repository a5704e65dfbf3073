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
    """V(t) membership: bool [B, S, N] (dense) or [B, S, K] (sparse, per slot); rows with loss_mask False are
    empty."""
    block_segment, block_end = block_keys(problem)
    if problem.sparse:
        valid = masks.slot_visible(problem.topk_indices, problem.segment_ids, problem.positions, block_segment,
                                   block_end)
    else:
        valid = masks.block_visible(problem.segment_ids, problem.positions, block_segment, block_end)
    if problem.loss_mask is not None:
        valid = valid & problem.loss_mask[:, :, None]
    return valid


def _window_logits(problem: Problem):
    q = problem.q.astype(jnp.float32)
    kv = problem.window_kv.astype(jnp.float32)
    logits = problem.softmax_scale * jnp.einsum("bshd,bjd->bhsj", q, kv)  # [B, H, S, S_kv]
    window = masks.window_visible(problem.segment_ids, problem.positions, problem.kv_segment_ids,
                                  problem.kv_positions, problem.window_size)
    return logits, window


def noncompressed_lse(problem: Problem) -> jax.Array:
    """u[b, t, h] = logaddexp(logsumexp_{j in Win(t)} tau q[t,h].window_kv[j], sinks[h]); f32 [B, S, H].
    A sink of +inf gives u = +inf, one of -inf drops the sink term."""
    logits, window = _window_logits(problem)
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


def nonfinite_rows(problem: Problem, valid) -> jax.Array:
    """bool [B, S]: the rows that read a non-finite value (SPEC §3): q[t], compressed_kv of a slot in V(t), a
    window key of Win(t) (joint target with window_kv), a NaN sink, or a NaN in the row's given LSE."""
    bad = jnp.any(~jnp.isfinite(problem.q), axis=(2, 3))
    bad = bad | reads_bad_block(problem, valid, non_finite_blocks(problem.compressed_kv))
    if problem.target == "joint":
        if problem.window_kv is not None:
            _, window = _window_logits(problem)
            key_bad = jnp.any(~jnp.isfinite(problem.window_kv), axis=-1)  # [B, S_kv]
            bad = bad | jnp.any(window & key_bad[:, None, :], axis=-1)
            if problem.sinks is not None:
                bad = bad | jnp.any(jnp.isnan(problem.sinks))
        for given in (problem.noncompressed_lse, problem.full_lse):
            if given is not None:
                bad = bad | jnp.any(jnp.isnan(given), axis=-1)
    return bad


def non_finite_blocks(compressed_kv) -> jax.Array:
    """bool [B, N]: the blocks of compressed_kv [B, N, D] holding a NaN or +-inf."""
    return jnp.any(~jnp.isfinite(compressed_kv), axis=-1)


def reads_bad_block(problem: Problem, valid, bad_block) -> jax.Array:
    """bool [B, S]: the rows with a block flagged in bad_block (bool [B, N]) in V(t) (valid: `support`)."""
    if problem.sparse:
        safe, _ = masks.slot_blocks(problem.topk_indices, max(problem.num_blocks, 1))
        slot_bad = jnp.take_along_axis(bad_block[:, None, :], safe, axis=2) if problem.num_blocks else \
            jnp.zeros(valid.shape, bool)
        return jnp.any(valid & slot_bad, axis=-1)
    return jnp.any(valid & bad_block[:, None, :], axis=-1)


def row_shift(x):
    """sigma: f32 [B, 1, S], the smallest finite-or-not of x [B, H, S] over heads, 0 when that is not finite. A
    per-row constant subtracted from u (or F) before it meets C, so the head weights exp(a_h - M) are computed from
    O(spread) numbers, not from u - C at its full magnitude (200 nats in f32 would cost 1.5e-5)."""
    low = jnp.min(x, axis=1, keepdims=True)
    return jnp.where(jnp.isfinite(low), low, 0.0)


def head_log_mass(problem: Problem, compressed_lse) -> jax.Array:
    """b_h = a_h + sigma, f32 [B, H, S]: head h's log share of its layer softmax on the blocks, a_h = C_h - F_h
    (0 for per_head), up to a per-row constant sigma (`row_shift`), which cancels in exp(b_h - max_h b_h).
    -inf where the head has no compressed mass (an empty row, or F = +inf, e.g. a +inf sink).

    Joint: a_h = -softplus(d_h), d_h = u_h - C_h; with u' = u - sigma,
      d > 0:  b = (C - u') - log1p(exp(-d))      (no number of the size of u - C is formed)
      d <= 0: b = sigma - log1p(exp(d))          (then sigma <= C - u' is of the size of C)
    full_lse: b = C - (F - sigma)."""
    empty = compressed_lse == -jnp.inf
    if problem.target == "per_head":
        return jnp.where(empty, -jnp.inf, 0.0)
    if problem.full_lse is not None:
        full = jnp.transpose(problem.full_lse.astype(jnp.float32), (0, 2, 1))
        return jnp.where(empty, -jnp.inf, compressed_lse - (full - row_shift(full)))
    u = problem.noncompressed_lse if problem.noncompressed_lse is not None else noncompressed_lse(problem)
    u = jnp.transpose(u.astype(jnp.float32), (0, 2, 1))
    sigma = row_shift(u)
    shifted = u - sigma
    d = (shifted - compressed_lse) + sigma
    b = jnp.where(d > 0, compressed_lse - shifted, sigma) - jnp.log1p(jnp.exp(-jnp.abs(d)))
    return jnp.where(empty, -jnp.inf, b)


def teacher(problem: Problem):
    """The target P (SPEC §3), f32 [B, S, N|K], and its support V(t) (bool, same shape; rows that are empty,
    including those whose every head has a_h = -inf, have no support). Detached.

    Rebased exact conditional: with a_h = C_h - F_h and M = max_h a_h,
    P = sum_h exp(z - C_h) exp(a_h - M), normalised over the row: every exponent is O(1), whatever u - C
    (a_h - M is computed as b_h - max_h b_h, see `head_log_mass`)."""
    valid = support(problem)
    z = teacher_logits(problem)
    compressed_lse = _masked_logsumexp(z, valid[:, None], axis=-1)  # C: [B, H, S]
    a = head_log_mass(problem, compressed_lse)
    top = jnp.max(a, axis=1, keepdims=True)  # M: [B, 1, S]
    weight = jnp.where(a == -jnp.inf, 0.0, jnp.exp(a - jnp.where(top == -jnp.inf, 0.0, top)))  # [B, H, S]
    per_head = jnp.where(valid[:, None] & (compressed_lse[..., None] != -jnp.inf),
                         jnp.exp(z - compressed_lse[..., None]), 0.0)  # exp(z - C_h): [B, H, S, W]
    head_sum = jnp.sum(per_head * weight[..., None], axis=1)
    total = jnp.sum(head_sum, axis=-1, keepdims=True)
    target = head_sum / jnp.where(total > 0, total, 1.0)
    # Every head's mass outside the blocks (M = -inf): an empty row. (A NaN M is not -inf: that row stays, NaN.)
    valid = valid & (top[:, 0, :, None] != -jnp.inf)
    target = jnp.where(valid, target, 0.0)
    # A row that read a non-finite input is NaN on its support (0 stays 0 elsewhere, like every other row).
    target = jnp.where(valid & nonfinite_rows(problem, valid)[..., None], jnp.nan, target)
    return jax.lax.stop_gradient(target), valid


def kl_rows(indexer_logits, target, valid):
    """Per-row KL(P || softmax_V(I)), f32 [B, S]; rows with empty V(t) give 0.

    Logits outside V(t) never enter the arithmetic (they may be NaN or -inf). The gradient wrt indexer_logits is
    Q * sum(P) - P on V(t) (Q - P: every non-empty row of the exact target sums to 1), and 0 elsewhere. A NaN in P
    or at a visible logit makes the row NaN.
    """
    logits = jnp.where(valid, indexer_logits.astype(jnp.float32), 0.0)
    lse = _masked_logsumexp(logits, valid, axis=-1)
    nonempty = jnp.any(valid, axis=-1)
    log_q = logits - jnp.where(nonempty, lse, 0.0)[..., None]
    nonzero = target != 0  # 0 log 0 = 0; a NaN is not 0
    log_p = jnp.log(jnp.where(nonzero, target, 1.0))
    terms = jnp.where(nonzero & valid, target * (log_p - log_q), 0.0)
    return jnp.sum(terms, axis=-1)


def reduce_rows(rows, nonempty, reduction: str, scale):
    """SPEC §4 reduction of the per-row KL [B, S] times `scale`."""
    if reduction == "none":
        return rows * scale
    return reduce_total(jnp.sum(rows), nonempty, reduction, scale)


def reduce_total(total, nonempty, reduction: str, scale):
    """A scalar reduction (SPEC §4) from sum_t KL_t and the non-empty rows bool [B, S], times `scale`."""
    if reduction == "sum":
        out = total
    elif reduction == "mean_all":
        out = total / nonempty.size
    else:  # "mean": over the rows with a non-empty V(t)
        out = total / jnp.maximum(1.0, jnp.sum(nonempty.astype(jnp.float32)))
    return out * scale


def indexer_distill_loss(indexer_logits, problem: Problem, *, reduction: str = "mean", scale=1.0):
    """The full loss (SPEC §4): scalar f32, or [B, S] f32 for reduction='none'."""
    target, valid = teacher(problem)
    rows = kl_rows(indexer_logits, target, valid)
    return reduce_rows(rows, jnp.any(valid, axis=-1), reduction, scale)
