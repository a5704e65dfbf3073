"""csa_pallas.nn: the flax wrappers equal the functional API, sow their loss, and reject bad configuration.

Everything runs with implementation="xla" (the wrappers only pass it through; the spy test checks that), except
the Flax-vmap test, which runs the kernels' own batching rule.
"""

import dataclasses
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import csa_pallas
from csa_pallas import nn as csa_nn
from csa_pallas.nn import CSAIndexerLoss, CSAIndexerLossLinen, IndexerLossConfig, collect_indexer_losses

B, S, H, D, M, W, K = 2, 24, 4, 8, 4, 8, 3
N = S // M
IMPL = "xla"


def _inputs(seed=0, sparse=False, packed=False):
    # NumPy, not jax.random: every eager jax op on a new shape is one more XLA compile, and they add up.
    rng = np.random.default_rng(seed)
    f32 = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale)
    arrays = dict(q=f32(B, S, H, D, scale=2.0), compressed_kv=f32(B, N, D), window_kv=f32(B, S, D), sinks=f32(H))
    kw = {}
    if sparse:
        # Random picks with some -1 and some future blocks: the masks must handle both.
        kw["topk_indices"] = jnp.asarray(rng.integers(-1, N, (B, S, K)), jnp.int32)
    if packed:
        kw["segment_ids"] = jnp.asarray(np.repeat([[0] * 10 + [1] * (S - 10)], B, 0), jnp.int32)
        kw["positions"] = jnp.asarray(np.repeat([list(range(10)) + list(range(S - 10))], B, 0), jnp.int32)
    logits = f32(B, S, K if sparse else N, scale=3.0)
    return logits, arrays, kw


def _functional(logits, arrays, kw, cfg: IndexerLossConfig):
    window = {} if cfg.target == "per_head" else dict(window_kv=arrays["window_kv"], sinks=arrays["sinks"])
    return csa_pallas.indexer_distill_loss(
        logits, arrays["q"], arrays["compressed_kv"], **window, **kw, compress_ratio=cfg.compress_ratio,
        window_size=cfg.window_size, target=cfg.target, reduction=cfg.reduction, scale=cfg.scale,
        head_chunk=cfg.head_chunk, softmax_scale=cfg.softmax_scale, implementation=cfg.implementation)


def _call_kwargs(arrays, kw, cfg):
    window = {} if cfg.target == "per_head" else dict(window_kv=arrays["window_kv"], sinks=arrays["sinks"])
    return {**window, **kw}


class _Student(nnx.Module):
    """The indexer logits as a parameter, plus the loss module: the smallest 'model' with a trainable student."""

    def __init__(self, logits, loss_module):
        self.logits = nnx.Param(logits)
        self.loss = loss_module

    def __call__(self, q, compressed_kv, **kw):
        return self.loss(self.logits[...], q, compressed_kv, **kw)


CASES = [
    dict(sparse=False, target="joint", reduction="mean", scale=1.0, head_chunk=None, packed=False),
    dict(sparse=True, target="joint", reduction="sum", scale=0.25, head_chunk=2, packed=True),
    dict(sparse=False, target="per_head", reduction="mean_all", scale=0.1, head_chunk=1, packed=True),
    dict(sparse=True, target="per_head", reduction="none", scale=2.0, head_chunk=None, packed=False),
]


