"""The KL forward (and the gradient it saves) fused into a teacher kernel's last step: the loss path.

After a query tile's last head chunk the head-summed teacher [bq, W_p] is still in VMEM; the same grid step reads
the logits row tile, takes the student's LSE over V(t) and writes per-row KL statistics and, under
differentiation, G = softmax_V(I) * sum P - P (SPEC §4-5), over the blocks (dense mode) or the slots (sparse mode)
of the teacher kernel (`teacher`); the stand-alone KL kernels for P-in-HBM callers are in `kl`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from csa_pallas.kernels import common


@dataclasses.dataclass(frozen=True)
class FusedKL:
    """The KL forward fused into the teacher's last step (the loss path): instead of P the kernel writes per-row KL
    statistics and, with emit_gradient, G = softmax_V(I) * sum P - P (the backward multiplies it by the per-row
    cotangent). P never reaches HBM.

    seq_len: real query rows (later rows are padding and see nothing). chunk: lanes per epilogue step (a multiple
    of 128 dividing N_p, or N_p): bounds the epilogue's f32 temporaries to [bq, chunk] whatever N is.
    grad_scale: G is written times this (the loss's weight of every row, when it is one static number: the
    backward then only scales G by the loss's cotangent, which XLA drops when that is the constant 1).
    """

    emit_gradient: bool
    seq_len: int
    chunk: int = 2048
    grad_scale: float = 1.0


KL_STAT_ROWS = 8  # row 0 KL, row 1 lse, row 2 sum P, row 3 non-empty; the layout of `kl_of_target.kl_forward_pallas`


def kl_chunk(n_p: int, chunk: int) -> int:
    return n_p if n_p <= chunk else max(c for c in range(128, chunk + 1, 128) if n_p % c == 0)


def fused_kl_blocks(kl: FusedKL, logits, row_map, *, block_q: int):
    """BlockSpecs of a teacher kernel (dense or sparse) with the fused KL: (logits in-spec, out_specs, out_shape)
    for the logits [B, S_p, W_p], the KL statistics [B, nq, 8, bq] and, with kl.emit_gradient, G [B, S_p, W_p].
    row_map: the kernel's per-query-tile index map (returns (b, qi, 0))."""
    b, s_p, width = logits.shape
    row_block = pl.BlockSpec((None, block_q, width), row_map)
    out_specs = [pl.BlockSpec((None, None, KL_STAT_ROWS, block_q), lambda *ids: (*row_map(*ids)[:2], 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, s_p // block_q, KL_STAT_ROWS, block_q), jnp.float32)]
    if kl.emit_gradient:
        out_specs.append(row_block)
        out_shape.append(jax.ShapeDtypeStruct((b, s_p, width), logits.dtype))
    return row_block, out_specs, out_shape


def kl_epilogue(kl: FusedKL, acc_ref, logits_ref, stats_ref, grad_ref, *, visible_at, nonempty_rows=None,
                mask_target: bool = False):
    """KL(P || softmax_V(I)) of one query tile from its head sum acc [bq, W_p] (SPEC §4), W = N (dense) or K
    slots (sparse); visible_at(start, width) gives V(t) on a lane range, nonempty_rows (optional) |V(t)| > 0.

    One sweep when W_p fits one chunk (the exponentials of the student serve its LSE and G); otherwise a sweep for
    the student LSE and the teacher's row mass, then one for the KL terms and G. In dense mode entries outside
    V(t) hold an exact 0 in acc (masked scores), so only the logits need masking (mask_target=False); padding and
    empty rows get a zero row scale, which zeroes their P without a per-element select.
    """
    bq, n_p = acc_ref.shape
    width = kl_chunk(n_p, kl.chunk)
    nchunks = n_p // width
    column = lambda value: jnp.full((bq, 1), value, jnp.float32)
    row_sum = lambda x: jnp.sum(x, axis=1, keepdims=True)
    row_max = lambda x: jnp.max(x, axis=1, keepdims=True)

    def chunk_at(j):
        start = pl.multiple_of(j * width, width) if nchunks > 1 else 0
        visible = visible_at(start, width)
        logits = jnp.where(visible, logits_ref[:, pl.ds(start, width)].astype(jnp.float32), -jnp.inf)
        head_sum = acc_ref[:, pl.ds(start, width)]
        if mask_target:
            head_sum = jnp.where(visible, head_sum, 0.0)
        return start, visible, logits, head_sum

    def row_scales(top, exp_sum, total, nonempty):
        # A row whose teacher has no mass on the blocks (every head's a_h = -inf, SPEC §3) is empty; a NaN total
        # (a non-finite input) is not 0, so such a row stays non-empty and NaN.
        nonempty = nonempty & (total != 0)
        lse = jnp.where(nonempty, top + jnp.log(jnp.maximum(exp_sum, common.F32_TINY)), 0.0)
        inv_total = jnp.where(nonempty, 1.0 / jnp.maximum(total, common.F32_TINY), 0.0)
        # sum P as computed (1 up to one rounding: SPEC §9.1's Q - P is then Q * sum P - P, and a single-block row
        # gets exactly 0)
        return lse, inv_total, total * inv_total, nonempty

    def kl_terms(prob, logits, lse):
        nonzero = prob != 0  # 0 log 0 = 0; prob != 0 implies t sees the block; a NaN stays
        return row_sum(jnp.where(nonzero, prob * (jnp.log(prob) - logits + lse), 0.0))

    if nchunks == 1:
        _, visible, logits, head_sum = chunk_at(0)
        nonempty = nonempty_rows if nonempty_rows is not None else row_max(visible.astype(jnp.float32)) > 0
        top = jnp.where(nonempty, row_max(logits), 0.0)
        e = jnp.exp(logits - top)  # 0 outside V(t)
        exp_sum = row_sum(e)
        lse, inv_total, mass, nonempty = row_scales(top, exp_sum, row_sum(head_sum), nonempty)
        prob = head_sum * inv_total
        kl_rows = kl_terms(prob, logits, lse)
        if grad_ref is not None:
            # d KL / d I = softmax_V(I) * sum P - P: the exact derivative of the KL computed here (SPEC §5's Q - P
            # whenever the teacher row has mass 1); 0 outside V(t), where e and P are 0.
            q_scale = mass * kl.grad_scale / jnp.maximum(exp_sum, common.F32_TINY)
            p_part = prob if kl.grad_scale == 1.0 else head_sum * (inv_total * kl.grad_scale)
            # Exactly 0 outside V(t), also on a NaN row (whose P is NaN everywhere its scale reaches).
            grad = jnp.where(visible, e * q_scale - p_part, 0.0)
            grad_ref[...] = jnp.where(nonempty, grad, 0.0).astype(grad_ref.dtype)
    else:
        def stats_step(j, carry):
            top, exp_sum, total, count = carry
            _, visible, logits, head_sum = chunk_at(j)
            new_top = jnp.maximum(top, row_max(logits))
            exp_sum = exp_sum * jnp.exp(top - new_top) + row_sum(jnp.exp(logits - new_top))
            return new_top, exp_sum, total + row_sum(head_sum), count + row_sum(visible.astype(jnp.float32))

        top, exp_sum, total, count = lax.fori_loop(
            0, nchunks, stats_step, (column(common.STAT_FLOOR), column(0.0), column(0.0), column(0.0)))
        nonempty = nonempty_rows if nonempty_rows is not None else count > 0
        lse, inv_total, mass, nonempty = row_scales(top, exp_sum, total, nonempty)

        def kl_step(j, kl_sum):
            start, visible, logits, head_sum = chunk_at(j)
            prob = head_sum * inv_total
            if grad_ref is not None:
                grad = jnp.exp(logits - lse) * mass - prob
                if kl.grad_scale != 1.0:
                    grad = grad * kl.grad_scale
                grad = jnp.where(visible, grad, 0.0)
                grad_ref[:, pl.ds(start, width)] = jnp.where(nonempty, grad, 0.0).astype(grad_ref.dtype)
            return kl_sum + kl_terms(prob, logits, lse)

        kl_rows = lax.fori_loop(0, nchunks, kl_step, column(0.0))
    kl_rows = jnp.where(nonempty, kl_rows, 0.0)
    zeros = jnp.zeros_like(kl_rows)
    cols = jnp.concatenate([kl_rows, lse, mass, nonempty.astype(jnp.float32)] + [zeros] * (KL_STAT_ROWS - 4),
                           axis=0)
    stats_ref[...] = common.column_to_rows(cols, KL_STAT_ROWS)
