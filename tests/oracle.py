"""Independent float64 NumPy oracle of csa_pallas SPEC.md (the math contract).

Written directly from the definitions in SPEC.md with plain Python loops over (b, t, s, h); it imports no
project code and no jax. Every array input may be any float dtype (incl. ml_dtypes bfloat16 / float16 / jax
arrays): it is upcast exactly with np.asarray(x, dtype=np.float64). Integer ids are read as int64; top-k indices
of any integer dtype are read as exact Python ints.

Notation: B batch, S query length, S_kv key length, H heads, D head dim, m = compress_ratio, N compressed blocks
(N = compressed_kv.shape[1]), K top-k width, W window size, tau softmax scale (default D**-0.5).

Conventions fixed here (see SPEC §2-§5):
* Dense mode (topk_indices=None): the softmax slots of row t are the visible blocks s; outputs are [B, S, N].
  Sparse mode: the slots are k = 0..K-1, slot k valid iff 0 <= topk_indices[b,t,k] < N and that block is visible;
  outputs are [B, S, K].
* DUPLICATED top-k indices: the computation is purely per slot. A valid block that appears in two slots appears
  twice in C's logsumexp, twice in the student's softmax and gets a separate P entry in each slot.
* Empty rows (loss_mask False, V(t) = {}, or every head's a_h = -inf): P row = 0, KL row = 0, gradient 0; they
  are not counted by "mean"; nothing they would read matters.
* The teacher is the exact conditional of SPEC §3 (rebased: no underflow at any u - C; no floor).
* Non-finite inputs (SPEC §3): a non-empty row reading a NaN or +-inf in q[t], compressed_kv[V(t)] or
  window_kv[Win(t)], a NaN sink or a NaN in its given LSE row is NaN (P, KL and gradient). +-inf sinks and
  +-inf given LSEs are limits, computed by the formula.
* A static scale == 0 gives an exact 0 loss and gradient whatever the inputs (SPEC §4).
* window_size=None is treated as "no upper bound" (full causal same-document window); any integer W follows SPEC
  literally, 0 <= positions[t] - kv_positions[j] < W (so W <= 0 gives an empty window).
* target="joint" without window_kv (and without noncompressed_lse / full_lse): the window term is dropped
  (LSE of the empty set = -inf), like the sink term when sinks is None.
"""

import math

import numpy as np

__all__ = [
    "visible_blocks", "window_set", "noncompressed_lse", "teacher", "support", "kl_rows", "loss",
    "loss_grad", "finite_difference_grad",
]

_NEG_INF = -math.inf
_REDUCTIONS = ("mean", "mean_all", "sum", "none")


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def _i64(x):
    return None if x is None else np.asarray(x).astype(np.int64)


def _lse(v):
    """logsumexp of a 1-D float64 array with max subtraction; the LSE of the empty set is -inf."""
    v = np.asarray(v, dtype=np.float64)
    if v.size == 0:
        return _NEG_INF
    mx = float(np.max(v))
    if math.isinf(mx):  # all -inf -> -inf; any +inf -> +inf
        return mx
    return mx + math.log(float(np.sum(np.exp(v - mx))))


def _resolve_ids(B, S, S_kv, segment_ids, positions, kv_segment_ids, kv_positions):
    """Defaults of SPEC §1. Returns int64 seg [B,S], pos [B,S], kv_seg [B,S_kv], kv_pos [B,S_kv]."""
    seg = np.zeros((B, S), np.int64) if segment_ids is None else _i64(segment_ids)
    pos = np.tile(np.arange(S, dtype=np.int64), (B, 1)) if positions is None else _i64(positions)
    kv_seg = seg if kv_segment_ids is None else _i64(kv_segment_ids)
    kv_pos = pos if kv_positions is None else _i64(kv_positions)
    if seg.shape != (B, S) or pos.shape != (B, S):
        raise ValueError(f"segment_ids/positions must be [B,S]={(B, S)}, got {seg.shape}, {pos.shape}")
    if S_kv is not None and (kv_seg.shape != (B, S_kv) or kv_pos.shape != (B, S_kv)):
        raise ValueError(f"kv ids must be [B,S_kv]={(B, S_kv)}, got {kv_seg.shape}, {kv_pos.shape} "
                         "(pass kv_segment_ids/kv_positions when S_kv != S)")
    return seg, pos, kv_seg, kv_pos


