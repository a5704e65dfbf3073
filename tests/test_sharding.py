"""The sharded entry points (csa_pallas.sharding) on 8 CPU host devices (conftest sets
--xla_force_host_platform_device_count=8): sharded == unsharded reference for loss, target and dI over meshes that
shard batch, heads and the query sequence, dense and sparse, both targets, with packing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import csa_pallas
from csa_pallas import sharding
import platform_select
from kernel_cases import packed_ids

B, S, H, D, M, W, K = 2, 128, 8, 32, 4, 16, 24
N = S // M


def mesh_of(axes: dict) -> Mesh:
    """The mesh of `axes` on this host: 8 CPU host devices (conftest), or a TPU slice's chips with the axes shrunk
    to fit (`platform_select.fit_mesh_axes`: a v5p-8 runs {"data": 2, "heads": 4} as {"data": 2, "heads": 2})."""
    devices = jax.devices()
    if jax.default_backend() == "cpu" and len(devices) < platform_select.HOST_DEVICES:
        pytest.fail(f"expected {platform_select.HOST_DEVICES} host devices (conftest sets XLA_FLAGS), got "
                    f"{len(devices)}")
    sizes = platform_select.fit_mesh_axes(axes, len(devices))
    return Mesh(np.array(devices[:int(np.prod(list(sizes.values())))]).reshape(tuple(sizes.values())), tuple(sizes))


def axis_kwargs(axes: dict) -> dict:
    return dict(batch_axes=[a for a in axes if a == "data"], head_axis="heads" if "heads" in axes else None,
                seq_axis="seq" if "seq" in axes else None)


def inputs(seed, *, sparse, target, packed, stats=None, batch=B):
    rng = np.random.default_rng(seed)
    B = batch
    arrays = dict(q=jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32),
                  compressed_kv=jnp.asarray(rng.standard_normal((B, N, D)), jnp.float32))
    teacher = dict(compress_ratio=M, window_size=W, target=target)
    if packed:
        seg, pos = packed_ids(rng, B, S, 3)
        teacher.update(segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))
    if target == "joint":
        if stats is None:
            teacher.update(window_kv=jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32),
                           sinks=jnp.asarray(rng.standard_normal(H), jnp.float32))
        else:  # the caller's u: take it from the reference window LSE
            window_kv = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32)
            ids = {k: teacher[k] for k in ("segment_ids", "positions") if k in teacher}
            teacher[stats] = csa_pallas.noncompressed_lse(arrays["q"], window_kv, window_size=W,
                                                          implementation="xla", **ids)
    width = N
    if sparse:
        # -1, out-of-range, future and cross-document slots, and duplicates.
        teacher["topk_indices"] = jnp.asarray(rng.integers(-1, N + 3, size=(B, S, K)), jnp.int32)
        width = K
    logits = jnp.asarray(rng.standard_normal((B, S, width)) * 2.0, jnp.float32)
    return logits, arrays, teacher


def reference_results(logits, arrays, teacher, reduction="mean"):
    loss = lambda x: csa_pallas.indexer_distill_loss(x, arrays["q"], arrays["compressed_kv"], implementation="xla",
                                                     reduction=reduction, **teacher)
    value, grad = jax.value_and_grad(loss)(logits)
    target = csa_pallas.teacher_distribution(arrays["q"], arrays["compressed_kv"], implementation="xla", **teacher)
    return value, grad, target


def sharded_results(mesh, axes, logits, arrays, teacher, reduction="mean", **extra):
    kw = dict(axis_kwargs(axes), **teacher, **extra)

    @jax.jit
    def run(x, q, kv):
        loss = lambda y: sharding.sharded_indexer_distill_loss(mesh, y, q, kv, reduction=reduction, **kw)
        value, grad = jax.value_and_grad(loss)(x)
        return value, grad, sharding.sharded_teacher_distribution(mesh, q, kv, **kw)
    return run(logits, arrays["q"], arrays["compressed_kv"])


def assert_close(got, want):
    value, grad, target = got
    ref_value, ref_grad, ref_target = want
    np.testing.assert_allclose(np.asarray(target), np.asarray(ref_target), atol=1e-6, rtol=0)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5, atol=1e-7)
    scale = float(jnp.max(jnp.abs(ref_grad)))
    assert scale > 0
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), atol=1e-5 * scale, rtol=0)


CASES = [
    # (mesh axes, sparse, target, packed, caller stats)
    ({"data": 2, "heads": 4}, False, "joint", True, None),
    ({"data": 2, "heads": 4}, True, "per_head", False, None),
    ({"heads": 8}, False, "per_head", False, None),
    ({"heads": 8}, True, "joint", True, None),
    ({"data": 2, "seq": 4}, False, "joint", True, None),
    ({"data": 2, "seq": 4}, True, "joint", False, None),
    ({"data": 2, "heads": 2, "seq": 2}, False, "per_head", True, None),
    ({"data": 2, "heads": 2, "seq": 2}, True, "joint", True, None),
    ({"seq": 8}, False, "joint", False, None),
    ({"heads": 2, "seq": 4}, False, "joint", True, "noncompressed_lse"),
    ({"data": 2, "seq": 2, "heads": 2}, True, "joint", False, "full_lse"),
]


@pytest.mark.parametrize("axes,sparse,target,packed,stats", CASES,
                         ids=[f"{'x'.join(f'{k}{v}' for k, v in c[0].items())}-{'sparse' if c[1] else 'dense'}-"
                              f"{c[2]}-{'packed' if c[3] else 'one_doc'}{'-' + c[4] if c[4] else ''}" for c in CASES])
def test_sharded_equals_unsharded(axes, sparse, target, packed, stats):
    logits, arrays, teacher = inputs(len(axes) + 7 * sparse + packed, sparse=sparse, target=target, packed=packed,
                                     stats=stats)
    mesh = mesh_of(axes)
    assert_close(sharded_results(mesh, axes, logits, arrays, teacher),
                 reference_results(logits, arrays, teacher))


CONFIG_CASES = {  # mesh axes, sparse, the forced variant, what every teacher layout then holds
    "dense_uncached": ({"data": 2, "seq": 4}, False, {"cache_scores": False}, lambda lay: not lay.cfg.cache_scores),
    "sparse_gather": ({"data": 2, "seq": 4}, True, {"path": "gather", "unroll_slots": False},
                      lambda lay: lay.path == "gather" and not lay.cfg.unroll_slots),
    "sparse_tile_lists_head_sharded": ({"data": 2, "heads": 4}, True, {"path": "visit", "tile_list": True},
                                       lambda lay: lay.path == "visit" and lay.cfg.tile_list),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_a_kernel_config_reaches_every_shard(name, monkeypatch):
    """config= (the teacher kernels' variant) runs on every device: the sharded loss, its gradient and the sharded
    target equal the unsharded reference, and every layout made for a shard's teacher holds the forced variant
    (with a head axis the owned rows' KL takes its own default tiles: its layouts carry no config)."""
    from csa_pallas import ops, ops_sparse
    axes, sparse, config, holds = CONFIG_CASES[name]
    seen = []
    for module, attr in ((ops, "dense_layout"), (ops_sparse, "sparse_layout")):
        def spy(problem, *a, _real=getattr(module, attr), **k):
            layout = _real(problem, *a, **k)
            seen.append((problem.teacher_config is not None, layout))
            return layout
        monkeypatch.setattr(module, attr, spy)
    logits, arrays, teacher = inputs(11 + sparse, sparse=sparse, target="joint", packed=True)
    mesh = mesh_of(axes)
    assert_close(sharded_results(mesh, axes, logits, arrays, teacher, config=config),
                 reference_results(logits, arrays, teacher))
    forced = [layout for has_config, layout in seen if has_config]
    assert forced and all(holds(layout) for layout in forced), seen


def test_a_kernel_config_the_sharded_path_cannot_take_is_a_named_error():
    """A config for the XLA path, or of the wrong type, raises before anything is traced per shard."""
    logits, arrays, teacher = inputs(5, sparse=False, target="joint", packed=False)
    mesh = mesh_of({"data": 2, "seq": 4})
    call = lambda **kw: sharding.sharded_indexer_distill_loss(mesh, logits, arrays["q"], arrays["compressed_kv"],
                                                              **axis_kwargs({"data": 2, "seq": 4}), **teacher, **kw)
    with pytest.raises(ValueError, match="^config: "):
        call(implementation="xla", config={"walk": "plain"})
    with pytest.raises(TypeError, match="^config: expected None, a TeacherConfig or a dict"):
        call(config=["walk", "plain"])


@pytest.mark.parametrize("reduction", ["none", "sum", "mean_all"])
def test_reductions_are_global(reduction):
    axes = {"data": 2, "heads": 2, "seq": 2}
    logits, arrays, teacher = inputs(3, sparse=False, target="joint", packed=True)
    mesh = mesh_of(axes)
    kw = dict(axis_kwargs(axes), **teacher)
    weights = jax.random.uniform(jax.random.PRNGKey(1), (B, S)) if reduction == "none" else 1.0

    def sharded(x):
        return jnp.sum(weights * sharding.sharded_indexer_distill_loss(mesh, x, arrays["q"], arrays["compressed_kv"],
                                                                       reduction=reduction, scale=0.3, **kw))

    def unsharded(x):
        return jnp.sum(weights * csa_pallas.indexer_distill_loss(x, arrays["q"], arrays["compressed_kv"],
                                                                 reduction=reduction, scale=0.3,
                                                                 implementation="xla", **teacher))
    got = jax.jit(jax.value_and_grad(sharded))(logits)
    want = jax.value_and_grad(unsharded)(logits)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-5 * float(jnp.max(jnp.abs(want[1]))))


def test_named_sharding_inputs_keep_their_sharding_and_head_chunk():
    axes = {"data": 2, "heads": 4}
    mesh = mesh_of(axes)
    logits, arrays, teacher = inputs(5, sparse=False, target="joint", packed=False)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    logits = put(logits, P("data", None, None))
    q = put(arrays["q"], P("data", None, "heads", None))
    kv = put(arrays["compressed_kv"], P("data", None, None))
    loss = lambda x: sharding.sharded_indexer_distill_loss(mesh, x, q, kv, head_chunk=1, **axis_kwargs(axes),
                                                           **teacher)
    value, grad = jax.jit(jax.value_and_grad(loss))(logits)
    assert grad.sharding.is_equivalent_to(logits.sharding, grad.ndim)
    ref_value, ref_grad, _ = reference_results(logits, arrays, teacher)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), atol=1e-5 * float(jnp.max(jnp.abs(ref_grad))))


