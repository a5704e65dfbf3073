"""The plain ops on sharded inputs (csa_pallas.placement): they enter the sharded path by themselves, on Auto meshes
(declared layout or Flax logical axis rules), Explicit meshes and eager committed arrays, on 8 CPU host devices;
equal to the unsharded reference. Layouts they cannot serve raise csa_pallas errors that say what to do."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import csa_pallas
import platform_select
from csa_pallas import placement
from csa_pallas.nn import CSAIndexerLossLinen
from test_sharding import M, W, assert_close, inputs, reference_results

# MaxText-style meshes: (mesh axes, q's spec entries (batch, seq, heads)).
MESHES = {
    "data_fsdp_tensor": ({"data": 2, "fsdp": 2, "tensor": 2}, (("data", "fsdp"), None, "tensor")),
    "fsdp_context": ({"fsdp": 2, "context": 4}, (("fsdp",), "context", None)),
    "data_tensor_context": ({"data": 2, "tensor": 2, "context": 2}, (("data",), "context", "tensor")),
}


def make_mesh(axes: dict, axis_type=AxisType.Auto):
    """A mesh of `axes` fitted to this host's devices; axis_type: one AxisType for every axis, or one per axis."""
    sizes = platform_select.fit_mesh_axes(axes, len(jax.devices()))
    types = axis_type if isinstance(axis_type, tuple) else (axis_type,) * len(sizes)
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=types)


def placed(mesh, layout, logits, arrays, teacher):
    batch, seq, heads = layout
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    q = put(arrays["q"], P(batch, seq, heads, None))
    kv = put(arrays["compressed_kv"], P(batch, None, None))
    x = put(logits, P(batch, seq, None))
    rows = lambda v: put(v, P(batch, seq, *([None] * (v.ndim - 2))))
    teacher = {k: rows(v) if isinstance(v, jax.Array) and v.ndim >= 2 and v.shape[1] == x.shape[1] else v
               for k, v in teacher.items()}
    return x, q, kv, teacher


def plain_results(x, q, kv, teacher, **kw):
    def run(x, q, kv, teacher):
        loss = lambda y: csa_pallas.indexer_distill_loss(y, q, kv, **teacher, **kw)
        value, grad = jax.value_and_grad(loss)(x)
        return value, grad, csa_pallas.teacher_distribution(q, kv, **teacher, **kw)
    statics = {k: v for k, v in teacher.items() if not isinstance(v, jax.Array)}
    arrays = {k: v for k, v in teacher.items() if isinstance(v, jax.Array)}
    return jax.jit(lambda x, q, kv, a: run(x, q, kv, dict(a, **statics)))(x, q, kv, arrays)


CASES = [(name, sparse, target) for name in MESHES for sparse, target in ((False, "joint"), (True, "per_head"))]


@pytest.mark.parametrize("name,sparse,target", CASES, ids=[f"{c[0]}-{'sparse' if c[1] else 'dense'}-{c[2]}"
                                                            for c in CASES])
def test_auto_mesh_with_declared_layout_equals_unsharded(name, sparse, target):
    axes, layout = MESHES[name]
    mesh = make_mesh(axes)
    logits, arrays, teacher = inputs(11, sparse=sparse, target=target, packed=sparse, batch=4)
    x, q, kv, teacher_placed = placed(mesh, layout, logits, arrays, teacher)
    batch, seq, heads = layout
    with csa_pallas.activation_sharding(batch=batch, heads=heads, seq=seq):
        got = plain_results(x, q, kv, teacher_placed, implementation="pallas")
    assert_close(got, reference_results(logits, arrays, teacher))
    assert got[1].sharding.spec == P(batch, seq, None)  # the gradient keeps the logits' layout


EXPLICIT = [  # every sharding the entry point supports, each once; dense and sparse alternate
    ((("data",), None, None), False), ((("data",), None, "heads"), True), ((None, "seq", None), False),
    ((("data",), "seq", "heads"), True)]


@pytest.mark.parametrize("layout,sparse", EXPLICIT, ids=["batch-dense", "batch_heads-sparse", "seq-dense",
                                                         "all-sparse"])
def test_explicit_mesh_reads_the_sharding_from_the_types(layout, sparse):
    mesh = make_mesh({"data": 2, "heads": 2, "seq": 2}, AxisType.Explicit)
    logits, arrays, teacher = inputs(12, sparse=sparse, target="joint", packed=True)
    x, q, kv, teacher_placed = placed(mesh, layout, logits, arrays, teacher)
    want = reference_results(logits, arrays, teacher)
    with jax.set_mesh(mesh):
        assert_close(plain_results(x, q, kv, teacher_placed, implementation="pallas"), want)
        assert_close(plain_results(x, q, kv, teacher_placed, implementation="xla"), want)


