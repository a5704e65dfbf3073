"""The rebased finish of a teacher's pass 1 (SPEC §3), in-kernel and in base 2, shared by every teacher kernel.

After pass 1 a head chunk has, per (query, head), its compressed log-mass C (log2-sum-exp2 of the scores). The
target is the exact conditional

    P[t, s] = sum_h 2^(z - C_h + a_h - M) / sum_h 2^(a_h - M),   a_h = C_h - F_h,  M = max_h a_h

(`reference.teacher` in nats), so pass 2 needs one exponent shift per (query, head): G_h = C_h - a_h + M, and
exp2(z - G_h) is then O(1) for the heads that matter whatever u - C is. a_h is carried as b_h = a_h + sigma
(`reference.head_log_mass`), sigma a per-row shift applied to u or F outside the kernel, so no number of the size
of u - C is ever formed; M is the running max of b over the head chunks seen so far (`running_max`): a later chunk
with a larger max rescales what earlier chunks accumulated.

Non-finite inputs (SPEC §3): NaN and +inf scores propagate by themselves (max and exp2 of a NaN are NaN). A row that
sees blocks but whose head has C = -inf read a -inf score (q non-finite; compressed_kv is NaN-filled upstream), and
is poisoned to NaN here (`compressed_log2_mass`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

LOG2E = math.log2(math.e)


def compressed_log2_mass(m, l, seen):
    """C (base 2) of each (query, head) row from per-lane running (max, sum) [..., lanes]: [..., 1]; -inf where the
    row saw nothing, NaN where it saw blocks (seen, broadcastable bool) but no finite score."""
    row_max = jnp.max(m, axis=-1, keepdims=True)
    total = jnp.sum(l * jnp.exp2(m - row_max), axis=-1, keepdims=True)
    c2 = jnp.where(total == 0, -jnp.inf, row_max + jnp.log2(jnp.where(total == 0, 1.0, total)))
    return jnp.where(seen & (c2 == -jnp.inf), jnp.nan, c2)


def head_log2_mass(mode: str, c2, lse2=None, shift2=None):
    """b_h = (C_h - F_h) * log2(e) + sigma (base 2), the shape of c2; -inf where the head has no compressed mass.

    mode: "per_head" (b = 0), "joint" (lse2 = (u - sigma) log2 e, shift2 = sigma log2 e), "full_lse"
    (lse2 = (F - sigma) log2 e)."""
    empty = c2 == -jnp.inf
    if mode == "per_head":
        return jnp.where(empty, -jnp.inf, 0.0)
    if mode == "full_lse":
        return jnp.where(empty, -jnp.inf, c2 - lse2)
    d = (lse2 - c2) + shift2  # (u - C) log2 e
    b = jnp.where(d > 0, (c2 - lse2) - jnp.log2(1.0 + jnp.exp2(-d)), shift2 - jnp.log2(1.0 + jnp.exp2(d)))
    return jnp.where(empty, -jnp.inf, b)


def running_max(previous, chunk_max):
    """(new M, factor for what is already accumulated) when a head chunk's max b joins the running max. -inf means
    nothing seen yet; a NaN propagates."""
    new = jnp.maximum(previous, chunk_max)
    factor = jnp.where(new == -jnp.inf, 1.0, jnp.exp2(previous - new))
    return new, factor


def exponent_shift(c2, b, top):
    """G_h = C_h - b_h + M (base 2): pass 2 adds exp2(z - G_h). +inf (no contribution) for a head without
    compressed mass or a row whose every head has none (M = -inf: an empty row)."""
    dead = (b == -jnp.inf) | (top == -jnp.inf)
    return jnp.where(dead, jnp.inf, c2 - b + top)