def test_teacher_inputs_get_zero_gradients_when_sharded():
    axes = {"heads": 2, "seq": 4}
    mesh = mesh_of(axes)
    logits, arrays, teacher = inputs(6, sparse=False, target="joint", packed=False)

    def loss(q, kv, window_kv, sinks):
        kw = dict(teacher, window_kv=window_kv, sinks=sinks)
        return sharding.sharded_indexer_distill_loss(mesh, logits, q, kv, **axis_kwargs(axes), **kw)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(arrays["q"], arrays["compressed_kv"],
                                                           teacher["window_kv"], teacher["sinks"])
    for g in grads:
        assert not np.any(np.asarray(g))


def test_xla_implementation_is_partitioned_by_xla():
    axes = {"data": 2, "heads": 2, "seq": 2}
    mesh = mesh_of(axes)
    logits, arrays, teacher = inputs(8, sparse=True, target="joint", packed=True)
    assert_close(sharded_results(mesh, axes, logits, arrays, teacher, implementation="xla"),
                 reference_results(logits, arrays, teacher))


def _bad_call(**overrides):
    mesh = mesh_of({"data": 2, "heads": 2, "seq": 2})
    if mesh.size < 8:
        pytest.skip("the messages checked here name the sizes of a 2x2x2 mesh; this host has fewer devices")
    logits, arrays, teacher = inputs(0, sparse=False, target="per_head", packed=False)
    kw = dict(batch_axes="data", head_axis="heads", seq_axis="seq", **teacher)
    kw.update(overrides)
    q = kw.pop("q", arrays["q"])
    mesh = kw.pop("mesh", mesh)
    seq, blocks = q.shape[1], q.shape[1] // M
    sharding.sharded_indexer_distill_loss(mesh, logits[:, :seq, :blocks], q, arrays["compressed_kv"][:, :blocks], **kw)


