"""The ops inside a user's `jax.shard_map` that is manual over some mesh axes only (`axis_names=`, e.g. a pipeline's
"stage"): the manual axis has split the arrays already, and the op shards over the other axes (Auto with a declared
layout or Flax rules, or Explicit) in a shard_map nested over them (`placement.shard_map`). On 8 CPU host devices,
mesh {stage: 2, data: 2, heads: 2}; every result, gradients included, equals the XLA reference run on the whole
arrays outside any shard_map, with the user's check_vma True (JAX's default; the nested shard_map then carries its
own VJP, JAX 0.10.2 cannot transpose it) or False."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import csa_pallas
from csa_pallas import aot
from aot_cases import require_libtpu
from test_check_vma import M, W, _inputs, _scanned_remat, _vmapped
from test_placement import make_mesh

B = 4  # batch rows: 2 stages x 2 data shards
STAGE = P("stage")  # the user's shard_map splits the batch over the pipeline stages


def _explicit_rows(q):
    """On Explicit axes the user's code gives q its layout: batch over "data", heads over "heads" (those of them
    that are Explicit: a type names no Auto axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    if not explicit:
        return q
    typed = lambda name: name if name in explicit else None
    return jax.sharding.reshard(q, P(typed("data"), None, typed("heads"), None))


def _loss_rows(sparse, implementation="pallas"):
    """The per-row loss and its VJP with a data-dependent cotangent (joint target, packed, loss_mask)."""
    def fn(x, q, kv, window, sinks, topk, segments, positions, loss_mask):
        loss, vjp = jax.vjp(lambda y: csa_pallas.indexer_distill_loss(
            y, _explicit_rows(q), kv, window_kv=window, sinks=sinks, topk_indices=topk if sparse else None,
            segment_ids=segments, positions=positions, loss_mask=loss_mask, compress_ratio=M, window_size=W,
            target="joint", reduction="none", implementation=implementation), x)
        return loss, vjp(jnp.cos(loss))[0]
    return fn


def _fused_rows(sparse, implementation="pallas"):
    def fn(iq, ik, iw, q, kv, topk):
        loss, vjp = jax.vjp(lambda *student: csa_pallas.fused_indexer_distill_loss(
            *student, _explicit_rows(q), kv, topk_indices=topk if sparse else None, compress_ratio=M,
            target="per_head", reduction="none", implementation=implementation), iq, ik, iw)
        return loss, vjp(jnp.cos(loss))
    return fn


LOSS_ARGS = ("logits", "q", "kv", "window", "sinks", "topk", "segments", "positions", "loss_mask")
SPARSE_ARGS = ("sparse_logits",) + LOSS_ARGS[1:]
FUSED_ARGS = ("index_q", "index_k", "index_w", "q", "kv", "topk")
CASES = {  # name: (fn, the XLA reference fn, input names, in_specs); sinks replicated over the stages
    "dense_joint_packed": (_loss_rows(False), _loss_rows(False, "xla"), LOSS_ARGS, (STAGE,) * 4 + (P(),) + (STAGE,) * 4),
    "sparse_joint_packed": (_loss_rows(True), _loss_rows(True, "xla"), SPARSE_ARGS,
                            (STAGE,) * 4 + (P(),) + (STAGE,) * 4),
    "fused_sparse": (_fused_rows(True), _fused_rows(True, "xla"), FUSED_ARGS, (STAGE,) * 6),
}


