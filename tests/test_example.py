"""examples/: the DeepSeek-V4 CSA layer against a direct float64 computation, its loss against the oracle, its
gradient isolation, and a short seeded indexer-training run (implementation="xla")."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `examples`

import oracle  # noqa: E402  (tests/oracle.py: independent float64 SPEC oracle)
from csa_pallas.nn import collect_indexer_losses  # noqa: E402
from examples import train_indexer  # noqa: E402
from examples.deepseek_v4_csa import DeepSeekV4CSAAttention, DeepSeekV4CSAConfig  # noqa: E402

CFG = DeepSeekV4CSAConfig(implementation="xla")  # deepseek4-tiny widths
B, S = 2, 96  # N = 24 blocks > K = 16, so the sparse stage really selects


# ---------------------------------------------------------------------------------------------- fixtures

def _randomised_layer(seed=0) -> DeepSeekV4CSAAttention:
    """The layer with every parameter random (norm gains, position biases and sinks too, which init at 1/0)."""
    layer = DeepSeekV4CSAAttention(CFG, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    state = nnx.state(layer, nnx.Param)

    def draw(path, value):
        name = str(path[-1].key)
        shape = np.shape(value)
        if name in ("norm", "q_norm", "kv_norm"):
            new = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name in ("sinks", "position_bias"):
            new = rng.standard_normal(shape)
        else:  # kernels [.., in, out]: unit-variance outputs, so softmaxes and ReLUs are far from trivial
            new = rng.standard_normal(shape) / np.sqrt(shape[-2])
        return jnp.asarray(new, jnp.float32)

    pure = jax.tree_util.tree_map_with_path(draw, state.to_pure_dict())
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(layer, state)
    return layer


def _x(seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, S, CFG.emb_dim)), jnp.float32)


@nnx.jit(static_argnames="sparse")
def _run(layer, x, sparse):
    """Forward, sown loss, and the gradients of (a) the sown loss and (b) an output loss wrt params and input."""

    def forward(layer, x):
        return nnx.capture(lambda l: l.forward(x, sparse=sparse), nnx.Intermediate)(layer)

    def indexer_loss(layer, x):
        (y, aux), inter = forward(layer, x)
        return jnp.mean(collect_indexer_losses(inter)), (y, aux, inter)

    def output_loss(layer, x):
        (y, _), _ = forward(layer, x)
        return jnp.sum(y ** 2)

    (_, (y, aux, inter)), g_loss = nnx.value_and_grad(indexer_loss, argnums=(0, 1), has_aux=True)(layer, x)
    # Only the sparse stage could leak the output loss into the indexer (through top-k); dense attention does not
    # read the indexer at all. Skipping it for dense saves an XLA compile.
    g_out = nnx.grad(output_loss, argnums=(0, 1))(layer, x) if sparse else None
    return y, aux, inter, g_loss, g_out


_CACHE = {}


def _results(sparse):
    if sparse not in _CACHE:
        layer = _randomised_layer()
        _CACHE[sparse] = (layer, _run(layer, _x(), sparse=sparse))
    return _CACHE[sparse]


# ---------------------------------------------------------------------------------------------- float64 layer

def _p(layer, *path):
    obj = layer
    for name in path:
        obj = getattr(obj, name)
    return np.asarray(obj[...], np.float64)


def _rms(x, w, eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _rope(x, pos, theta, rope_dim):
    d = x.shape[-1]
    half = rope_dim // 2
    freqs = theta ** (-np.arange(half) * 2.0 / rope_dim)
    ang = np.asarray(pos, np.float64)[..., None] * freqs
    keep, r1, r2 = x[..., : d - rope_dim], x[..., d - rope_dim: d - half], x[..., d - half:]
    return np.concatenate([keep, r1 * np.cos(ang) - r2 * np.sin(ang), r2 * np.cos(ang) + r1 * np.sin(ang)], -1)


def _compress(layer_c, x, m, theta, rope_dim, eps):
    """One sequence x [S, E] -> blocks [N, d], written token by token from the overlap rule."""
    kv = x @ _p(layer_c, "kv_proj", "kernel")
    gate = x @ _p(layer_c, "gate_proj", "kernel")
    bias = _p(layer_c, "position_bias")
    d = kv.shape[1] // 2
    n = x.shape[0] // m
    out = np.zeros((n, d))
    for s in range(n):
        vals, gates = [], []
        if s > 0:  # first half-channels of the previous block's tokens
            for t in range((s - 1) * m, s * m):
                vals.append(kv[t, :d])
                gates.append(gate[t, :d] + bias[t % m, :d])
        for t in range(s * m, (s + 1) * m):  # second half-channels of this block's tokens
            vals.append(kv[t, d:])
            gates.append(gate[t, d:] + bias[t % m, d:])
        g = np.exp(np.asarray(gates) - np.max(gates, axis=0))
        out[s] = np.sum(g / g.sum(0) * np.asarray(vals), axis=0)
    out = _rms(out, _p(layer_c, "norm"), eps)
    return _rope(out, np.arange(n) * m, theta, min(rope_dim, d))


def _layer_f64(layer, x, topk=None):
    """Direct float64 computation of the layer for x [B, S, E]. Returns (y [B,S,E], indexer scores [B,S,N]).

    topk: the layer's own [B, S, K] selection for the sparse stage (validated separately), None = dense.
    """
    cfg = layer.cfg
    h, d, m, w = cfg.num_query_heads, cfg.head_dim, cfg.compress_ratio, cfg.sliding_window_size
    hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    theta, rd, eps = cfg.compressed_rope_max_timescale, cfg.qk_rope_head_dim, cfg.normalization_layer_epsilon
    tau = d ** -0.5
    x = np.asarray(x, np.float64)
    ys, scores = [], []
    for b in range(x.shape[0]):
        xb = x[b]
        pos = np.arange(S)
        c_q = _rms(xb @ _p(layer, "wq_a", "kernel"), _p(layer, "q_norm"), eps)
        q = _rms((c_q @ _p(layer, "wq_b", "kernel")).reshape(S, h, d), None, eps)
        q = _rope(q, pos[:, None], theta, rd)
        kv = _rope(_rms(xb @ _p(layer, "wkv", "kernel"), _p(layer, "kv_norm"), eps), pos, theta, rd)
        ckv = _compress(layer.compressor, xb, m, theta, rd, eps)
        n = ckv.shape[0]
        # Indexer.
        k_i = _compress(layer.indexer.compressor, xb, m, theta, rd, eps)
        q_i = _rope((c_q @ _p(layer, "indexer", "q_proj", "kernel")).reshape(S, hi, di), pos[:, None], theta,
                    min(rd, di))
        wt = (xb @ _p(layer, "indexer", "weights_proj", "kernel")) / np.sqrt(hi * di)
        score = np.zeros((S, n))
        for t in range(S):
            for s in range(n):
                score[t, s] = sum(wt[t, j] * max(0.0, float(q_i[t, j] @ k_i[s])) for j in range(hi))
        scores.append(score)
        # Attention: one softmax per (t, head) over window keys, blocks and the sink.
        out = np.zeros((S, h, d))
        sinks = _p(layer, "sinks")
        for t in range(S):
            win = list(range(max(0, t - w + 1), t + 1))
            if topk is None:
                blocks = [s for s in range(n) if (s + 1) * m - 1 <= t]
            else:
                blocks = [int(s) for s in np.asarray(topk)[b, t] if s >= 0]
            keys = np.concatenate([kv[win], ckv[blocks]]) if blocks else kv[win]
            for hh in range(h):
                logits = np.concatenate([tau * keys @ q[t, hh], [sinks[hh]]])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[t, hh] = p[:-1] @ keys  # the sink's value is zero
        out = _rope(out, -pos[:, None], theta, rd)
        g = cfg.o_groups
        wo_a = _p(layer, "wo_a")
        grouped = np.stack([out[:, gi * (h // g):(gi + 1) * (h // g)].reshape(S, -1) @ wo_a[gi] for gi in range(g)],
                           axis=1)
        ys.append(grouped.reshape(S, -1) @ _p(layer, "wo_b", "kernel"))
    return np.stack(ys), np.stack(scores)


# ---------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_layer_equals_direct_computation(sparse):
    layer, (y, aux, _, _, _) = _results(sparse)
    topk = None if not sparse else np.asarray(aux.topk_indices)
    y_ref, scores_ref = _layer_f64(layer, _x(), topk)
    np.testing.assert_allclose(aux.indexer_scores, scores_ref, rtol=1e-4, atol=1e-4 * np.abs(scores_ref).max())
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4 * np.abs(y_ref).max())
    n = scores_ref.shape[-1]
    visible = (np.arange(n)[None, :] + 1) * CFG.compress_ratio - 1 <= np.arange(S)[:, None]
    np.testing.assert_array_equal(aux.visible[0], visible)
    if sparse:
        # The selection is a top-K of the float64 scores over visible blocks, -1-padded (ties may order freely).
        k = CFG.indexer_topk
        assert topk.shape == (B, S, k)
        tol = 1e-4 * np.abs(scores_ref).max()
        for b in range(B):
            for t in range(S):
                vis = np.nonzero(visible[t])[0]
                chosen = topk[b, t][topk[b, t] >= 0]
                assert len(chosen) == min(k, len(vis)) and len(set(chosen)) == len(chosen)
                assert set(chosen) <= set(vis)
                rest = np.setdiff1d(vis, chosen)
                if len(rest):
                    assert scores_ref[b, t, chosen].min() >= scores_ref[b, t, rest].max() - tol
        assert (topk[:, : CFG.compress_ratio - 1] == -1).all()  # t <= m-2 sees no block
        assert (topk >= 0).sum(-1).max() == k and S // CFG.compress_ratio > k  # really sparse


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_layer_loss_equals_oracle_on_its_own_tensors(sparse):
    _, (_, aux, inter, _, _) = _results(sparse)
    kw = dict(window_kv=aux.window_kv, sinks=aux.sinks, compress_ratio=CFG.compress_ratio,
              window_size=CFG.sliding_window_size, target="joint", scale=CFG.indexer_loss_scaling_factor)
    if sparse:
        kw["topk_indices"] = aux.topk_indices
    expected = oracle.loss(aux.indexer_logits, aux.q, aux.compressed_kv, **kw)
    sown = collect_indexer_losses(inter)
    assert sown.shape == (1,)
    np.testing.assert_allclose(sown[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux.loss, expected, rtol=1e-5, atol=1e-6)
    assert expected > 1e-3  # an untrained indexer: the comparison is not vacuous
    if sparse:  # the sparse logits are the dense scores at the selected slots
        idx = np.maximum(np.asarray(aux.topk_indices), 0)
        np.testing.assert_array_equal(aux.indexer_logits, np.take_along_axis(np.asarray(aux.indexer_scores), idx, -1))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_only_the_indexer_learns_from_the_loss(sparse):
    _, (_, _, _, (g_loss, gx_loss), g_out) = _results(sparse)
    names = lambda path: [str(p.key) for p in path]
    n_indexer = 0
    for path, g in jax.tree_util.tree_leaves_with_path(g_loss.to_pure_dict()):
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), names(path)
        if "indexer" in names(path):
            n_indexer += 1
            assert np.abs(g).max() > 0, f"no gradient for {names(path)}"
        else:
            np.testing.assert_array_equal(g, 0.0, err_msg=f"{names(path)} got a gradient from the indexer loss")
    assert n_indexer == 6  # compressor kv/gate kernels, position_bias, norm; q_proj; weights_proj
    np.testing.assert_array_equal(np.asarray(gx_loss), 0.0)  # the indexer's inputs are detached
    if sparse:
        # The layer output reaches the backbone but never the indexer: top-k indices are integers.
        g_params, gx_out = g_out
        flat = jax.tree_util.tree_leaves_with_path(g_params.to_pure_dict())
        leaves = {tuple(names(p)): np.asarray(g) for p, g in flat}
        for path, g in leaves.items():
            if "indexer" in path:
                np.testing.assert_array_equal(g, 0.0, err_msg=str(path))
        assert np.abs(leaves[("wq_a", "kernel")]).max() > 0 and np.abs(np.asarray(gx_out)).max() > 0


def test_short_training_run_cuts_kl_by_3x():
    """Seeded, fixed batch, dense stage: 30 Adam steps on the indexer alone cut the KL at least 3x."""
    cfg = DeepSeekV4CSAConfig(implementation="xla")
    tokens = jnp.asarray(train_indexer.synthetic_tokens(np.random.default_rng(0), 2, 128, 512))

    def losses():
        model = train_indexer.TinyCSAModel(cfg, 512, rngs=nnx.Rngs(0))
        frozen = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Not(train_indexer.INDEXER)))}
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=train_indexer.INDEXER)
        out = [float(train_indexer.train_step(model, optimizer, tokens, sparse=False)) for _ in range(31)]
        after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Not(train_indexer.INDEXER)))}
        return out, frozen, after

    kl, frozen, after = losses()  # kl[i] is the loss before update i: kl[30] is after 30 steps
    assert np.all(np.isfinite(kl))
    assert kl[30] < kl[0] / 3, f"KL {kl[0]:.4f} -> {kl[30]:.4f}"
    assert all(a <= b * 1.05 for a, b in zip(kl[10::10], kl[0::10]))  # steadily, not by luck at the end
    for key in frozen:  # everything outside the indexer stayed frozen
        np.testing.assert_array_equal(after[key], frozen[key], err_msg=str(key))
    assert losses()[0] == kl  # deterministic


@pytest.mark.parametrize("sparse, implementation", [(False, "xla"), (True, "xla"), (False, "pallas")])
def test_fused_student_trains_the_same_way(sparse, implementation):
    """--fused-student (the loss takes the indexer's inputs, SPEC §8): the same losses step by step as the
    scores path, within f32 rounding (same seed, batch and optimizer; 10 Adam steps). "pallas": the fused op's
    kernels (the student kernels and the gradient in the forward pass) against the same scores path."""
    tokens = jnp.asarray(train_indexer.synthetic_tokens(np.random.default_rng(1), 2, 64, 512))

    def losses(fused):
        cfg = DeepSeekV4CSAConfig(implementation=implementation if fused else "xla", indexer_fused_student=fused)
        model = train_indexer.TinyCSAModel(cfg, 512, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=train_indexer.INDEXER)
        return [float(train_indexer.train_step(model, optimizer, tokens, sparse=sparse)) for _ in range(11)]

    scores, fused = losses(False), losses(True)
    np.testing.assert_allclose(fused, scores, rtol=2e-4)
    assert fused[10] < fused[0]


def test_plot_writes_png(tmp_path):
    history = {"dense": {"step": [0, 10], "kl": [0.1, 0.05], "recall": [0.4, 0.6], "chained": False},
               "sparse": {"step": [0, 10], "kl": [0.1, 0.04], "recall": [0.4, 0.7], "chained": True}}
    path = tmp_path / "sub" / "plot.png"
    train_indexer.plot(history, str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