def visible_blocks(segment_ids, positions, kv_segment_ids=None, kv_positions=None, compress_ratio=4, *,
                   num_blocks=None):
    """SPEC §2 dense visibility. Returns bool [B, S, N], N = num_blocks or S_kv // compress_ratio.

    Block s is valid iff all kv tokens [s*m, (s+1)*m) exist and share one kv_segment_id; query t sees it iff it is
    valid, segment(s) == segment_ids[t] and e(s) = kv_positions[s*m+m-1] <= positions[t].
    """
    ref = segment_ids if segment_ids is not None else positions
    B, S = np.shape(ref)
    seg, pos, kv_seg, kv_pos = _resolve_ids(B, S, None, segment_ids, positions, kv_segment_ids, kv_positions)
    m = int(compress_ratio)
    S_kv = kv_seg.shape[1]
    N = S_kv // m if num_blocks is None else int(num_blocks)
    out = np.zeros((B, S, N), dtype=bool)
    for b in range(B):
        for s in range(N):
            lo, hi = s * m, (s + 1) * m
            if hi > S_kv or any(kv_seg[b, j] != kv_seg[b, lo] for j in range(lo, hi)):
                continue  # incomplete or document-straddling block: invalid for everyone
            seg_s, e_s = kv_seg[b, lo], kv_pos[b, hi - 1]
            for t in range(S):
                out[b, t, s] = (seg[b, t] == seg_s) and (e_s <= pos[b, t])
    return out


def window_set(segment_ids, positions, kv_segment_ids=None, kv_positions=None, window_size=128):
    """SPEC §2 Win(t): bool [B, S, S_kv]; j in Win(t) iff same segment and 0 <= pos[t] - kv_pos[j] < W."""
    ref = segment_ids if segment_ids is not None else positions
    B, S = np.shape(ref)
    seg, pos, kv_seg, kv_pos = _resolve_ids(B, S, None, segment_ids, positions, kv_segment_ids, kv_positions)
    S_kv = kv_seg.shape[1]
    out = np.zeros((B, S, S_kv), dtype=bool)
    for b in range(B):
        for t in range(S):
            for j in range(S_kv):
                d = pos[b, t] - kv_pos[b, j]
                out[b, t, j] = (kv_seg[b, j] == seg[b, t]) and d >= 0 and (window_size is None or d < window_size)
    return out


def noncompressed_lse(q, window_kv, *, sinks=None, segment_ids=None, positions=None, kv_segment_ids=None,
                      kv_positions=None, window_size=128, softmax_scale=None):
    """SPEC §3 u[t,h] = logaddexp(LSE_{j in Win(t)} tau*q[t,h].window_kv[j], sinks[h]); float64 [B, S, H].

    q [B,S,H,D], window_kv [B,S_kv,D] (None: window term dropped), sinks [H] (None: sink term dropped).
    An empty window without sink gives -inf.
    """
    q = _f64(q)
    B, S, H, D = q.shape
    tau = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    u = np.full((B, S, H), _NEG_INF)
    if window_kv is not None:
        kv = _f64(window_kv)
        seg, pos, kv_seg, kv_pos = _resolve_ids(B, S, kv.shape[1], segment_ids, positions, kv_segment_ids,
                                                kv_positions)
        win = window_set(seg, pos, kv_seg, kv_pos, window_size)
        for b in range(B):
            for t in range(S):
                js = np.nonzero(win[b, t])[0]
                for h in range(H):
                    u[b, t, h] = _lse([tau * float(np.dot(q[b, t, h], kv[b, j])) for j in js])
    if sinks is not None:
        sk = _f64(sinks)
        for b in range(B):
            for t in range(S):
                for h in range(H):
                    u[b, t, h] = np.logaddexp(u[b, t, h], sk[h])
    return u


_noncompressed_lse = noncompressed_lse  # the keyword below shadows the function name