@pytest.mark.parametrize("overrides,error,match", [
    (dict(mesh="not a mesh"), TypeError, "mesh: expected a jax.sharding.Mesh"),
    (dict(head_axis="model"), ValueError, "head_axis: 'model' is not an axis of the mesh"),
    (dict(seq_axis="heads"), ValueError, "seq_axis: mesh axis 'heads' is used for two dimensions"),
    (dict(batch_axes=3), TypeError, "batch_axes: expected a mesh axis name"),
    (dict(head_chunk=8), ValueError, r"head_chunk: expected a divisor of the heads per shard H/2=4, got 8"),
    (dict(head_chunk=3), ValueError, "head_chunk"),
    (dict(q=jnp.zeros((B, 21, H, D))), ValueError, "seq_axis: the sequence length S=21 must be a multiple"),
    (dict(q=jnp.zeros((B, 18, H, D))), ValueError, "head_axis: the head shards split the KL rows"),
])
def test_bad_mesh_arguments_raise_named_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        _bad_call(**overrides)


def test_sequence_shards_shorter_than_the_window_halo_are_rejected():
    mesh = mesh_of({"seq": 8})
    logits, arrays, teacher = inputs(0, sparse=False, target="joint", packed=False)
    teacher["window_size"] = 32  # 128 / 8 = 16 tokens per shard < W - 1 = 31
    with pytest.raises(ValueError, match="seq_axis: each of the 8 sequence shards holds 16 tokens"):
        sharding.sharded_indexer_distill_loss(mesh, logits, arrays["q"], arrays["compressed_kv"], seq_axis="seq",
                                              **teacher)