def _ids(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_nnx_matches_functional_under_jit_and_grad(case):
    case = dict(case)
    sparse, packed = case.pop("sparse"), case.pop("packed")
    logits, arrays, kw = _inputs(seed=1, sparse=sparse, packed=packed)
    cfg = IndexerLossConfig(compress_ratio=M, window_size=W, implementation=IMPL, **case)
    call_kw = _call_kwargs(arrays, kw, cfg)
    none = cfg.reduction == "none"
    cot = jnp.asarray(np.random.default_rng(9).uniform(size=(B, S)), jnp.float32) if none else None
    reduce = (lambda out: jnp.sum(out * cot)) if none else (lambda out: out)

    student = _Student(logits, CSAIndexerLoss(cfg))

    @nnx.jit
    def step(model, q, ckv, call_kw):
        def loss_fn(model):
            loss, inter = nnx.capture(lambda m: m(q, ckv, **call_kw), nnx.Intermediate)(model)
            return reduce(loss), (loss, inter)
        (_, (loss, inter)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        # The functional API on the same inputs, in the same compiled program (one compile per case).
        ref = jax.value_and_grad(lambda lg: reduce(_functional(lg, arrays, kw, cfg)))(logits)
        ref_loss = _functional(logits, arrays, kw, cfg)
        return loss, inter, grads, ref_loss, ref[1]

    loss, inter, grads, ref_loss, ref_grad = step(student, arrays["q"], arrays["compressed_kv"], call_kw)

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)  # same math, possibly fused differently
    np.testing.assert_allclose(grads["logits"][...], ref_grad, rtol=1e-5, atol=1e-8)
    assert float(np.max(np.abs(ref_grad))) > 0  # the comparison is not vacuous
    # The sown value is the returned loss, under the loss module's path.
    sown = inter["loss"]["indexer_loss"].get_value()
    assert len(sown) == 1
    np.testing.assert_array_equal(sown[0], loss)
    np.testing.assert_array_equal(collect_indexer_losses(inter)[0], loss)


def test_nnx_grad_wrt_teacher_inputs_is_zero():
    logits, arrays, kw = _inputs(seed=2)
    mod = CSAIndexerLoss(compress_ratio=M, window_size=W, implementation=IMPL)

    @nnx.jit
    def grads(mod, logits, q, ckv, wkv, sinks):
        def f(logits, q, ckv, wkv, sinks, mod):
            out, _ = nnx.capture(mod, nnx.Intermediate)(logits, q, ckv, window_kv=wkv, sinks=sinks)
            return out
        return nnx.grad(f, argnums=(0, 1, 2, 3, 4))(logits, q, ckv, wkv, sinks, mod)

    g = grads(mod, logits, arrays["q"], arrays["compressed_kv"], arrays["window_kv"], arrays["sinks"])
    assert float(jnp.max(jnp.abs(g[0]))) > 0
    for gi in g[1:]:
        np.testing.assert_array_equal(np.asarray(gi), 0.0)


class _TwoLayers(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([CSAIndexerLoss(compress_ratio=M, window_size=W, implementation=IMPL),
                                CSAIndexerLoss(compress_ratio=M, window_size=W, scale=3.0, implementation=IMPL)])

    def __call__(self, logits, arrays):
        return [layer(logits, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"],
                      sinks=arrays["sinks"]) for layer in self.layers]


def test_nnx_sow_collects_every_layer():
    logits, arrays, _ = _inputs(seed=3)
    model = _TwoLayers()
    losses, inter = nnx.jit(lambda m, lg: nnx.capture(m, nnx.Intermediate)(lg, arrays))(model, logits)
    collected = collect_indexer_losses(inter)
    assert collected.shape == (2,)
    np.testing.assert_array_equal(collected, np.stack(losses))
    np.testing.assert_allclose(collected[1], 3.0 * np.asarray(collected[0]), rtol=1e-6)
    # Nothing was stored on the module: capture keeps the graph structure unchanged.
    assert len(nnx.state(model, nnx.Intermediate)) == 0


def test_nnx_sow_without_capture_uses_flax_legacy_attribute():
    logits, arrays, _ = _inputs(seed=3)
    mod = CSAIndexerLoss(compress_ratio=M, window_size=W, implementation=IMPL)
    call = nnx.jit(lambda mod, lg: mod(lg, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # flax deprecates sow outside nnx.capture
        first = call(mod, logits)
        call(mod, logits * 2)
    popped = nnx.pop(mod, nnx.Intermediate)
    values = collect_indexer_losses(popped)
    assert values.shape == (2,)
    np.testing.assert_array_equal(values[0], first)
    assert len(nnx.state(mod, nnx.Intermediate)) == 0


def test_collect_indexer_losses_orders_layers_numerically():
    """MaxText names layers layers_0 ... layers_42: layer 10 comes after layer 9, not after layer 1."""
    tree = {f"layers_{i}": {"indexer_loss": (jnp.float32(i),)} for i in (12, 1, 10, 2, 3, 11, 0)}
    np.testing.assert_array_equal(collect_indexer_losses(tree), [0, 1, 2, 3, 10, 11, 12])


def test_collect_indexer_losses_under_scan_returns_one_entry_per_layer():
    """nn.scan stacks the sown value over the scanned layers: [L], not [1, L]; reduction="none" gives [L, B, S]."""
    logits, arrays, _ = _inputs(seed=8)

    def scanned(reduction):
        class Layer(nn.Module):
            @nn.compact
            def __call__(self, lg, _):
                CSAIndexerLossLinen(compress_ratio=M, window_size=W, reduction=reduction, implementation=IMPL)(
                    lg, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"])
                return lg * 1.5, None

        stack = nn.scan(Layer, variable_axes={"intermediates": 0}, split_rngs={}, length=3)
        _, state = jax.jit(lambda lg: stack().apply({}, lg, None, mutable=["intermediates"]))(logits)
        return collect_indexer_losses(state["intermediates"])

    losses = scanned("mean")
    assert losses.shape == (3,)
    rows = scanned("none")
    assert rows.shape == (3, B, S)
    np.testing.assert_allclose(np.asarray(rows).sum(axis=(1, 2)) > 0, True)
    # A scanned stack next to an unscanned layer: one entry per layer, in layer order.
    tree = {"layers_0": {"indexer_loss": (jnp.float32(5.0),)},
            "layers_1": {"indexer_loss": (jnp.asarray([1.0, 2.0, 3.0]),)}}
    np.testing.assert_array_equal(collect_indexer_losses(tree), [5.0, 1.0, 2.0, 3.0])


def test_wrappers_under_flax_vmaps_sow_one_loss_per_element():
    """A stage axis the Flax way (MaxText's pipeline is an nn.vmap of the layer), through the kernels: linen's
    nn.vmap stacks the sown losses when "intermediates" is among its variable_axes (flax drops a sow into an
    unlisted collection); nnx.vmap needs nnx.capture inside the vmapped function."""
    stacked = [_inputs(seed=20 + i) for i in range(2)]
    logits = jnp.stack([lg for lg, _, _ in stacked])
    q, ckv = (jnp.stack([arrays[name] for _, arrays, _ in stacked]) for name in ("q", "compressed_kv"))
    want = [csa_pallas.indexer_distill_loss(logits[i], q[i], ckv[i], target="per_head", implementation=IMPL)
            for i in range(2)]

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, lg, q, ckv):
            return CSAIndexerLossLinen(compress_ratio=M, target="per_head", implementation="pallas")(lg, q, ckv)
    stages = nn.vmap(Layer, in_axes=0, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": False})
    out, state = jax.jit(lambda *a: stages().apply({}, *a, mutable=["intermediates"]))(logits, q, ckv)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    np.testing.assert_allclose(collect_indexer_losses(state["intermediates"]), want, rtol=1e-5)

    module = CSAIndexerLoss(compress_ratio=M, target="per_head", implementation="pallas")
    per_stage = nnx.vmap(lambda m, *a: nnx.capture(m, nnx.Intermediate)(*a), in_axes=(None, 0, 0, 0))
    out, inter = per_stage(module, logits, q, ckv)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    np.testing.assert_allclose(collect_indexer_losses(inter), want, rtol=1e-5)


def test_maxtext_config_masks_padding_segment_zero():
    """from_maxtext_config sets padding_segment_id=0: rows of segment 0 (MaxText padding) leave the loss unless the
    call passes loss_mask; padding_segment_id=None turns it off."""
    logits, arrays, kw = _inputs(seed=9, packed=True)  # segment 0: the first 10 tokens
    call = dict(window_kv=arrays["window_kv"], sinks=arrays["sinks"], **kw)
    mt = _MaxTextCfg(indexer_loss_scaling_factor=1.0)
    masked = CSAIndexerLoss.from_maxtext_config(mt, compress_ratio=M, implementation=IMPL)
    assert masked.config.padding_segment_id == 0
    plain = CSAIndexerLoss.from_maxtext_config(mt, compress_ratio=M, implementation=IMPL, padding_segment_id=None)
    run = lambda mod, **extra: nnx.capture(mod, nnx.Intermediate)(logits, arrays["q"], arrays["compressed_kv"],
                                                                   **call, **extra)[0]
    want = csa_pallas.indexer_distill_loss(logits, arrays["q"], arrays["compressed_kv"], window_size=W,
                                           loss_mask=kw["segment_ids"] != 0, implementation=IMPL, **call)
    np.testing.assert_allclose(run(masked), want, rtol=1e-6)
    everything = csa_pallas.indexer_distill_loss(logits, arrays["q"], arrays["compressed_kv"], window_size=W,
                                                 implementation=IMPL, **call)
    np.testing.assert_allclose(run(plain), everything, rtol=1e-6)
    assert abs(float(want) - float(everything)) > 1e-5  # segment 0 did count before masking
    explicit = jnp.ones((B, S), bool)
    np.testing.assert_allclose(run(masked, loss_mask=explicit), everything, rtol=1e-6)


def test_collect_indexer_losses_empty_and_nested_name():
    assert collect_indexer_losses({}).shape == (0,)
    # A submodule named like the sown value must be recursed into, not taken as a value.
    tree = {"indexer_loss": {"indexer_loss": (jnp.float32(1.0),)}, "other": {"indexer_loss": (jnp.float32(2.0),)}}
    np.testing.assert_array_equal(collect_indexer_losses(tree), [1.0, 2.0])


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=_ids)
def test_linen_matches_functional(case):
    case = dict(case)
    sparse, packed = case.pop("sparse"), case.pop("packed")
    logits, arrays, kw = _inputs(seed=4, sparse=sparse, packed=packed)
    cfg = IndexerLossConfig(compress_ratio=M, window_size=W, implementation=IMPL, **case)
    call_kw = _call_kwargs(arrays, kw, cfg)
    module = CSAIndexerLossLinen(**dataclasses.asdict(cfg))
    assert module.loss_config == cfg
    reduce = jnp.sum if cfg.reduction == "none" else (lambda out: out)

    def apply(lg):
        loss, state = module.apply({}, lg, arrays["q"], arrays["compressed_kv"], mutable=["intermediates"],
                                   **call_kw)
        return reduce(loss), (loss, state["intermediates"])

    @jax.jit
    def both(lg):
        (_, (loss, inter)), grad = jax.value_and_grad(apply, has_aux=True)(lg)
        ref_loss = _functional(lg, arrays, kw, cfg)
        ref_grad = jax.grad(lambda x: reduce(_functional(x, arrays, kw, cfg)))(lg)
        return loss, inter, grad, ref_loss, ref_grad

    loss, inter, grad, ref_loss, ref_grad = both(logits)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)  # same math, possibly fused differently
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)
    assert float(np.max(np.abs(ref_grad))) > 0
    np.testing.assert_array_equal(collect_indexer_losses(inter), np.stack([loss]))


def test_linen_inside_a_model_collects_every_layer():
    logits, arrays, _ = _inputs(seed=5)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, lg):
            out = []
            for i, scale in enumerate((1.0, 0.5)):
                out.append(CSAIndexerLossLinen(compress_ratio=M, window_size=W, scale=scale, implementation=IMPL,
                                               name=f"layer_{i}")(lg, arrays["q"], arrays["compressed_kv"],
                                                                  window_kv=arrays["window_kv"]))
            return out

    losses, state = jax.jit(lambda lg: Model().apply({}, lg, mutable=["intermediates"]))(logits)
    collected = collect_indexer_losses(state["intermediates"])
    np.testing.assert_array_equal(collected, np.stack(losses))
    np.testing.assert_allclose(collected[1], 0.5 * np.asarray(collected[0]), rtol=1e-6)


# ------------------------------------------------------------------------------------------------ MaxText config

@dataclasses.dataclass
class _MaxTextCfg:
    indexer_loss_scaling_factor: float = 0.1
    indexer_sparse_training: bool = False
    mla_qk_head_chunk_size: int = 0
    sliding_window_size: int = W
    num_query_heads: int = H  # unrelated MaxText fields are ignored
    use_indexer: bool = True


def test_from_maxtext_config_mapping():
    cfg = IndexerLossConfig.from_maxtext_config(_MaxTextCfg(), implementation=IMPL)
    assert cfg == IndexerLossConfig(compress_ratio=4, window_size=W, scale=0.1, head_chunk=None,
                                    sparse_training=False, implementation=IMPL, padding_segment_id=0)
    as_dict = dict(indexer_loss_scaling_factor=2, indexer_sparse_training=True, mla_qk_head_chunk_size=2,
                   sliding_window_size=16)
    cfg = IndexerLossConfig.from_maxtext_config(as_dict, target="per_head", compress_ratio=8)
    assert (cfg.scale, cfg.sparse_training, cfg.head_chunk, cfg.window_size, cfg.target, cfg.compress_ratio) == \
        (2.0, True, 2, 16, "per_head", 8)
    # Overrides win, and may stand in for an absent MaxText field.
    cfg = IndexerLossConfig.from_maxtext_config(types.SimpleNamespace(indexer_loss_scaling_factor=0.3,
                                                                      indexer_sparse_training=False,
                                                                      mla_qk_head_chunk_size=0),
                                                window_size=5, scale=0.7)
    assert (cfg.window_size, cfg.scale) == (5, 0.7)
    # All constructors take it.
    nnx_mod = CSAIndexerLoss.from_maxtext_config(_MaxTextCfg(), implementation=IMPL)
    assert nnx_mod.config.scale == 0.1
    assert CSAIndexerLoss(_MaxTextCfg(), implementation=IMPL).config == nnx_mod.config
    assert CSAIndexerLoss(config=as_dict, scale=5.0).config.scale == 5.0
    assert CSAIndexerLossLinen.from_maxtext_config(_MaxTextCfg(), implementation=IMPL).loss_config == nnx_mod.config
    assert CSAIndexerLossLinen(config=_MaxTextCfg(), implementation=IMPL).loss_config == nnx_mod.config


def test_maxtext_config_drops_in_and_matches_functional():
    mt = _MaxTextCfg(indexer_loss_scaling_factor=0.25, mla_qk_head_chunk_size=2)
    logits, arrays, kw = _inputs(seed=6)
    mod = CSAIndexerLoss.from_maxtext_config(mt, compress_ratio=M, implementation=IMPL)

    @nnx.jit
    def both(mod, lg):
        loss, _ = nnx.capture(mod, nnx.Intermediate)(lg, arrays["q"], arrays["compressed_kv"],
                                                     window_kv=arrays["window_kv"], sinks=arrays["sinks"])
        ref = csa_pallas.indexer_distill_loss(lg, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"],
                                              sinks=arrays["sinks"], window_size=W, scale=0.25, head_chunk=2,
                                              implementation=IMPL)
        return loss, ref

    loss, ref = both(mod, logits)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)