def _finite(x) -> bool:
    return bool(np.all(np.isfinite(x)))


def _rows(q, compressed_kv, *, topk_indices=None, window_kv=None, sinks=None, noncompressed_lse=None,
          full_lse=None, segment_ids=None, positions=None, kv_segment_ids=None, kv_positions=None, loss_mask=None,
          compress_ratio=4, window_size=128, softmax_scale=None, target="joint", need_p=True):
    """Shared teacher core. Returns (out_shape, rows) with rows[(b,t)] = (slot positions int array, P values)
    for the non-empty rows only (P is None when need_p=False).

    SPEC §2-§3 literally: a row is empty when loss_mask is False, V(t) is empty, or every head has a_h = -inf; a
    non-empty row that reads a NaN or +-inf among q[t], compressed_kv[V(t)], window_kv[Win(t)] (joint with window
    keys), a NaN sink, or a NaN in its noncompressed_lse / full_lse row gets P = NaN on its slots.
    P[t,s] = sum_h exp(z - C_h + a_h - M) / sum_h exp(a_h - M) with a_h = C_h - F_h, M = max_h a_h (the exact
    conditional: every non-empty row sums to 1)."""
    if target not in ("joint", "per_head"):
        raise ValueError(f"target must be 'joint' or 'per_head', got {target!r}")
    if target == "per_head" and (full_lse is not None or noncompressed_lse is not None):
        raise ValueError("full_lse / noncompressed_lse with target='per_head' is a contradiction")
    q, c = _f64(q), _f64(compressed_kv)
    B, S, H, D = q.shape
    N = c.shape[1]
    tau = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    if window_kv is not None:
        S_kv = np.shape(window_kv)[1]
    elif kv_segment_ids is not None:
        S_kv = np.shape(kv_segment_ids)[1]
    elif kv_positions is not None:
        S_kv = np.shape(kv_positions)[1]
    else:
        S_kv = S
    seg, pos, kv_seg, kv_pos = _resolve_ids(B, S, S_kv, segment_ids, positions, kv_segment_ids, kv_positions)
    vis = visible_blocks(seg, pos, kv_seg, kv_pos, compress_ratio, num_blocks=N)
    mask = np.ones((B, S), bool) if loss_mask is None else np.asarray(loss_mask, bool)
    # Any integer dtype; a value outside [0, N) (also beyond the int32 range) is an empty slot. Python ints: exact.
    topk = None if topk_indices is None else np.asarray(topk_indices).astype(object)
    out_shape = (B, S, N) if topk is None else (B, S, topk.shape[2])

    F_given = u = None
    window_keys = None
    if need_p and target == "joint":
        if full_lse is not None:
            F_given = _f64(full_lse)
        elif noncompressed_lse is not None:
            u = _f64(noncompressed_lse)
        else:
            u = _noncompressed_lse(q, window_kv, sinks=sinks, segment_ids=seg, positions=pos,
                                   kv_segment_ids=kv_seg, kv_positions=kv_pos, window_size=window_size,
                                   softmax_scale=tau)
            if window_kv is not None:
                window_keys = (_f64(window_kv), window_set(seg, pos, kv_seg, kv_pos, window_size))
    sink_nan = sinks is not None and target == "joint" and np.any(np.isnan(_f64(sinks)))
    rows = {}
    for b in range(B):
        for t in range(S):
            if not mask[b, t]:
                continue  # loss_mask: the row takes no part in the loss
            if topk is None:  # dense: slot = block
                slots = [s for s in range(N) if vis[b, t, s]]
                blocks = slots
            else:  # sparse: slot k -> block topk[b,t,k]; invalid slots are never read
                slots = [k for k in range(topk.shape[2])
                         if 0 <= int(topk[b, t, k]) < N and vis[b, t, int(topk[b, t, k])]]
                blocks = [int(topk[b, t, k]) for k in slots]
            if not slots:
                continue  # empty row
            if not need_p:
                rows[(b, t)] = (np.asarray(slots, np.int64), None)
                continue
            reads = [q[b, t], c[b, blocks]]
            if window_keys is not None:
                reads.append(window_keys[0][b, window_keys[1][b, t]])
            if F_given is not None:
                reads_nan = np.any(np.isnan(F_given[b, t]))
            elif u is not None and window_keys is None:
                reads_nan = np.any(np.isnan(u[b, t]))
            else:
                reads_nan = False
            if not all(_finite(x) for x in reads) or reads_nan or sink_nan:
                rows[(b, t)] = (np.asarray(slots, np.int64), np.full(len(slots), np.nan))
                continue
            z = np.array([[tau * float(np.dot(q[b, t, h], c[b, s])) for s in blocks] for h in range(H)])
            C = np.array([_lse(z[h]) for h in range(H)])  # per slot: a duplicated block counts twice
            if target == "per_head":
                a = np.zeros(H)
            elif F_given is not None:
                a = C - F_given[b, t]
            else:
                a = C - np.logaddexp(u[b, t], C)  # u = +inf (a +inf sink): a = -inf, the head's mass is elsewhere
            M = float(np.max(a))
            if M == _NEG_INF:
                continue  # every head's mass is outside the blocks: an empty row
            weights = np.exp(a - M)  # NaN when a given F is below C by an infinite amount (F = -inf): loud
            mass = np.zeros(len(slots))
            for h in range(H):
                mass += np.exp(z[h] - C[h] + a[h] - M)
            rows[(b, t)] = (np.asarray(slots, np.int64), mass / np.sum(weights))
    return out_shape, rows


