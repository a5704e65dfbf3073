"""Sparse mode's KL over blocks instead of slots: what the visit student takes (`fused_student`).

SPEC §2 makes the sparse softmaxes run over the K slots of a row (a duplicated index is one entry per slot). With
c[t, s] the number of row t's valid slots holding block s, the slots of one block share their P and their Q, so

    KL_t = sum_k P_k log(P_k / Q_k) = sum_s P~[t, s] log(P~[t, s] / Q~[t, s]),
    P~[t, s] = c P_slot(s) = c[t, s] sum_h pi_h[t, s] / sum_s' c[t, s'] sum_h pi_h[t, s']   (rows sum to 1),
    Q~[t, s] = softmax over {s : c[t, s] > 0} of I[t, s] + log c[t, s],
    dKL_t / dI[t, s] = Q~[t, s] - P~[t, s]   (the sum of Q_k - P_k over the block's slots).

So the dense student kernels' block-order scores I [B, S, N] take the KL directly: no slot-order gather of the
scores nor scatter of their gradient, and the student costs what dense mode's does (~N/2 blocks per query), not
~4 cycles per gathered slot (`student_gather`). The teacher writes P~ in block order (`teacher_pallas(
block_order=True)`: each block's head sum weighted by its slot count); V(t) is the block bits; the KL is the
target-masked KL kernel (`kernels.kl_of_target`) over [S_p, N_p]. Real top-k selections hold no duplicates: log c
is then 0 and is added (an XLA scatter-add of the slots, exact) only when some row holds a duplicated index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from csa_pallas import loss_vjp, ops_sparse
from csa_pallas.kernels import runtime, selection
from csa_pallas.kernels import teacher as teacher_kernel
from csa_pallas.kernels import teacher_config
from csa_pallas.validation import Problem


def layout_of(problem: Problem) -> ops_sparse.SparseLayout:
    """The sparse teacher's visit-path layout (the block-order target needs its block bits), with the fields of
    the caller's config (`Problem.layout_config`); a config forcing the gather path is a ValueError."""
    cfg = problem.layout_config
    if isinstance(cfg, teacher_config.TeacherConfig):
        return ops_sparse.sparse_layout(problem, cfg)
    if ops_sparse.forced_path(cfg) not in (None, "visit"):
        raise ValueError("config: path 'gather' cannot feed the visit student (student=StudentKernelConfig with "
                         "topk_indices, or the default at short context): it reads the visit path's block-order "
                         "target; force student=StudentGatherConfig() or drop the path")
    return ops_sparse.sparse_layout(problem, {**(cfg or {}), "path": "visit"})


def selected_blocks(bits, padded_blocks: int) -> jax.Array:
    """bool [B, S_p, N_p] from the block bits int32 [B, S_p, W_p] (bit s & 31 of word s >> 5)."""
    words = bits[:, :, :-(-padded_blocks // selection.WORD_BITS)]
    shifts = jnp.arange(selection.WORD_BITS, dtype=jnp.int32)
    unpacked = (jnp.right_shift(words[..., None], shifts) & 1) != 0
    return unpacked.reshape(*bits.shape[:2], -1)[:, :, :padded_blocks]


def block_target(problem: Problem, layout: ops_sparse.SparseLayout):
    """(P~ f32 [B, S_p, N_p]: the block-order target, -1 on unselected blocks (the KL kernel's empty entries),
    NaN on the selected blocks of a row that read a non-finite input; the selection, `ops_sparse.Selection`)."""
    mode, q, kv, lse_in = ops_sparse.teacher_inputs(problem, layout)
    sel = ops_sparse.selection_inputs(problem, layout)
    out = teacher_kernel.teacher_pallas(
        q, kv, None, None, sel.firsts, sel.counts, lse_in, mode=mode, cfg=layout.cfg, scale=problem.softmax_scale,
        schedule=layout.schedule, seq_len=problem.seq_len, picks=(sel.idx, sel.vbits, sel.bits, sel.tables),
        block_order=True, interpret=runtime.interpret_mode())
    target = jnp.where(selected_blocks(sel.bits, layout.padded_blocks), out, teacher_kernel.EMPTY_SLOT)
    return lax.stop_gradient(target), sel


def has_duplicates(sel: ops_sparse.Selection) -> jax.Array:
    """bool scalar: some row holds a block in two valid slots (fewer distinct blocks than valid slots)."""
    distinct = jnp.sum(lax.population_count(sel.bits), axis=-1)
    slots = jnp.sum(lax.population_count(sel.vbits), axis=-1)
    return jnp.any(distinct < slots)


def slot_counts(sel: ops_sparse.Selection, padded_blocks: int) -> jax.Array:
    """c f32 [B, S_p, N_p]: each block's number of valid slots in the row (an XLA scatter-add of the slots)."""
    b, s_p, k_p = sel.idx.shape
    lanes = jnp.arange(k_p, dtype=jnp.int32)
    valid = (jnp.right_shift(sel.vbits[:, :, lanes // selection.WORD_BITS], lanes % selection.WORD_BITS) & 1) != 0
    target = jnp.where(valid, sel.idx, padded_blocks)  # empty slots land past the end and are dropped
    rows = jnp.arange(s_p)[None, :, None]
    batch = jnp.arange(b)[:, None, None]
    return jnp.zeros((b, s_p, padded_blocks), jnp.float32).at[batch, rows, target].add(1.0, mode="drop")


def with_slot_counts(logits, sel: ops_sparse.Selection, padded_blocks: int) -> jax.Array:
    """I + log c on [B, rows, N] (rows <= S_p) where some row holds a duplicated index, else I itself (no work:
    the scatter runs under `lax.cond`)."""
    rows, n = logits.shape[1:]

    def counted(x):
        if not selection._EXACT_COUNTS_BRANCH:  # benchmark switch (`selection`): compiled out, loudly NaN
            return x + jnp.nan
        c = slot_counts(sel, padded_blocks)[:, :rows, :n]
        return x + jnp.log(jnp.maximum(c, 1.0)).astype(x.dtype)

    return lax.cond(has_duplicates(sel), counted, lambda x: x, logits)


def kl_rows(logits, target, sel: ops_sparse.Selection, layout: ops_sparse.SparseLayout):
    """(per-row KL f32 [B, S], non-empty rows bool [B, S]) of the block-order scores I [B, S, N] against P~
    (`block_target`); differentiable wrt logits (dKL/dI = Q~ - P~ on the selected blocks, 0 elsewhere)."""
    counted = with_slot_counts(logits, sel, layout.padded_blocks)
    schedule, firsts, counts = ops_sparse.kl_schedule(logits.shape[0], layout.padded_seq, layout.padded_blocks,
                                                       layout.cfg.block_q)
    return loss_vjp.padded_kl_rows(counted, target, qmeta=None, kmeta=None, firsts=firsts, counts=counts,
                                   schedule=schedule, target_mask=True)