def test_flax_logical_axis_rules_give_the_layout_and_eager_arrays_give_their_own():
    axes, layout = MESHES["data_tensor_context"]
    mesh = make_mesh(axes)
    logits, arrays, teacher = inputs(13, sparse=False, target="per_head", packed=False)
    x, q, kv, teacher_placed = placed(mesh, layout, logits, arrays, teacher)
    want = reference_results(logits, arrays, teacher)
    rules = [("activation_batch", ("data", "fsdp")), ("activation_heads", ("tensor",)),
             ("activation_length", ("context",)), ("embed", None)]
    with nn.logical_axis_rules(rules):
        assert_close(plain_results(x, q, kv, teacher_placed), want)
    # Outside jit the committed arrays carry their sharding: no declaration needed (the teacher alone: eager
    # dispatch of the whole loss and gradient is slow in the interpreter).
    target = csa_pallas.teacher_distribution(q, kv, **teacher_placed)
    np.testing.assert_allclose(np.asarray(target), np.asarray(want[2]), atol=1e-6, rtol=0)
    assert target.sharding.spec[:2] == P(layout[0], (layout[1], layout[2]))[:2]  # rows split over (seq, heads)


def test_flax_wrapper_without_mesh_follows_the_inputs():
    axes, layout = MESHES["data_fsdp_tensor"]
    mesh = make_mesh(axes)
    logits, arrays, teacher = inputs(14, sparse=True, target="per_head", packed=False, batch=4)
    x, q, kv, teacher_placed = placed(mesh, layout, logits, arrays, teacher)
    module = CSAIndexerLossLinen(compress_ratio=M, window_size=W, target="per_head", implementation="pallas")
    rules = [("activation_batch", ("data", "fsdp")), ("activation_heads", "tensor"), ("activation_length", None)]

    @jax.jit
    def step(x, q, kv, idx):
        with nn.logical_axis_rules(rules):
            return jax.value_and_grad(lambda y: module.apply({}, y, q, kv, topk_indices=idx))(x)
    value, grad = step(x, q, kv, teacher_placed["topk_indices"])
    want = reference_results(logits, arrays, teacher)
    np.testing.assert_allclose(float(value), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want[1]), atol=1e-5 * float(jnp.max(jnp.abs(want[1]))))


def _call_on(mesh, layout, **kw):
    logits, arrays, teacher = inputs(15, sparse=False, target="per_head", packed=False)
    x, q, kv, _ = placed(mesh, layout, logits, arrays, teacher)
    return jax.jit(lambda x, q, kv: csa_pallas.indexer_distill_loss(x, q, kv, compress_ratio=M, window_size=W,
                                                                    target="per_head", **kw))(x, q, kv)


def test_undeclared_auto_layouts_and_unservable_shardings_raise_named_errors():
    mesh = make_mesh({"data": 2, "heads": 2, "seq": 2})
    with pytest.raises(ValueError, match=r"^q: the inputs live on a mesh of \d devices .* Auto axes.*"
                                         r"csa_pallas.activation_sharding"):
        _call_on(mesh, (("data",), None, None))
    explicit = make_mesh({"data": 2, "heads": 2, "seq": 2}, AxisType.Explicit)
    logits, arrays, teacher = inputs(15, sparse=False, target="per_head", packed=False)
    q = jax.device_put(arrays["q"], NamedSharding(explicit, P(None, None, None, "heads")))
    with jax.set_mesh(explicit), pytest.raises(ValueError, match=r"^q: q is sharded .* the head dimension D cannot"):
        jax.jit(lambda q: csa_pallas.teacher_distribution(q, arrays["compressed_kv"], compress_ratio=M,
                                                          target="per_head"))(q)
    q = jax.device_put(arrays["q"], NamedSharding(explicit, P(None, ("seq", "heads"), None, None)))
    with jax.set_mesh(explicit), pytest.raises(ValueError, match=r"^q: .*split over one mesh axis only; use "
                                                                 r"csa_pallas.sharded_indexer_distill_loss"):
        jax.jit(lambda q: csa_pallas.teacher_distribution(q, arrays["compressed_kv"], compress_ratio=M,
                                                          target="per_head"))(q)
    with csa_pallas.activation_sharding(batch="model"), pytest.raises(
            ValueError, match=r"^csa_pallas.activation_sharding: batch names mesh axis 'model'"):
        _call_on(mesh, (None, None, None))
    with pytest.raises(ValueError, match=r"^heads: one mesh axis at most"):
        csa_pallas.activation_sharding(heads=("heads", "seq")).__enter__()
    # A derived layout the shapes cannot take names the layout and the entry point.
    with csa_pallas.activation_sharding(batch=("data", "heads", "seq")), pytest.raises(
            ValueError, match=r"^batch_axes: the batch B=2 must be a multiple .*the op derived this layout"):
        _call_on(mesh, (None, None, None))