def teacher(q, compressed_kv, **kw):
    """SPEC §3 target P: float64 [B, S, N] (dense) or [B, S, K] (sparse); 0 outside V(t) and on empty rows.

    q [B,S,H,D], compressed_kv [B,N,D]; keyword args: topk_indices [B,S,K], window_kv [B,S_kv,D], sinks [H],
    noncompressed_lse [B,S,H], full_lse [B,S,H], segment_ids/positions [B,S], kv_segment_ids/kv_positions
    [B,S_kv], compress_ratio, window_size, softmax_scale, target in {"joint", "per_head"}.
    """
    shape, rows = _rows(q, compressed_kv, **kw)
    P = np.zeros(shape)
    for (b, t), (slots, p) in rows.items():
        P[b, t, slots] = p
    return P


def support(q, compressed_kv, **kw):
    """V(t) membership: bool [B, S, N] (dense, per block) or [B, S, K] (sparse, per slot)."""
    shape, rows = _rows(q, compressed_kv, need_p=False, **kw)
    V = np.zeros(shape, dtype=bool)
    for (b, t), (slots, _) in rows.items():
        V[b, t, slots] = True
    return V


def _student(indexer_logits, shape, rows):
    """Per non-empty row: (slots, P, log Q over V(t)). Logits outside V(t) are never read."""
    I = _f64(indexer_logits)
    if I.shape != shape:
        raise ValueError(f"indexer_logits must have shape {shape}, got {I.shape}")
    out = {}
    for (b, t), (slots, p) in rows.items():
        x = I[b, t, slots]
        out[(b, t)] = (slots, p, x - _lse(x))  # exact log-softmax over V(t)
    return out


def kl_rows(indexer_logits, q, compressed_kv, **kw):
    """SPEC §4 per-row KL L[t] = sum_{V(t)} P (log P - log Q), 0*log0 = 0; float64 [B, S] (0 on empty rows)."""
    return _kl(indexer_logits, q, compressed_kv, **kw)[0]


def _kl(indexer_logits, q, compressed_kv, **kw):
    """Returns (L [B,S], number of non-empty rows)."""
    shape, rows = _rows(q, compressed_kv, **kw)
    L = np.zeros(shape[:2])
    for (b, t), (_, p, logq) in _student(indexer_logits, shape, rows).items():
        nz = p != 0  # 0 * log 0 = 0 (a NaN P is not 0: it stays)
        L[b, t] = float(np.sum(p[nz] * (np.log(p[nz]) - logq[nz])))
    return L, len(rows)


def _divisor(reduction, L, n_nonempty):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return {"mean": max(1, n_nonempty), "mean_all": L.size, "sum": 1, "none": 1}[reduction]


