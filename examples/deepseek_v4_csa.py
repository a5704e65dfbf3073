"""A compact DeepSeek-V4 CSA attention layer in flax.nnx, training its lightning indexer with `CSAIndexerLoss`.

Widths default to MaxText's `deepseek4-tiny` (research/anchors.md §A): hidden 64, 4 query heads of dim 32 (all of
it rotary), Q-LoRA rank 16, one shared K=V head (MQA), sliding window W=32, CSA ratio m=4, indexer 4 heads × 32,
top-k 16, output in 4 groups of LoRA rank 16. What it contains:

  * low-rank query: c_q = RMSNorm(x W_qa) [B,S,16]; q = RoPE(headwise-RMS(c_q W_qb)) [B,S,H,D].
  * one MQA latent kv = RoPE(RMSNorm(x W_kv)) [B,S,D], used as key AND value of the sliding-window branch.
  * the overlapping gated compressor (m=4): block s pools 2m tokens per channel with a softmax gate — the first
    half-channels of tokens [(s-1)m, sm) and the second half-channels of [sm, (s+1)m) — then RMSNorm and RoPE at
    the block's first-token position s·m -> compressed_kv [B,N,D], N = S // m.
  * the lightning indexer: its own compressor of width d_I, queries from the shared Q-LoRA latent, head weights
    from x times H_I^-1/2·d_I^-1/2 (SPEC/anchors §B.0): I[t,s] = Σ_j w[t,j]·ReLU(q_I[t,j]·k_I[s]), f32.
  * masks (anchors §C): block s is visible to query t iff it is complete, (s+1)m-1 <= t; window keys
    0 <= t-j < W; top-k over visible blocks only, slots that would pick an invisible block (and the padding when
    N < K) are -1.
  * one joint softmax per head over [window keys ‖ compressed blocks ‖ sink] (the sink is a key with logit
    sinks[h] and value 0), output RoPE'd back by -t (K and V share the rotated latent), grouped low-rank output.

Two stages, as in DeepSeek's recipe: dense warm-up (`sparse=False`: attention over every visible block, loss over
every visible block) and sparse training (`sparse=True`: attention over the indexer's top-k blocks, loss over the K
slots). Gradient flow (SPEC §5, anchors §D): the teacher tensors fed to the loss are detached and so are the
indexer's inputs, so the loss trains only the indexer; top-k indices are integers, so the attention output never
reaches the indexer either. The layer uses one RoPE theta (MaxText `compressed_rope_max_timescale`) for queries,
window keys, blocks and the indexer, as DeepSeek-V4 does in its compressed layers. Single-document sequences
with positions 0..S-1 (no packing), to stay compact.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from csa_pallas.nn import CSAIndexerLoss


@dataclasses.dataclass(frozen=True)
class DeepSeekV4CSAConfig:
    """MaxText field names (so `CSAIndexerLoss.from_maxtext_config` reads it), `deepseek4-tiny` widths."""

    emb_dim: int = 64
    num_query_heads: int = 4
    head_dim: int = 32
    qk_rope_head_dim: int = 32  # the rotated tail of each head (tiny: the whole head)
    q_lora_rank: int = 16
    o_groups: int = 4
    o_lora_rank: int = 16
    sliding_window_size: int = 32
    compress_ratio: int = 4  # this layer's entry of MaxText's `compress_ratios`
    indexer_n_heads: int = 4
    indexer_head_dim: int = 32
    indexer_topk: int = 16
    compressed_rope_max_timescale: float = 160000.0
    normalization_layer_epsilon: float = 1e-6
    # MaxText's default scaling factor is 0.0 (loss off); the example trains the indexer, so 1.0.
    indexer_loss_scaling_factor: float = 1.0
    indexer_sparse_training: bool = False  # the stage `__call__` uses unless told otherwise
    mla_qk_head_chunk_size: int = 0
    # Not MaxText fields: which teacher and which csa_pallas implementation the loss uses.
    indexer_loss_target: str = "joint"
    implementation: Optional[str] = "xla"
    # True: the loss gets the indexer's inputs (`CSAIndexerLoss.fused`, SPEC §8) instead of its scores.
    indexer_fused_student: bool = False


class CSAIntermediates(NamedTuple):
    """The layer's own tensors, for inspection and tests (the loss got detached copies of q, window_kv,
    compressed_kv and sinks)."""

    q: jax.Array  # [B, S, H, D] f32, after RoPE
    window_kv: jax.Array  # [B, S, D] f32, window keys = values, after RoPE
    compressed_kv: jax.Array  # [B, N, D] f32
    sinks: jax.Array  # [H] f32
    indexer_scores: jax.Array  # [B, S, N] f32, I over all blocks (unmasked)
    visible: jax.Array  # [B, S, N] bool, the causal-complete block mask
    topk_indices: Optional[jax.Array]  # [B, S, K] int32 with -1 padding (sparse stage), else None
    indexer_logits: jax.Array  # what the loss got: [B, S, N] (dense) or I at the K slots [B, S, K] (sparse)
    loss: jax.Array  # f32 scalar, scale * KL


# ----------------------------------------------------------------------------------------------------------------
# Small pure helpers.

def rms_norm(x: jax.Array, weight: Optional[jax.Array], eps: float) -> jax.Array:
    """RMSNorm over the last axis in f32; weight None = no learned gain (the headwise query norm)."""
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, rope_dim: int) -> jax.Array:
    """Rotates the last `rope_dim` channels of x (half-split pairs) by angle position * theta^(-2i/rope_dim).

    x: f32 [..., d]; positions: broadcastable to x.shape[:-1] (int or float).
    """
    d = x.shape[-1]
    half = rope_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / rope_dim)
    angle = jnp.asarray(positions, jnp.float32)[..., None] * freqs
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    keep, rot = x[..., : d - rope_dim], x[..., d - rope_dim:]
    r1, r2 = rot[..., :half], rot[..., half:]
    return jnp.concatenate([keep, r1 * cos - r2 * sin, r2 * cos + r1 * sin], axis=-1)


def causal_block_mask(seq_len: int, num_blocks: int, m: int) -> jax.Array:
    """bool [S, N]: block s is visible to query t iff its last token (s+1)m-1 <= t (anchors §C)."""
    t = jnp.arange(seq_len)[:, None]
    s = jnp.arange(num_blocks)[None, :]
    return (s + 1) * m - 1 <= t


def window_mask(seq_len: int, window: int) -> jax.Array:
    """bool [S, S]: key j is in query t's window iff 0 <= t - j < W."""
    delta = jnp.arange(seq_len)[:, None] - jnp.arange(seq_len)[None, :]
    return (delta >= 0) & (delta < window)