def test_a_user_shard_map_runs_the_op_per_device_with_or_without_check_vma():
    mesh = make_mesh({"data": 2, "heads": 2, "seq": 2})
    logits, arrays, teacher = inputs(16, sparse=False, target="per_head", packed=False)

    def local(x, q, kv):
        return jax.lax.psum(csa_pallas.indexer_distill_loss(x, q, kv, compress_ratio=M, window_size=W,
                                                            target="per_head", reduction="sum"), "data")
    spec = (P("data"),) * 3
    run = lambda check: jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=check))(
        logits, arrays["q"], arrays["compressed_kv"])
    want = csa_pallas.indexer_distill_loss(logits, arrays["q"], arrays["compressed_kv"], compress_ratio=M,
                                           window_size=W, target="per_head", reduction="sum", implementation="xla")
    np.testing.assert_allclose(float(run(False)), float(want), rtol=1e-5)
    assert float(run(True)) == float(run(False))  # tests/test_check_vma.py: every op, gradients, v5p

    def nested(x, q, kv):
        return csa_pallas.sharded_indexer_distill_loss(mesh, x, q, kv, batch_axes="data", compress_ratio=M,
                                                       window_size=W, target="per_head")
    with pytest.raises(ValueError, match=r"^mesh: the sharded op is called inside a jax.shard_map"):
        jax.jit(jax.shard_map(nested, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False))(
            logits, arrays["q"], arrays["compressed_kv"])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_window_lse_op_partitions_itself(axis_type):
    mesh = make_mesh({"data": 2, "heads": 2, "seq": 2}, axis_type)
    logits, arrays, teacher = inputs(17, sparse=False, target="joint", packed=True)
    ids = dict(segment_ids=teacher["segment_ids"], positions=teacher["positions"])
    want = csa_pallas.noncompressed_lse(arrays["q"], teacher["window_kv"], sinks=teacher["sinks"], window_size=W,
                                        implementation="xla", **ids)
    layout = (("data",), "seq", "heads")
    _, q, _, placed_teacher = placed(mesh, layout, logits, arrays, dict(teacher, **ids))
    run = jax.jit(lambda q, kv, sinks, seg, pos: csa_pallas.noncompressed_lse(
        q, kv, sinks=sinks, window_size=W, implementation="pallas", segment_ids=seg, positions=pos))
    args = (q, placed_teacher["window_kv"], teacher["sinks"], placed_teacher["segment_ids"],
            placed_teacher["positions"])
    if axis_type == AxisType.Explicit:
        with jax.set_mesh(mesh):
            got = run(*args)
    else:
        with csa_pallas.activation_sharding(batch="data", heads="heads", seq="seq"):
            got = run(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-6)


def test_a_kernel_config_on_sharded_inputs_reaches_the_sharded_path(monkeypatch):
    """config= (a kernel variant) given with sharded inputs goes with them into the sharded path, for the plain op
    and the fused one: the results equal the unsharded op's with the same config, and the shards' teacher layouts
    hold the forced variant (until 2026-12-06 this was a ValueError naming config)."""
    from csa_pallas import ops
    from student_cases import make_student_case
    seen = []
    real = ops.dense_layout
    monkeypatch.setattr(ops, "dense_layout", lambda problem, *a, **k: seen.append(problem.teacher_config)
                        or real(problem, *a, **k))
    mesh = make_mesh({"data": 2}, AxisType.Explicit)
    c, kw = make_student_case(31, batch=2, seq=32)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))))
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((2, 32, 8)), jnp.float32)
    config = {"cache_scores": False}
    plain = lambda x, q, kv, iq, ik, iw: csa_pallas.indexer_distill_loss(x, q, kv, **kw, target="joint",
                                                                         config=config)
    fused = lambda x, q, kv, iq, ik, iw: csa_pallas.fused_indexer_distill_loss(iq, ik, iw, q, kv, **kw,
                                                                                target="joint", config=config)
    args = (logits, c["q"], c["compressed_kv"], c["index_q"], c["index_k"], c["index_weights"])
    for call in (plain, fused):
        want = call(*args)
        seen.clear()
        with jax.set_mesh(mesh):
            got = jax.jit(call)(*map(put, args))
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
        assert seen and all(dict(cfg or ()) == config for cfg in seen), seen