def loss(indexer_logits, q, compressed_kv, *, reduction="mean", scale=1.0, **kw):
    """SPEC §4 reduced loss times scale: float64 scalar, or [B, S] for reduction="none"."""
    L, n_nonempty = _kl(indexer_logits, q, compressed_kv, **kw)
    n = _divisor(reduction, L, n_nonempty)
    if scale == 0:  # SPEC §4: a static scale of 0 switches the loss off exactly
        return np.zeros(L.shape) if reduction == "none" else 0.0
    if reduction == "none":
        return scale * L
    return float(scale * L.sum() / n)


def loss_grad(indexer_logits, q, compressed_kv, *, reduction="mean", scale=1.0, cotangent=1.0, **kw):
    """SPEC §5 analytic gradient wrt indexer_logits (same shape): scale*g*(Q - P)/n on V(t) of non-empty rows,
    exactly 0 elsewhere. For reduction="none" the cotangent is a [B,S] array g[t] and n = 1. With the exact
    conditional every non-empty P row sums to 1, so this is the derivative of the loss (SPEC §9.1)."""
    shape, rows = _rows(q, compressed_kv, **kw)
    n = _divisor(reduction, np.zeros(shape[:2]), len(rows))
    if scale == 0:
        return np.zeros(shape)
    g = np.broadcast_to(_f64(cotangent), shape[:2]) if reduction == "none" else np.full(shape[:2], float(cotangent))
    G = np.zeros(shape)
    for (b, t), (slots, p, logq) in _student(indexer_logits, shape, rows).items():
        G[b, t, slots] = scale * g[b, t] * (np.exp(logq) - p) / n
    return G


def finite_difference_grad(f, x, eps=1e-6, mask=None):
    """Central differences of scalar f at x in float64 over every element (only where mask is True, 0 elsewhere)."""
    x = np.array(x, dtype=np.float64)
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        if mask is not None and not mask[i]:
            continue
        orig = x[i]
        x[i] = orig + eps
        fp = float(f(x))
        x[i] = orig - eps
        fm = float(f(x))
        x[i] = orig
        grad[i] = (fp - fm) / (2 * eps)
    return grad


# --- SPEC §8: the fused student -----------------------------------------------------------------------------------

def indexer_scores(index_q, index_k, index_weights, topk_indices=None):
    """SPEC §8 I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s]), float64: [B, S, N], or [B, S, K] with slot k
    scoring block topk_indices[t, k] (0 for an index outside [0, N): such a slot is empty and never read)."""
    q, k, w = _f64(index_q), _f64(index_k), _f64(index_weights)
    B, S, H_I, _ = q.shape
    N = k.shape[1]
    if topk_indices is None:
        blocks = np.broadcast_to(np.arange(N), (B, S, N))
    else:
        blocks = _i64(topk_indices)
    I = np.zeros(blocks.shape)
    for b in range(B):
        for t in range(S):
            for slot, s in enumerate(blocks[b, t]):
                if 0 <= s < N:
                    I[b, t, slot] = sum(w[b, t, j] * max(0.0, float(q[b, t, j] @ k[b, s])) for j in range(H_I))
    return I


def fused_loss(index_q, index_k, index_weights, q, compressed_kv, **kw):
    """SPEC §8 + §4: the loss with I from the indexer's inputs."""
    I = indexer_scores(index_q, index_k, index_weights, kw.get("topk_indices"))
    return loss(I, q, compressed_kv, **kw)


def fused_loss_grads(index_q, index_k, index_weights, q, compressed_kv, **kw):
    """SPEC §8 chain rule from SPEC §5's dI: (d index_q, d index_k, d index_weights), float64."""
    I = indexer_scores(index_q, index_k, index_weights, kw.get("topk_indices"))
    return _chain_rule(index_q, index_k, index_weights, loss_grad(I, q, compressed_kv, **kw), kw.get("topk_indices"))