def numpy_normal(stddev: float):
    """Initializer N(0, stddev^2), drawn with NumPy from a seed taken from the nnx key.

    Why: on CPU, XLA compiles one threefry kernel per parameter shape, and at these widths those compiles take
    longer than a whole training run. Under a trace (e.g. `nnx.jit` of the constructor) it falls back to
    `jax.random.normal`, which gives other values.
    """
    def init(key, shape, dtype=jnp.float32):
        if isinstance(key, jax.core.Tracer):
            return (jax.random.normal(key, shape) * stddev).astype(dtype)
        seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
        return jnp.asarray(np.random.default_rng(seed).normal(0.0, stddev, shape), dtype)
    return init


def _dense(din: int, dout: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=False, kernel_init=numpy_normal(0.02), rngs=rngs)


# ----------------------------------------------------------------------------------------------------------------
# Modules.

class OverlapCompressor(nnx.Module):
    """CSA overlapping gated compressor: x [B, S, E] -> blocks [B, S // m, dim] f32."""

    def __init__(self, emb_dim: int, dim: int, m: int, *, theta: float, rope_dim: int, eps: float, rngs: nnx.Rngs):
        self.dim, self.m, self.theta, self.rope_dim, self.eps = dim, m, theta, min(rope_dim, dim), eps
        self.kv_proj = _dense(emb_dim, 2 * dim, rngs)
        self.gate_proj = _dense(emb_dim, 2 * dim, rngs)
        self.position_bias = nnx.Param(jnp.zeros((m, 2 * dim), jnp.float32))
        self.norm = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        m, d = self.m, self.dim
        n = s // m
        kv = self.kv_proj(x[:, : n * m]).astype(jnp.float32).reshape(b, n, m, 2 * d)
        gate = self.gate_proj(x[:, : n * m]).astype(jnp.float32).reshape(b, n, m, 2 * d) + self.position_bias[...]
        # The previous block's first half-channels overlap into block s. Block 0 has no previous block: its
        # stand-in has value 0 and gate -inf, so the softmax gives it exactly zero weight.
        prev_kv = jnp.concatenate([jnp.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], axis=1)
        prev_gate = jnp.concatenate([jnp.full_like(gate[:, :1, :, :d], -jnp.inf), gate[:, :-1, :, :d]], axis=1)
        values = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)  # [B, N, 2m, d]
        gates = jnp.concatenate([prev_gate, gate[..., d:]], axis=2)
        pooled = jnp.sum(jax.nn.softmax(gates, axis=2) * values, axis=2)  # per-channel gated sum over 2m tokens
        pooled = rms_norm(pooled, self.norm[...], self.eps)
        return apply_rope(pooled, jnp.arange(n) * m, self.theta, self.rope_dim)  # at the block's first token