def test_implementation_and_config_are_passed_through(monkeypatch):
    seen = {}

    def spy(indexer_logits, q, compressed_kv, **kwargs):
        seen.update(kwargs)
        return jnp.float32(0.0)

    monkeypatch.setattr(csa_nn.api, "indexer_distill_loss", spy)
    logits, arrays, kw = _inputs(seed=7, sparse=True)
    for impl in ("pallas", None, "xla"):
        mod = CSAIndexerLoss(compress_ratio=M, window_size=W, target="per_head", reduction="sum", scale=0.5,
                             head_chunk=2, softmax_scale=0.3, implementation=impl)
        nnx.capture(mod, nnx.Intermediate)(logits, arrays["q"], arrays["compressed_kv"], **kw)
        assert seen["implementation"] == impl
        assert (seen["compress_ratio"], seen["window_size"], seen["target"], seen["reduction"], seen["scale"],
                seen["head_chunk"], seen["softmax_scale"]) == (M, W, "per_head", "sum", 0.5, 2, 0.3)
        assert seen["topk_indices"] is kw["topk_indices"]
        lin = CSAIndexerLossLinen(compress_ratio=M, window_size=W, implementation=impl)
        lin.apply({}, logits, arrays["q"], arrays["compressed_kv"], mutable=["intermediates"], **kw)
        assert seen["implementation"] == impl
    # kernel_config: the ops' config= (a dict kept hashable as its items, handed back as a dict; a TeacherConfig
    # as itself), from the nnx and linen modules and from an IndexerLossConfig
    from csa_pallas.kernels.teacher_config import TeacherConfig
    forced = TeacherConfig(16, 128, 2, True, 32 << 20)
    for given, passed in (({"path": "visit", "tile_list": True}, {"path": "visit", "tile_list": True}),
                          (forced, forced), (None, None)):
        for mod in (CSAIndexerLoss(compress_ratio=M, window_size=W, kernel_config=given),
                    CSAIndexerLoss(IndexerLossConfig(compress_ratio=M, window_size=W, kernel_config=given))):
            hash(mod.config)
            nnx.capture(mod, nnx.Intermediate)(logits, arrays["q"], arrays["compressed_kv"], **kw)
            assert seen["config"] == passed
        CSAIndexerLossLinen(compress_ratio=M, window_size=W, kernel_config=given).apply(
            {}, logits, arrays["q"], arrays["compressed_kv"], mutable=["intermediates"], **kw)
        assert seen["config"] == passed
    with pytest.raises(TypeError, match="^kernel_config: expected None, a TeacherConfig or a dict"):
        IndexerLossConfig(kernel_config=["walk", "plain"])