def fused_rounding_scales(index_q, index_k, index_weights, q, compressed_kv, **kw):
    """What f32 rounding can move the fused loss and each gradient entry by, in units of the unit roundoff:
    (loss scale, (d index_q, d index_k, d index_weights)-shaped scales), float64. The loss scale is a float for
    the scalar reductions, [B, S] for "none".

    A = `indexer_score_rounding_scales`: f32 scores are off by ulps of A. A row's KL moves by
    sum_s (Q_s - P_s) dI_s to first order, so the loss scale is |scale| / n sum over rows of sum_s (P_s + Q_s) A_s.
    The gradients: SPEC §8's chain rule run with every factor in absolute value on |scale g / n| times
    (Q + P) (an f32 Q - P is off by a few ulps of Q + P, however well Q and P cancel) plus Q_s (A_s + E_Q A) (I's
    rounding moves Q_s by Q_s (dI_s - E_Q dI))."""
    topk = kw.get("topk_indices")
    I = indexer_scores(index_q, index_k, index_weights, topk)
    A = indexer_score_rounding_scales(index_q, index_k, index_weights, topk)
    reduction, scale, cotangent = kw.pop("reduction", "mean"), kw.pop("scale", 1.0), kw.pop("cotangent", 1.0)
    shape, rows = _rows(q, compressed_kv, **kw)
    n = _divisor(reduction, np.zeros(shape[:2]), len(rows))  # 1 for "none"
    g = np.broadcast_to(np.abs(_f64(cotangent)), shape[:2])
    per_row = np.zeros(shape[:2])
    weight = np.zeros(shape)  # 0 outside V(t) and on empty rows, as `loss_grad`
    for (b, t), (slots, p, logq) in _student(I, shape, rows).items():
        q_row, a = np.exp(logq), A[b, t, slots]
        per_row[b, t] = abs(scale) * float(np.sum((p + q_row) * a)) / n
        weight[b, t, slots] = abs(scale) * g[b, t] * (q_row + p + q_row * (a + np.sum(q_row * a))) / n
    loss_scale = per_row if reduction == "none" else float(per_row.sum())
    return loss_scale, _chain_rule(index_q, index_k, index_weights, weight, topk, absolute=True)


def indexer_score_rounding_scales(index_q, index_k, index_weights, topk_indices=None):
    """A[t, s] = sum_j |w[t, j]| (|q_I[t, j]| . |k_I[s]|): what f32 rounding can move I[t, s] by, in units of the
    unit roundoff (its products and sums taken in absolute value); float64, shaped like `indexer_scores`."""
    return indexer_scores(np.abs(_f64(index_q)), np.abs(_f64(index_k)), np.abs(_f64(index_weights)), topk_indices)


def _chain_rule(index_q, index_k, index_weights, dI, topk, absolute=False):
    """d index_q, d index_k, d index_weights from dI [B, S, N or K] (SPEC §8). absolute: every factor in |.|
    and ReLU(q . k) as |q| . |k| (the scale of q . k's own rounding); the indicator [q . k > 0] as is."""
    qi, ki, w = _f64(index_q), _f64(index_k), _f64(index_weights)
    B, S, H_I, _ = qi.shape
    N = ki.shape[1]
    dq, dk, dw = np.zeros_like(qi), np.zeros_like(ki), np.zeros_like(w)
    qf, kf, wf = (np.abs(qi), np.abs(ki), np.abs(w)) if absolute else (qi, ki, w)
    for b in range(B):
        for t in range(S):
            blocks = range(N) if topk is None else _i64(topk)[b, t]
            for slot, s in enumerate(blocks):
                if not (0 <= s < N) or dI[b, t, slot] == 0:
                    continue
                g = dI[b, t, slot]
                for j in range(H_I):
                    dot = float(qi[b, t, j] @ ki[b, s])
                    dw[b, t, j] += g * (float(qf[b, t, j] @ kf[b, s]) if absolute else max(0.0, dot))
                    if dot > 0:  # the ReLU's derivative is the indicator [q . k > 0]: 0 at exactly 0
                        dq[b, t, j] += g * wf[b, t, j] * kf[b, s]
                        dk[b, s] += g * wf[b, t, j] * qf[b, t, j]
    return dq, dk, dw