def _in_partial_shard_map(fn, mesh, in_specs, check_vma, declared=True):
    """fn in a jax.shard_map manual over "stage" only, its results split over "stage" (batch first)."""
    def body(*args):
        if not declared or AxisType.Auto not in set(mesh.axis_types):
            return fn(*args)
        with csa_pallas.activation_sharding(batch="data", heads="heads"):
            return fn(*args)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=STAGE, axis_names={"stage"},
                         check_vma=check_vma)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "unchecked"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradient_inside_a_shard_map_manual_over_stage_equal_the_reference(name, axis_type, check_vma):
    fn, reference_fn, names, in_specs = CASES[name]
    mesh = make_mesh({"stage": 2, "data": 2, "heads": 2}, axis_type)
    arrays = _inputs(1, batch=B)
    args = [arrays[n] for n in names]
    with jax.set_mesh(mesh):
        got = jax.jit(_in_partial_shard_map(fn, mesh, in_specs, check_vma=check_vma))(*args)
        traced = jax.jit(_in_partial_shard_map(fn, mesh, in_specs, check_vma=check_vma)).trace(*args).jaxpr
    _assert_close(got, jax.jit(reference_fn)(*args))
    # The op's own shard_maps, forward and backward, nested over the axes left automatic (with check_vma the
    # backward is the op's own, without it JAX's transpose).
    nested = [e for e in traced.eqns[0].params["jaxpr"].eqns if e.primitive.name == "shard_map"]
    assert len(nested) == 2
    assert all(set(e.params["newly_manual_axes"]) == {"data", "heads"} for e in nested)


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "unchecked"])
def test_free_axes_mixing_explicit_and_auto(check_vma):
    """The free axes mixing Explicit ("data", from q's type) and Auto ("heads", declared): the sparse joint loss's
    rows and gradient equal the reference (until 2026-12-08 a ValueError, as outside a shard_map)."""
    fn, reference_fn, names, in_specs = CASES["sparse_joint_packed"]
    mesh = make_mesh({"stage": 2, "data": 2, "heads": 2}, (AxisType.Explicit, AxisType.Explicit, AxisType.Auto))
    args = [_inputs(10, batch=B)[n] for n in names]
    with jax.set_mesh(mesh):
        got = jax.jit(_in_partial_shard_map(fn, mesh, in_specs, check_vma=check_vma))(*args)
    _assert_close(got, jax.jit(reference_fn)(*args))


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "unchecked"])
def test_fused_mean_loss_and_its_three_gradients_per_stage(check_vma):
    """reduction="mean" (a scalar per stage, the non-empty-row flags a boolean output of the op's shard_map) and
    value_and_grad of the fused sparse op: each stage's loss and gradients are the reference's on its rows."""
    mesh = make_mesh({"stage": 2, "data": 2, "heads": 2})
    a = _inputs(7, batch=B)

    def fused(iq, ik, iw, q, kv, topk, implementation="pallas"):
        loss = lambda *student: csa_pallas.fused_indexer_distill_loss(
            *student, q, kv, topk_indices=topk, compress_ratio=M, target="per_head", implementation=implementation)
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
        return value[None], grads
    args = [a[n] for n in FUSED_ARGS]
    mapped = _in_partial_shard_map(fused, mesh, (STAGE,) * 6, check_vma=check_vma)
    with jax.set_mesh(mesh):
        got = jax.jit(mapped)(*args)
    per_stage = [fused(*[x[2 * s:2 * s + 2] for x in args], implementation="xla") for s in range(2)]
    _assert_close(got, jax.tree.map(lambda *parts: jnp.concatenate(parts), *per_stage))


@pytest.mark.parametrize("fn", [_scanned_remat, _vmapped], ids=["scan_remat", "vmap"])
def test_scanned_remat_and_vmap_inside_a_check_vma_shard_map_manual_over_stage(fn):
    """The model patterns around the op's own VJP: a scan of rematted layers and a vmap, per stage."""
    mesh = make_mesh({"stage": 2, "data": 2, "heads": 2})
    a = _inputs(8, batch=B)
    args = [a[n] for n in ("sparse_logits", "q", "kv", "topk")]
    if fn is _vmapped:  # two problems per batch row, the vmapped axis second
        args = [jnp.stack([x, x[::-1]], axis=1) for x in args]
    grads_spec = P(None, "stage") if fn is _scanned_remat else STAGE

    def body(*local):
        with csa_pallas.activation_sharding(batch="data", heads="heads"):
            return fn(*local)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(STAGE,) * 4, out_specs=(STAGE, grads_spec),
                           axis_names={"stage"}, check_vma=True)
    with jax.set_mesh(mesh):
        values, grads = jax.jit(mapped)(*args)
    for stage in range(2):
        rows = slice(2 * stage, 2 * stage + 2)
        want_value, want_grads = fn(*[x[rows] for x in args], implementation="xla")
        _assert_close((values[stage], grads[:, rows] if fn is _scanned_remat else grads[rows]),
                      (want_value[0], want_grads))


def test_teacher_window_lse_and_flax_rules_inside_a_shard_map_manual_over_stage():
    """The teacher and the window LSE under Flax logical axis rules that also name the manual axis (MaxText's
    rules list every batch axis): "stage" has split the arrays already, so the op shards over "data" only."""
    mesh = make_mesh({"stage": 2, "data": 2, "heads": 2})
    a = _inputs(3, batch=B)

    def ops(q, kv, topk, window, sinks):
        rules = (("activation_batch", ("stage", "data")), ("activation_heads", "heads"))
        with nn.logical_axis_rules(rules):
            return (csa_pallas.teacher_distribution(q, kv, topk_indices=topk, compress_ratio=M, target="per_head"),
                    csa_pallas.noncompressed_lse(q, window, sinks=sinks, window_size=W))
    args = (a["q"], a["kv"], a["topk"], a["window"], a["sinks"])
    mapped = _in_partial_shard_map(ops, mesh, (STAGE,) * 4 + (P(),), check_vma=True, declared=False)
    with jax.set_mesh(mesh):
        got = jax.jit(mapped)(*args)
    want = (csa_pallas.teacher_distribution(a["q"], a["kv"], topk_indices=a["topk"], compress_ratio=M,
                                            target="per_head", implementation="xla"),
            csa_pallas.noncompressed_lse(a["q"], a["window"], sinks=a["sinks"], window_size=W, implementation="xla"))
    _assert_close(got, want)