# ------------------------------------------------------------------------------------------------ errors

BAD_FIELDS = [
    ("compress_ratio", 0), ("compress_ratio", 2.0), ("window_size", -1), ("target", "joint_sink"),
    ("reduction", "avg"), ("scale", -1.0), ("scale", float("nan")), ("scale", "1"), ("scale", jnp.float32(1.0)),
    ("head_chunk", 0), ("head_chunk", 1.5), ("softmax_scale", 0.0), ("sparse_training", "yes"),
    ("implementation", "cuda"), ("mesh", "data"),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=lambda v: repr(v))
def test_bad_field_is_a_clear_value_error(field, value):
    for make in (lambda: IndexerLossConfig(**{field: value}), lambda: CSAIndexerLoss(**{field: value}),
                 lambda: CSAIndexerLossLinen(**{field: value})):
        with pytest.raises(ValueError, match=f"^{field}: "):
            make()


def test_mesh_axes_without_a_mesh_are_rejected():
    with pytest.raises(ValueError, match="^mesh: batch_axes/head_axis/seq_axis name mesh axes"):
        IndexerLossConfig(head_axis="tensor")


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_nnx_sharded_on_a_mesh_matches_functional(sparse):
    # 8 host devices (conftest); batch over "data", heads over "tensor" (MaxText's names), Pallas in shard_map.
    from jax.sharding import Mesh
    import platform_select
    sizes = platform_select.fit_mesh_axes({"data": 2, "tensor": 2}, len(jax.devices()))
    devices = np.array(jax.devices()[:int(np.prod(list(sizes.values())))])
    mesh = Mesh(devices.reshape(tuple(sizes.values())), tuple(sizes))
    logits, arrays, kw = _inputs(seed=4, sparse=sparse, packed=True)
    cfg = IndexerLossConfig(compress_ratio=M, window_size=W, implementation="pallas", mesh=mesh, batch_axes="data",
                            head_axis="tensor")
    student = _Student(logits, CSAIndexerLoss(cfg))
    call_kw = _call_kwargs(arrays, kw, cfg)

    @nnx.jit
    def step(model, q, ckv, call_kw):
        def loss_fn(model):
            loss, _ = nnx.capture(lambda m: m(q, ckv, **call_kw), nnx.Intermediate)(model)
            return loss
        return nnx.value_and_grad(loss_fn)(model)

    loss, grads = step(student, arrays["q"], arrays["compressed_kv"], call_kw)
    ref_cfg = dataclasses.replace(cfg, mesh=None, batch_axes=(), head_axis=None, implementation="xla")
    ref_loss, ref_grad = jax.value_and_grad(lambda lg: _functional(lg, arrays, kw, ref_cfg))(logits)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grads["logits"][...], ref_grad, atol=1e-5 * float(np.max(np.abs(ref_grad))))


