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


import jax.numpy as jnp

from csa_pallas.kernels import common

LOG2E = common.LOG2E
MODES = ("per_head", "joint", "full_lse")  # the teachers' denominators (SPEC §3), `head_log2_mass`


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
    softplus_tail = jnp.log2(1.0 + jnp.exp2(-jnp.abs(d)))  # softplus(d) - max(d, 0), one exp2 and one log2
    b = jnp.where(d > 0, c2 - lse2, shift2) - softplus_tail
    return jnp.where(empty, -jnp.inf, b)


def per_head_shift(c2):
    """per_head's G = C (a_h = 0 and M = 0 on every row that sees a block): +inf on heads without compressed mass."""
    return jnp.where(c2 == -jnp.inf, jnp.inf, c2)


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


def finish(mode: str, layout, c2, *, lse_block=None, shift_row=None, seen_rows=None, running=None):
    """The pass-2 exponent shift G of one head chunk (base 2), shared by every teacher kernel.

    layout: the chunk's `common.RowLayout`. c2: C per (query, head) row, f32 [*view, 1] (`compressed_log2_mass`).
    lse_block: (u or F) - sigma, f32 [*view] (joint / full_lse); shift_row: sigma, f32 [1, bq]. seen_rows: bool
    [bq, 1], the queries that see a block (per_head's M). running: (previous M f32 [bq, 128], rescale(factor)) when
    several head chunks share the running M (`running_max`), else None.

    Returns (G f32 [*view, 1], M f32 [bq, 128] or None). per_head: a_h = 0, so M = 0 on every row that sees a block
    and G = C (+inf on empty heads): no head weights at all. joint / full_lse: the head weights, M and G are
    computed on the stats block's own lane-dense layout [*view] (a few vregs), not on [rows, 1] columns (one vreg
    per 8 rows and op); C goes there and G comes back by one identity-mask conversion each.
    """
    bq = layout.block_q
    if mode == "per_head":
        g = per_head_shift(c2)
        top = None
        if running is not None:  # M is 0 or -inf per row, the same in every chunk: nothing is rescaled
            top = jnp.broadcast_to(jnp.where(seen_rows, 0.0, -jnp.inf), (bq, common.LANES))
        return g, top
    c2 = layout.column_to_block(c2)  # [*view]
    shift = shift_row * LOG2E  # [1, bq]
    shift2 = common.rows_to_column(shift) if layout.token_major else shift  # per query, in the view
    b = head_log2_mass(mode, c2, lse_block * LOG2E, shift2)
    top_view = jnp.max(b, axis=layout.head_axis, keepdims=True)  # [bq, 1] or [1, bq]
    top = None
    if running is not None:
        previous, rescale = running
        column = top_view if layout.token_major else common.rows_to_column(top_view)  # [bq, 1]
        top, factor = running_max(previous, jnp.broadcast_to(column, (bq, common.LANES)))
        rescale(factor)
        top_view = top[:, :1] if layout.token_major else common.column_to_rows(top[:, :1], 1)
    return layout.block_to_column(exponent_shift(c2, b, top_view)), top