def test_sharded_entry_point_inside_a_shard_map_manual_over_stage():
    """`sharded_indexer_distill_loss(mesh, ...)` inside the user's shard_map takes the axes the user left
    automatic; naming the manual axis is a ValueError naming the argument."""
    mesh = make_mesh({"stage": 2, "data": 2, "heads": 2})
    a = _inputs(4, batch=B)

    def loss(x, q, kv, batch_axes):
        return csa_pallas.sharded_indexer_distill_loss(mesh, x, q, kv, batch_axes=batch_axes, head_axis="heads",
                                                       compress_ratio=M, target="per_head", reduction="none")
    args = (a["logits"], a["q"], a["kv"])
    with jax.set_mesh(mesh):
        got = jax.jit(_in_partial_shard_map(lambda *x: loss(*x, "data"), mesh, (STAGE,) * 3, False, False))(*args)
        with pytest.raises(ValueError, match=r"^batch_axes: mesh axis 'stage' is manual in the jax.shard_map"):
            jax.jit(_in_partial_shard_map(lambda *x: loss(*x, ("stage", "data")), mesh, (STAGE,) * 3, False,
                                          False)).trace(*args)
    _assert_close(got, csa_pallas.indexer_distill_loss(*args, compress_ratio=M, target="per_head",
                                                       reduction="none", implementation="xla"))


def test_jax_smap_over_stage_loss_and_gradient():
    """`jax.smap` (a shard_map manual over one axis, check_vma on) over the stages, the op inside sharding its rows
    over "data" and "heads": the loss and its gradient equal the reference's."""
    mesh = make_mesh({"stage": 2, "data": 2, "heads": 2})
    a = _inputs(6, batch=B)

    def loss(x, q, kv):
        with csa_pallas.activation_sharding(batch="data", heads="heads"):
            return csa_pallas.indexer_distill_loss(x, q, kv, compress_ratio=M, target="per_head", reduction="none")
    staged = jax.smap(loss, in_axes=0, out_axes=0, axis_name="stage")
    value_and_grad = lambda f: jax.jit(lambda x, q, kv: jax.vjp(lambda y: f(y, q, kv), x)[1](jnp.cos(f(x, q, kv))))
    args = (a["logits"], a["q"], a["kv"])
    with jax.set_mesh(mesh):
        got = jax.jit(staged)(*args), value_and_grad(staged)(*args)
    reference = functools.partial(csa_pallas.indexer_distill_loss, compress_ratio=M, target="per_head",
                                  reduction="none", implementation="xla")
    _assert_close(got, (reference(*args), value_and_grad(reference)(*args)))


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "unchecked"])
def test_partial_manual_shard_map_compiles_for_v5p(check_vma):
    """Mosaic kernels in the op's nested shard_map over "data", inside a shard_map manual over "stage"
    (v5p:2x2x1), loss and gradient: with check_vma the op's own forward and backward shard_maps."""
    require_libtpu()
    mesh = aot.tpu_mesh("v5p:2x2x1", {"stage": 2, "data": 2})
    fn, _, names, in_specs = CASES["sparse_joint_packed"]
    arrays = _inputs(5, batch=B)
    structs = [aot.sharded_struct(arrays[n].shape, arrays[n].dtype, mesh, spec) for n, spec in zip(names, in_specs)]

    def body(*args):
        with csa_pallas.activation_sharding(batch="data"):
            return fn(*args)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=STAGE, axis_names={"stage"},
                           check_vma=check_vma)
    with jax.set_mesh(mesh):
        assert "tpu_custom_call" in jax.jit(mapped).lower(*structs).compile().as_text()


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "unchecked"])
def test_vmap_with_spmd_axis_name_over_a_free_axis_inside_a_shard_map_manual_over_stage(check_vma):
    """`jax.vmap(..., spmd_axis_name="data")` around the op inside the user's shard_map manual over "stage": with
    check_vma=False each element's loss and gradient equal the reference's; with check_vma=True a ValueError that
    says what to change (JAX 0.10.2 cannot batch a nested check_vma shard_map over a mesh axis of its own: with
    `jnp.sin` alone it mistypes the outputs as varying over "data")."""
    fn, reference_fn, names, in_specs = CASES["sparse_joint_packed"]
    mesh = make_mesh({"stage": 2, "data": 2, "heads": 2})
    a = _inputs(9, batch=B)
    args = [jnp.stack([a[n], a[n][::-1]]) for n in names]  # the vmapped axis first

    def body(*local):
        with csa_pallas.activation_sharding(batch="heads"):
            return jax.vmap(fn, spmd_axis_name="data")(*local)
    split = P(None, "stage")
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(split if s == STAGE else P() for s in in_specs),
                                   out_specs=(split, split), axis_names={"stage"}, check_vma=check_vma))
    with jax.set_mesh(mesh):
        if check_vma:
            with pytest.raises(ValueError, match=r"^jax.vmap\(spmd_axis_name=\['data'\]\) inside a "
                                                 r"jax.shard_map\(check_vma=True\) manual over \['stage'\]"):
                mapped.trace(*args)
            return
        got = mapped(*args)
    _assert_close(got, jax.vmap(reference_fn)(*args))