class LightningIndexer(nnx.Module):
    """Scores I [B, S, N] f32 of every (query, block) pair (DeepSeek-V3.2/V4 lightning indexer)."""

    def __init__(self, cfg: DeepSeekV4CSAConfig, *, rngs: nnx.Rngs):
        self.n_heads, self.head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.theta, self.rope_dim = cfg.compressed_rope_max_timescale, min(cfg.qk_rope_head_dim, cfg.indexer_head_dim)
        self.compressor = OverlapCompressor(cfg.emb_dim, cfg.indexer_head_dim, cfg.compress_ratio,
                                            theta=self.theta, rope_dim=self.rope_dim,
                                            eps=cfg.normalization_layer_epsilon, rngs=rngs)
        self.q_proj = _dense(cfg.q_lora_rank, cfg.indexer_n_heads * cfg.indexer_head_dim, rngs)
        self.weights_proj = _dense(cfg.emb_dim, cfg.indexer_n_heads, rngs)

    def __call__(self, x: jax.Array, q_latent: jax.Array) -> jax.Array:
        """x: [B, S, E]; q_latent: [B, S, q_lora_rank] (the shared normed Q-LoRA latent). Returns f32 [B, S, N]."""
        q, k, w = self.inputs(x, q_latent)
        relu = jax.nn.relu(jnp.einsum("bsjd,bnd->bsjn", q, k))
        return jnp.einsum("bsjn,bsj->bsn", relu, w)

    def inputs(self, x: jax.Array, q_latent: jax.Array):
        """The scores' inputs (SPEC §8): index_q f32 [B, S, H_I, d_I], index_k [B, N, d_I], index_weights
        [B, S, H_I] with every scale folded in."""
        b, s, _ = x.shape
        k = self.compressor(x)  # [B, N, d_I]
        q = self.q_proj(q_latent).astype(jnp.float32).reshape(b, s, self.n_heads, self.head_dim)
        q = apply_rope(q, jnp.arange(s)[:, None], self.theta, self.rope_dim)
        # The whole H_I^-1/2 · d_I^-1/2 goes into the head weights: without it the student softmax is
        # sqrt(H_I·d_I) times too sharp for the KL to be useful (anchors §B.0).
        w = self.weights_proj(x).astype(jnp.float32) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        return q, k, w