BAD_MAXTEXT = [
    ("indexer_loss_scaling_factor", -0.1), ("indexer_loss_scaling_factor", None),
    ("indexer_sparse_training", "True"), ("mla_qk_head_chunk_size", -1), ("mla_qk_head_chunk_size", 2.0),
    ("sliding_window_size", 0),
]


@pytest.mark.parametrize("field,value", BAD_MAXTEXT, ids=lambda v: repr(v))
def test_bad_maxtext_value_names_the_maxtext_field(field, value):
    cfg = dataclasses.replace(_MaxTextCfg(), **{field: value})
    for make in (lambda: IndexerLossConfig.from_maxtext_config(cfg), lambda: CSAIndexerLoss.from_maxtext_config(cfg),
                 lambda: CSAIndexerLoss(cfg), lambda: CSAIndexerLossLinen.from_maxtext_config(cfg),
                 lambda: CSAIndexerLossLinen(config=cfg)):
        with pytest.raises(ValueError, match=f"^{field}: "):
            make()


def test_missing_maxtext_field_and_unknown_override():
    partial = dict(indexer_loss_scaling_factor=0.1, indexer_sparse_training=False, mla_qk_head_chunk_size=0)
    with pytest.raises(ValueError, match="^sliding_window_size: missing"):
        IndexerLossConfig.from_maxtext_config(partial)
    with pytest.raises(ValueError, match="^sliding_window_size: missing"):
        CSAIndexerLoss.from_maxtext_config(types.SimpleNamespace(**partial))
    with pytest.raises(ValueError, match="^window: unknown IndexerLossConfig field"):
        IndexerLossConfig.from_maxtext_config(_MaxTextCfg(), window=4)


