"""MaxText-style plain-XLA baseline of the dense CSA indexer distillation loss (target="per_head").

This is the comparison point for the Pallas kernels: the structure of MaxText's `calculate_indexer_loss` with
`mla_qk_head_chunk_size` (PR #4564, extended to CSA by PR #5116, semantics of PR #5033), written from scratch in plain
jnp (it does not use `csa_pallas.reference`):

  * the teacher inputs (q, compressed_kv) are `stop_gradient`ed; no `jax.checkpoint` anywhere;
  * a `lax.scan` over H / head_chunk head chunks: each step takes its heads of q (dynamic slice), forms the f32
    logits [B, c, S, N] against the compressed blocks, applies the block mask once (boolean `where` with MaxText's
    finite DEFAULT_MASK_VALUE), takes a per-head softmax over the blocks and adds the head sum to an f32 [B, S, N]
    accumulator (the scan carry);
  * L1 normalisation of the head sum along the blocks (floor float32 tiny, SPEC §3);
  * the student is `log_softmax` of the indexer logits over the visible blocks (exact, no epsilon), KL(P || Q) per
    row, mean over the non-empty rows (SPEC §4 reduction "mean").

Mask (SPEC §2, causal-complete blocks with packing): block s is valid when its m key tokens share one segment id; query
t may see it iff it is valid, has t's segment, and the position of its last token is <= positions[t]. Key side = query
side (S_kv = S).

Differentiable wrt `indexer_logits` with `jax.grad`; the gradient is (Q - P) / n on visible entries of non-empty rows
and 0 elsewhere; q and compressed_kv get zeros.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# MaxText common_types.DEFAULT_MASK_VALUE: a finite "minus infinity", applied once (boolean mask), never added twice.
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


def block_mask(segment_ids: jax.Array, positions: jax.Array, compress_ratio: int, num_blocks: int) -> jax.Array:
    """Dense visibility bool [B, S, N] for the causal-complete, same-segment block rule."""
    b = segment_ids.shape[0]
    m = compress_ratio
    seg = segment_ids[:, : num_blocks * m].reshape(b, num_blocks, m)
    pos = positions[:, : num_blocks * m].reshape(b, num_blocks, m)
    valid = jnp.min(seg, axis=-1) == jnp.max(seg, axis=-1)  # all m tokens in one document
    blk_seg = seg[..., -1]
    blk_end = pos[..., -1]  # position of the block's last token
    return (valid[:, None, :]
            & (blk_seg[:, None, :] == segment_ids[:, :, None])
            & (blk_end[:, None, :] <= positions[:, :, None]))


def _defaults(q, segment_ids, positions, softmax_scale):
    b, s, _, d = q.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((b, s), jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if softmax_scale is None:
        softmax_scale = float(d) ** -0.5
    return segment_ids.astype(jnp.int32), positions.astype(jnp.int32), float(softmax_scale)


def teacher_per_head(q: jax.Array, compressed_kv: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                     positions: Optional[jax.Array] = None, compress_ratio: int = 4,
                     softmax_scale: Optional[float] = None, head_chunk: int = 1) -> jax.Array:
    """Target P, f32 [B, S, N]: L1-normalised head sum of per-head softmaxes over the visible blocks.

    Args:
      q: [B, S, H, D] (bf16 or f32), compressed_kv: [B, N, D] with N = S // compress_ratio.
      segment_ids, positions: int [B, S] (default one document, 0..S-1).
      head_chunk: heads per scan step (must divide H); H // head_chunk scan steps.
    """
    b, s, h, d = q.shape
    n = compressed_kv.shape[1]
    if head_chunk < 1 or h % head_chunk:
        raise ValueError(f"head_chunk: expected a divisor of H={h}, got {head_chunk}")
    segment_ids, positions, tau = _defaults(q, segment_ids, positions, softmax_scale)
    q = jax.lax.stop_gradient(q)
    kv = jax.lax.stop_gradient(compressed_kv)
    visible = block_mask(segment_ids, positions, compress_ratio, n)  # [B, S, N]
    c = head_chunk

    def body(acc, i):
        qc = jax.lax.dynamic_slice_in_dim(q, i * c, c, axis=2)  # [B, S, c, D]
        logits = jnp.einsum("bshd,bnd->bhsn", qc, kv, preferred_element_type=jnp.float32) * tau
        logits = jnp.where(visible[:, None], logits, DEFAULT_MASK_VALUE)
        probs = jax.nn.softmax(logits, axis=-1)  # f32; an empty row is uniform here and zeroed below
        probs = jnp.where(visible[:, None], probs, 0.0)
        return acc + jnp.sum(probs, axis=1), None

    acc0 = jnp.zeros((b, s, n), jnp.float32)
    head_sum, _ = jax.lax.scan(body, acc0, jnp.arange(h // c))
    total = jnp.sum(head_sum, axis=-1, keepdims=True)
    return head_sum / jnp.maximum(total, F32_TINY)


def kl_mean(indexer_logits: jax.Array, target: jax.Array, visible: jax.Array) -> jax.Array:
    """mean over non-empty rows of KL(P || softmax_V(I)); exact log_softmax over the visible blocks."""
    x = jnp.where(visible, indexer_logits.astype(jnp.float32), -jnp.inf)
    nonempty = jnp.any(visible, axis=-1)
    row_max = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    row_max = jnp.where(nonempty[..., None], row_max, 0.0)
    shifted = jnp.where(visible, x - row_max, -jnp.inf)
    sum_exp = jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True)
    lse = jnp.log(jnp.where(nonempty[..., None], sum_exp, 1.0))
    log_q = jnp.where(visible, shifted - lse, 0.0)
    positive = visible & (target > 0)
    log_p = jnp.log(jnp.where(positive, target, 1.0))
    rows = jnp.sum(jnp.where(positive, target * (log_p - log_q), 0.0), axis=-1)
    return jnp.sum(rows) / jnp.maximum(1.0, jnp.sum(nonempty.astype(jnp.float32)))


def dense_loss(indexer_logits: jax.Array, q: jax.Array, compressed_kv: jax.Array, *,
               segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
               compress_ratio: int = 4, softmax_scale: Optional[float] = None, head_chunk: int = 1,
               scale: float = 1.0) -> jax.Array:
    """Scalar f32 loss = scale * mean_{non-empty t} KL(P[t] || softmax_V(t)(indexer_logits[t])); per-head target.

    indexer_logits: [B, S, N] float (the only input with a non-zero gradient).
    """
    n = compressed_kv.shape[1]
    segment_ids, positions, tau = _defaults(q, segment_ids, positions, softmax_scale)
    target = teacher_per_head(q, compressed_kv, segment_ids=segment_ids, positions=positions,
                              compress_ratio=compress_ratio, softmax_scale=tau, head_chunk=head_chunk)
    visible = block_mask(segment_ids, positions, compress_ratio, n)
    return kl_mean(indexer_logits, target, visible) * scale


def check_against_reference(indexer_logits, q, compressed_kv, *, segment_ids=None, positions=None,
                            compress_ratio: int = 4, head_chunk: int = 1) -> dict:
    """Baseline vs `csa_pallas.indexer_distill_loss(..., target="per_head", implementation="xla")`.

    Returns max abs differences of the loss, of the gradient wrt the logits (also relative to its max magnitude) and
    of the target P (vs `csa_pallas.teacher_distribution`), and the two losses.
    """
    import csa_pallas

    kw = dict(segment_ids=segment_ids, positions=positions, compress_ratio=compress_ratio)

    def ref(x):
        return csa_pallas.indexer_distill_loss(x, q, compressed_kv, target="per_head", implementation="xla", **kw)

    def base(x):
        return dense_loss(x, q, compressed_kv, head_chunk=head_chunk, **kw)

    ref_loss, ref_grad = jax.jit(jax.value_and_grad(ref))(indexer_logits)
    base_loss, base_grad = jax.jit(jax.value_and_grad(base))(indexer_logits)
    ref_p = csa_pallas.teacher_distribution(q, compressed_kv, target="per_head", implementation="xla", **kw)
    base_p = teacher_per_head(q, compressed_kv, head_chunk=head_chunk, **kw)
    grad_scale = float(jnp.max(jnp.abs(ref_grad)))
    grad_err = float(jnp.max(jnp.abs(ref_grad - base_grad)))
    return dict(loss_ref=float(ref_loss), loss_baseline=float(base_loss),
                loss_abs_err=abs(float(ref_loss) - float(base_loss)),
                grad_abs_err=grad_err, grad_rel_err=grad_err / max(grad_scale, 1e-30),
                target_abs_err=float(jnp.max(jnp.abs(ref_p - base_p))),
                grad_finite=bool(jnp.all(jnp.isfinite(base_grad))))


# --- Sparse (top-k) mode: the Primus eager approach (gather the selected blocks, chunked over queries) ---

def sparse_slot_mask(topk_indices, segment_ids, positions, compress_ratio: int, num_blocks: int):
    """bool [B, S, K]: slot k is valid iff its index is in [0, N) and that block is visible (SPEC §2)."""
    visible = block_mask(segment_ids, positions, compress_ratio, num_blocks)  # [B, S, N]
    in_range = (topk_indices >= 0) & (topk_indices < num_blocks)
    safe = jnp.where(in_range, topk_indices, 0)
    return in_range & jnp.take_along_axis(visible, safe, axis=2), safe


def sparse_teacher_per_head(q, compressed_kv, topk_indices, *, segment_ids=None, positions=None,
                            compress_ratio: int = 4, softmax_scale=None, query_chunk: int = 512):
    """Target P, f32 [B, S, K] in slot order: per-head softmax over the valid selected slots, head sum, L1.

    The selected blocks are gathered into a [B, query_chunk, K, D] tensor per scan step over query chunks (Primus
    eager chunks 512 rows), then contracted with the chunk's queries.
    """
    b, s, h, d = q.shape
    n = compressed_kv.shape[1]
    k = topk_indices.shape[2]
    segment_ids, positions, tau = _defaults(q, segment_ids, positions, softmax_scale)
    valid, safe = sparse_slot_mask(topk_indices, segment_ids, positions, compress_ratio, n)
    q = jax.lax.stop_gradient(q)
    kv = jax.lax.stop_gradient(compressed_kv)
    chunk = min(query_chunk, s)
    if s % chunk:
        raise ValueError(f"query_chunk: expected a divisor of S={s}, got {chunk}")

    def body(_, i):
        qc = jax.lax.dynamic_slice_in_dim(q, i * chunk, chunk, axis=1)  # [B, c, H, D]
        idx = jax.lax.dynamic_slice_in_dim(safe, i * chunk, chunk, axis=1)  # [B, c, K]
        ok = jax.lax.dynamic_slice_in_dim(valid, i * chunk, chunk, axis=1)
        gathered = jax.vmap(lambda kv_b, idx_b: kv_b[idx_b])(kv, idx)  # [B, c, K, D]
        logits = jnp.einsum("bshd,bskd->bhsk", qc, gathered, preferred_element_type=jnp.float32) * tau
        logits = jnp.where(ok[:, None], logits, DEFAULT_MASK_VALUE)
        probs = jnp.where(ok[:, None], jax.nn.softmax(logits, axis=-1), 0.0)
        head_sum = jnp.sum(probs, axis=1)  # [B, c, K]
        total = jnp.sum(head_sum, axis=-1, keepdims=True)
        return None, head_sum / jnp.maximum(total, F32_TINY)

    _, chunks = jax.lax.scan(body, None, jnp.arange(s // chunk))  # [S/c, B, c, K]
    return jnp.transpose(chunks, (1, 0, 2, 3)).reshape(b, s, k)


def sparse_loss(indexer_logits, q, compressed_kv, topk_indices, *, segment_ids=None, positions=None,
                compress_ratio: int = 4, softmax_scale=None, query_chunk: int = 512, scale: float = 1.0):
    """Scalar f32 sparse loss (per-head target over the K slots, mean over non-empty rows)."""
    n = compressed_kv.shape[1]
    seg, pos, _ = _defaults(q, segment_ids, positions, softmax_scale)
    target = sparse_teacher_per_head(q, compressed_kv, topk_indices, segment_ids=segment_ids, positions=positions,
                                     compress_ratio=compress_ratio, softmax_scale=softmax_scale,
                                     query_chunk=query_chunk)
    valid, _ = sparse_slot_mask(topk_indices, seg, pos, compress_ratio, n)
    return kl_mean(indexer_logits, target, valid) * scale