class DeepSeekV4CSAAttention(nnx.Module):
    """One DeepSeek-V4 CSA attention layer: x [B, S, emb_dim] -> [B, S, emb_dim]; sows its indexer loss."""

    def __init__(self, cfg: DeepSeekV4CSAConfig = DeepSeekV4CSAConfig(), *, rngs: nnx.Rngs):
        if cfg.num_query_heads % cfg.o_groups:
            raise ValueError(f"o_groups: must divide num_query_heads={cfg.num_query_heads}, got {cfg.o_groups}")
        self.cfg = cfg
        h, d, e = cfg.num_query_heads, cfg.head_dim, cfg.emb_dim
        self.theta = cfg.compressed_rope_max_timescale
        self.rope_dim = cfg.qk_rope_head_dim
        self.eps = cfg.normalization_layer_epsilon
        self.wq_a = _dense(e, cfg.q_lora_rank, rngs)
        self.q_norm = nnx.Param(jnp.ones((cfg.q_lora_rank,), jnp.float32))
        self.wq_b = _dense(cfg.q_lora_rank, h * d, rngs)
        self.wkv = _dense(e, d, rngs)
        self.kv_norm = nnx.Param(jnp.ones((d,), jnp.float32))
        self.compressor = OverlapCompressor(e, d, cfg.compress_ratio, theta=self.theta, rope_dim=self.rope_dim,
                                            eps=self.eps, rngs=rngs)
        self.indexer = LightningIndexer(cfg, rngs=rngs)
        self.sinks = nnx.Param(jnp.zeros((h,), jnp.float32))  # one learned sink logit per head, f32
        self.wo_a = nnx.Param(numpy_normal(0.02)(rngs.params(), (cfg.o_groups, h // cfg.o_groups * d,
                                                                  cfg.o_lora_rank)))
        self.wo_b = _dense(cfg.o_groups * cfg.o_lora_rank, e, rngs)
        # The layer always decides the stage itself (by passing topk_indices or not), hence sparse_training=None.
        self.indexer_loss = CSAIndexerLoss.from_maxtext_config(
            cfg, compress_ratio=cfg.compress_ratio, sparse_training=None, target=cfg.indexer_loss_target,
            implementation=cfg.implementation)

    def __call__(self, x: jax.Array, *, sparse: Optional[bool] = None) -> jax.Array:
        """x: float [B, S, emb_dim] (S >= compress_ratio) -> f32 [B, S, emb_dim].

        sparse: the stage (None = cfg.indexer_sparse_training). The indexer loss is sown ("indexer_loss");
        collect it with `nnx.capture(layer, nnx.Intermediate)`.
        """
        return self.forward(x, sparse=sparse)[0]

    def forward(self, x: jax.Array, *, sparse: Optional[bool] = None):
        """Like `__call__` but returns (out f32 [B, S, emb_dim], CSAIntermediates)."""
        cfg = self.cfg
        sparse = cfg.indexer_sparse_training if sparse is None else bool(sparse)
        b, s, _ = x.shape
        h, d, m = cfg.num_query_heads, cfg.head_dim, cfg.compress_ratio
        pos = jnp.arange(s)

        # Queries: low-rank, shared latent (the indexer reads it too), headwise RMS, RoPE.
        q_latent = rms_norm(self.wq_a(x), self.q_norm[...], self.eps)  # [B, S, q_lora]
        q = rms_norm(self.wq_b(q_latent).astype(jnp.float32).reshape(b, s, h, d), None, self.eps)
        q = apply_rope(q, pos[:, None], self.theta, self.rope_dim)
        # One shared K=V head for the window branch.
        kv = apply_rope(rms_norm(self.wkv(x), self.kv_norm[...], self.eps), pos, self.theta, self.rope_dim)
        ckv = self.compressor(x)  # [B, N, D]
        n = ckv.shape[1]
        sinks = self.sinks[...].astype(jnp.float32)

        # Indexer on detached inputs: the KL must not reach the backbone (anchors §D).
        scores = self.indexer(jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent))  # [B, S, N]
        visible = jnp.broadcast_to(causal_block_mask(s, n, m), (b, s, n))

        tau = d ** -0.5
        win_logits = tau * jnp.einsum("bshd,bjd->bhsj", q, kv)
        win_mask = window_mask(s, cfg.sliding_window_size)[None, None]
        if sparse:
            k = cfg.indexer_topk
            kk = min(k, n)
            masked = jnp.where(visible, scores, -jnp.inf)
            top_scores, top_idx = jax.lax.top_k(masked, kk)
            top_idx = jnp.where(jnp.isfinite(top_scores), top_idx, -1).astype(jnp.int32)  # invisible pick -> -1
            topk = jnp.pad(top_idx, ((0, 0), (0, 0), (0, k - kk)), constant_values=-1)  # exactly K slots
            safe = jnp.maximum(topk, 0)  # gather index for empty slots; their entries are masked below
            comp_vals = jax.vmap(lambda c, i: c[i])(ckv, safe)  # [B, S, K, D]
            comp_logits = tau * jnp.einsum("bshd,bskd->bhsk", q, comp_vals)
            comp_mask = (topk >= 0)[:, None]
            loss_logits = jnp.take_along_axis(scores, safe, axis=-1)  # I at the K slots
        else:
            topk = None
            comp_vals = ckv
            comp_logits = tau * jnp.einsum("bshd,bnd->bhsn", q, ckv)
            comp_mask = visible[:, None]
            loss_logits = scores

        # One softmax over [window ‖ compressed ‖ sink]; every row has its own token in the window, so no row is
        # fully masked and no NaN can appear.
        sink_logits = jnp.broadcast_to(sinks[None, :, None, None], (b, h, s, 1))
        logits = jnp.concatenate([jnp.where(win_mask, win_logits, -jnp.inf),
                                  jnp.where(comp_mask, comp_logits, -jnp.inf), sink_logits], axis=-1)
        probs = jax.nn.softmax(logits, axis=-1)
        p_win, p_comp = probs[..., :s], probs[..., s:-1]  # the sink's value is 0: its share just leaves
        out = jnp.einsum("bhsj,bjd->bshd", p_win, kv)
        if sparse:
            out = out + jnp.einsum("bhsk,bskd->bshd", p_comp, comp_vals)
        else:
            out = out + jnp.einsum("bhsn,bnd->bshd", p_comp, comp_vals)
        out = apply_rope(out, -pos[:, None], self.theta, self.rope_dim)  # values carry RoPE(j): undo at -t
        g = cfg.o_groups
        grouped = jnp.einsum("bsgc,gcr->bsgr", out.reshape(b, s, g, h // g * d), self.wo_a[...])
        y = self.wo_b(grouped.reshape(b, s, g * cfg.o_lora_rank))

        # The teacher side is detached (SPEC §5): only the indexer learns from the loss.
        sg = jax.lax.stop_gradient
        if cfg.indexer_fused_student:  # the loss computes I from the indexer's inputs and differentiates them
            student = self.indexer.inputs(sg(x), sg(q_latent))
            loss = self.indexer_loss.fused(*student, sg(q), sg(ckv), topk_indices=topk, window_kv=sg(kv),
                                           sinks=sg(sinks))
        else:
            loss = self.indexer_loss(loss_logits, sg(q), sg(ckv), topk_indices=topk, window_kv=sg(kv),
                                     sinks=sg(sinks))
        aux = CSAIntermediates(q=q, window_kv=kv, compressed_kv=ckv, sinks=sinks, indexer_scores=scores,
                               visible=visible, topk_indices=topk, indexer_logits=loss_logits, loss=loss)
        return y, aux