def test_batch_must_divide_over_the_batch_axes():
    mesh = mesh_of({"data": 8})
    logits, arrays, teacher = inputs(0, sparse=False, target="per_head", packed=False)
    with pytest.raises(ValueError,
                       match="batch_axes: the batch B=2 must be a multiple of the number of batch shards 8"):
        sharding.sharded_indexer_distill_loss(mesh, logits, arrays["q"], arrays["compressed_kv"], batch_axes="data",
                                              **teacher)


def test_mesh_axes_the_loss_does_not_use_replicate_without_double_counting():
    # e.g. MaxText's 'stage'/'expert' axes: every device along them computes the same rows; the logits' gradient must
    # not be summed over them.
    axes = {"data": 2, "extra": 4}
    mesh = mesh_of(axes)
    logits, arrays, teacher = inputs(9, sparse=False, target="per_head", packed=True)
    loss = lambda x: sharding.sharded_indexer_distill_loss(mesh, x, arrays["q"], arrays["compressed_kv"],
                                                           batch_axes="data", **teacher)
    value, grad = jax.jit(jax.value_and_grad(loss))(logits)
    ref_value, ref_grad, _ = reference_results(logits, arrays, teacher)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), atol=1e-5 * float(jnp.max(jnp.abs(ref_grad))))


@pytest.mark.parametrize("sparse", [False, True])
def test_a_nan_query_row_is_nan_on_a_head_sharded_mesh(sparse):
    """SPEC §3 under head sharding: a NaN in one query row makes exactly that row's KL NaN (reduction="none"),
    the others equal to the unsharded reference. The reduce-scattered sparse head sums once read the NaN slots as
    empty (`ops_sparse.normalize_slots`), so the row dropped out of the loss as a finite 0."""
    axes = {"data": 2, "heads": 4}
    logits, arrays, teacher = inputs(5, sparse=sparse, target="per_head", packed=False)
    arrays = dict(arrays, q=arrays["q"].at[0, 20, 1, 3].set(jnp.nan))
    mesh = mesh_of(axes)
    rows = jax.jit(lambda x: sharding.sharded_indexer_distill_loss(
        mesh, x, arrays["q"], arrays["compressed_kv"], reduction="none", **axis_kwargs(axes), **teacher))(logits)
    want = csa_pallas.indexer_distill_loss(logits, arrays["q"], arrays["compressed_kv"], reduction="none",
                                           implementation="xla", **teacher)
    nan = np.isnan(np.asarray(rows))
    assert nan[0, 20] and nan.sum() == 1
    np.testing.assert_array_equal(nan, np.isnan(np.asarray(want)))
    np.testing.assert_allclose(np.asarray(rows)[~nan], np.asarray(want)[~nan], rtol=1e-5, atol=1e-6)