def _mixed_mesh():
    return make_mesh({"data": 2, "heads": 2, "seq": 2}, (AxisType.Explicit, AxisType.Auto, AxisType.Auto))


@pytest.mark.parametrize("sparse,target", [(False, "joint"), (True, "per_head")], ids=["dense", "sparse"])
def test_mesh_mixing_explicit_and_auto_axes_reads_the_types_and_the_declaration(sparse, target):
    """A mesh whose "data" axis is Explicit and "heads" / "seq" Auto (`jax.make_mesh(..., axis_types=...)`): q's
    type gives the batch over "data", the declared layout the Auto axes (its "data" left to the type); loss,
    gradient and teacher equal the reference. Undeclared, a ValueError that names both halves (until 2026-12-08
    any mixed mesh was one)."""
    mesh = _mixed_mesh()
    logits, arrays, teacher = inputs(17, sparse=sparse, target=target, packed=sparse, batch=4)
    x, q, kv, teacher_placed = placed(mesh, (("data",), "seq", "heads"), logits, arrays, teacher)
    with jax.set_mesh(mesh):
        with csa_pallas.activation_sharding(batch="data", heads="heads", seq="seq"):
            got = plain_results(x, q, kv, teacher_placed, implementation="pallas")
            assert_close(plain_results(x, q, kv, teacher_placed, implementation="xla"),
                         reference_results(logits, arrays, teacher))
        with pytest.raises(ValueError, match=r"^q: the mesh .* mixes Explicit and Auto axes: q's type gives the "
                                             r"layout over the Explicit ones .*Auto ones \['heads', 'seq'\]"):
            plain_results(x, q, kv, teacher_placed, implementation="pallas")
    assert_close(got, reference_results(logits, arrays, teacher))
    resolved = []
    with jax.set_mesh(mesh), csa_pallas.activation_sharding(batch="data", heads="heads", seq="seq"):
        jax.jit(lambda q: resolved.append(placement.resolve(q)) or q).trace(q)
    assert (resolved[0].batch_axes, resolved[0].seq_axis, resolved[0].head_axis) == (("data",), "seq", "heads")


def test_inside_jax_auto_axes_on_an_explicit_mesh():
    """`jax.sharding.auto_axes(f, axes="heads")` on an all-Explicit mesh turns "heads" Auto inside f: the op takes
    "data" from q's type and "heads" from Flax logical axis rules (MaxText's names)."""
    mesh = make_mesh({"data": 2, "heads": 2, "seq": 2}, AxisType.Explicit)
    logits, arrays, teacher = inputs(18, sparse=False, target="per_head", packed=False, batch=4)
    x, q, kv, _ = placed(mesh, (("data",), None, None), logits, arrays, teacher)
    rules = [("activation_batch", ("data", "fsdp")), ("activation_heads", "heads"), ("activation_length", None)]
    resolved = []

    def loss_rows(x, q, kv):
        with nn.logical_axis_rules(rules):
            resolved.append(placement.resolve(q))
            return csa_pallas.indexer_distill_loss(x, q, kv, compress_ratio=M, window_size=W, target="per_head",
                                                   reduction="none", implementation="pallas")
    with jax.set_mesh(mesh):
        got = jax.jit(jax.sharding.auto_axes(loss_rows, axes="heads", out_sharding=P("data")))(x, q, kv)
    assert (resolved[0].batch_axes, resolved[0].head_axis) == (("data",), "heads"), resolved
    want = csa_pallas.indexer_distill_loss(logits, arrays["q"], arrays["compressed_kv"], compress_ratio=M,
                                           window_size=W, target="per_head", reduction="none", implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_fused_op_on_a_mesh_mixing_explicit_and_auto_axes():
    """The fused op (loss and its three gradients) on the mixed mesh: batch over the Explicit "data", heads over
    the declared Auto "heads"."""
    from student_cases import make_student_case
    mesh = _mixed_mesh()
    c, kw = make_student_case(31, batch=2, seq=32)
    args = (c["index_q"], c["index_k"], c["index_weights"], c["q"], c["compressed_kv"])
    specs = (P("data"), P("data"), P("data"), P("data", None, "heads"), P("data"))

    def fused(iq, ik, iw, q, kv, implementation="pallas"):
        return jax.value_and_grad(lambda *student: csa_pallas.fused_indexer_distill_loss(
            *student, q, kv, **kw, target="joint", implementation=implementation), argnums=(0, 1, 2))(iq, ik, iw)
    with jax.set_mesh(mesh), csa_pallas.activation_sharding(batch="data", heads="heads"):
        got = jax.jit(fused)(*[jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(fused(*args, implementation="xla")), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