def test_stage_mismatch_and_call_time_errors():
    logits, arrays, kw = _inputs(seed=8, sparse=True)
    dense_logits, _, _ = _inputs(seed=8)
    sparse_mod = CSAIndexerLoss(compress_ratio=M, window_size=W, sparse_training=True, implementation=IMPL)
    with pytest.raises(ValueError, match="^topk_indices: required because sparse_training=True"):
        sparse_mod(dense_logits, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"])
    dense_mod = CSAIndexerLoss.from_maxtext_config(_MaxTextCfg(indexer_sparse_training=False), compress_ratio=M,
                                                   implementation=IMPL)
    with pytest.raises(ValueError, match="^topk_indices: given but sparse_training=False"):
        dense_mod(logits, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"], **kw)
    # Problems only the arrays reveal come from the functional API, naming the argument.
    chunk3 = CSAIndexerLoss(compress_ratio=M, window_size=W, head_chunk=3, implementation=IMPL)
    with pytest.raises(ValueError, match="^head_chunk: "):
        chunk3(dense_logits, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"])
    joint = CSAIndexerLoss(compress_ratio=M, window_size=W, implementation=IMPL)
    with pytest.raises(ValueError, match="^window_kv: target='joint' needs"):
        joint(dense_logits, arrays["q"], arrays["compressed_kv"])
    with pytest.raises(ValueError, match="^noncompressed_lse: pass only one of"):
        joint(dense_logits, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"],
              noncompressed_lse=jnp.zeros((B, S, H)))
