"""`csa_pallas.sharded_fused_indexer_distill_loss` on 8 CPU host devices: value and the three indexer gradients equal
the unsharded fused op (itself checked against the float64 oracle in test_student.py) over batch, sequence and
attention-head meshes, dense and sparse, both targets, packing, loss_mask, every reduction; errors name the
argument.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_pallas
from csa_pallas import sharded_student
from csa_pallas.kernels.student_scores import StudentKernelConfig
from kernel_cases import packed_ids
from test_sharding import axis_kwargs, mesh_of

SEQ, N_BLOCKS, RATIO = 64, 16, 4

FAST = {"xla_backend_optimization_level": 0}  # CPU compiles of the interpreted kernels dominate


def _case(seed, *, batch=2, heads=4, topk=None, packed=False, loss_mask=False):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    c = dict(index_q=f(batch, SEQ, 3, 16), index_k=f(batch, N_BLOCKS, 16), index_weights=f(batch, SEQ, 3) * 0.5,
             q=f(batch, SEQ, heads, 16), compressed_kv=f(batch, N_BLOCKS, 16))
    kw = dict(compress_ratio=RATIO, window_size=8, window_kv=f(batch, SEQ, 16),
              sinks=jnp.asarray(rng.standard_normal(heads), jnp.float32))
    if topk:
        kw["topk_indices"] = jnp.asarray(rng.integers(-1, N_BLOCKS + 1, size=(batch, SEQ, topk)), jnp.int32)
    if packed:
        seg, pos = packed_ids(rng, batch, SEQ, 2)
        kw["segment_ids"], kw["positions"] = jnp.asarray(seg), jnp.asarray(pos)
    if loss_mask:
        kw["loss_mask"] = jnp.asarray(rng.random((batch, SEQ)) > 0.25)
    return c, kw


def _run(fn, c, kw, reduction):
    weights = jnp.asarray(np.random.default_rng(1).random((2, SEQ)), jnp.float32)

    def loss(iq, ik, iw):
        out = fn(iq, ik, iw, c["q"], c["compressed_kv"], **kw, reduction=reduction)
        return jnp.sum(out * weights) if reduction == "none" else out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=FAST)(
        c["index_q"], c["index_k"], c["index_weights"])


def _assert_close(got, want):
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-6, atol=1e-7)
    for name, a, b in zip(("index_q", "index_k", "index_weights"), got[1], want[1]):
        scale = float(jnp.max(jnp.abs(b)))
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(scale, 1e-30), name


@pytest.mark.parametrize("axes, topk, target, packed, reduction", [
    ({"data": 2, "seq": 4}, None, "joint", True, "mean"),
    ({"data": 2, "seq": 2, "heads": 2}, None, "per_head", False, "mean"),
    ({"seq": 2, "heads": 4}, 5, "joint", True, "sum"),
    ({"data": 2, "seq": 2}, 5, "per_head", False, "none"),
    ({"data": 2, "heads": 2}, None, "joint", False, "none"),
    ({"data": 2}, None, "per_head", True, "mean_all"),
])
def test_sharded_equals_unsharded(axes, topk, target, packed, reduction):
    mesh = mesh_of(axes)
    c, kw = _case(0, topk=topk, packed=packed, loss_mask=True)
    kw = dict(kw, target=target, implementation="pallas")
    want = _run(csa_pallas.fused_indexer_distill_loss, c, kw, reduction)
    sharded = lambda *a, **k: sharded_student.sharded_fused_indexer_distill_loss(mesh, *a, **axis_kwargs(axes), **k)
    _assert_close(_run(sharded, c, kw, reduction), want)


def test_query_chunks_and_forced_student_per_device():
    axes = {"data": 2, "seq": 2}
    mesh = mesh_of(axes)
    c, kw = _case(2, packed=True)
    kw = dict(kw, target="joint", implementation="pallas")
    want = _run(csa_pallas.fused_indexer_distill_loss, c, kw, "mean")
    for options in (dict(query_chunk=16), dict(student="xla"), dict(student="pallas", query_chunk=8)):
        sharded = lambda *a, **k: sharded_student.sharded_fused_indexer_distill_loss(
            mesh, *a, **axis_kwargs(axes), **options, **k)
        _assert_close(_run(sharded, c, kw, "mean"), want)


def test_teacher_side_gets_exact_zero_gradients():
    axes = {"data": 2, "heads": 2}
    mesh = mesh_of(axes)
    c, kw = _case(3)

    def loss(q, kv):
        return sharded_student.sharded_fused_indexer_distill_loss(
            mesh, c["index_q"], c["index_k"], c["index_weights"], q, kv, **axis_kwargs(axes), **kw,
            target="joint", implementation="pallas")
    for g in jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options=FAST)(c["q"], c["compressed_kv"]):
        assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(head_axis="heads", query_chunk=16), ValueError, "query_chunk: with head_axis"),
    (dict(seq_axis="nope"), ValueError, "seq_axis: 'nope' is not an axis of the mesh"),
    (dict(student="tpu"), ValueError, "student: expected one of"),
    (dict(index_k=jnp.zeros((2, 15, 16))), ValueError, "index_k: expected shape"),
    (dict(head_axis="heads", student=StudentKernelConfig(), topk=5), ValueError,
     "student: with a head axis, sparse mode's rows take the gather kernels"),
])
def test_errors_name_the_argument(overrides, error, match):
    mesh = mesh_of({"data": 2, "heads": 2})
    c, kw = _case(4, topk=overrides.pop("topk", None))
    args = dict(c, **{k: overrides.pop(k) for k in list(overrides) if k in c})
    with pytest.raises(error, match=match):
        sharded_student.sharded_fused_indexer_distill_loss(
            mesh, args["index_q"], args["index_k"], args["index_weights"], args["q"], args["compressed_kv"], **kw,
            **dict(dict(batch_axes="data"), **overrides))


def test_flax_module_with_a_mesh_runs_the_sharded_twin():
    from csa_pallas import nn as csa_nn
    axes = {"data": 2, "seq": 2, "heads": 2}
    mesh = mesh_of(axes)
    c, kw = _case(5)
    args = [c[k] for k in ("index_q", "index_k", "index_weights", "q", "compressed_kv")]
    want = float(csa_pallas.fused_indexer_distill_loss(*args, **kw, implementation="pallas"))
    module = csa_nn.CSAIndexerLoss(compress_ratio=RATIO, window_size=8, implementation="pallas", mesh=mesh,
                                   **axis_kwargs(axes))
    from flax import nnx
    fused = nnx.jit(lambda m, *a: m.fused(*a, window_kv=kw["window_kv"], sinks=kw["sinks"]))
    got = float(fused(module, *args))
    np.testing.assert_allclose(got, want, rtol=2e-6)


def test_signature_shows_the_teacher_arguments():
    import inspect
    params = inspect.signature(csa_pallas.sharded_fused_indexer_distill_loss).parameters
    assert list(params)[:6] == ["mesh", "index_q", "index_k", "index_weights", "q", "compressed_kv"]
    assert {"window_kv", "loss_mask", "target", "seq_axis", "student", "query_chunk"} <= set(params)


@pytest.mark.parametrize("topk", [None, 5])
def test_a_nan_query_row_is_nan_on_a_head_sharded_mesh(topk):
    """SPEC §3: a NaN in one query row makes exactly that row's KL NaN, as in the unsharded fused op (the sparse
    head sums reduce-scattered over the head axis once read the NaN slots as empty and the row as a finite 0)."""
    axes = {"data": 2, "heads": 2}
    c, kw = _case(0, topk=topk)
    q = c["q"].at[0, 20, 1, 3].set(jnp.nan)
    run = lambda fn, *extra: jax.jit(lambda iq, ik, iw: fn(*extra, iq, ik, iw, q, c["compressed_kv"], **kw,
                                                          reduction="none"), compiler_options=FAST)(
        c["index_q"], c["index_k"], c["index_weights"])
    rows = run(functools.partial(sharded_student.sharded_fused_indexer_distill_loss, **axis_kwargs(axes)),
               mesh_of(axes))
    want = run(csa_pallas.fused_indexer_distill_loss)
    nan = np.isnan(np.asarray(rows))
    assert nan[0, 20] and nan.sum() == 1
    np.testing.assert_array_equal(nan, np.isnan(np.asarray(want)))
    np.testing.assert_allclose(np.asarray(rows)[~nan], np.asarray(want)[~nan], rtol=1e-5, atol=1e-6)


def test_head_shards_take_the_one_kernel_gradient_pass_for_scalar_reductions():
    """Sparse mode with a head axis: differentiated, "sum" runs the owned rows through `student_gather_kl`
    (scores, KL and gradients in one kernel); "none", and "sum" evaluated without a gradient, keep the scores
    kernel and the stand-alone KL (no gradient work), and the undifferentiated value is the differentiated one."""
    axes = {"data": 2, "heads": 2}
    c, kw = _case(0, topk=5)
    mesh = mesh_of(axes)
    args = (c["index_q"], c["index_k"], c["index_weights"])

    def loss(reduction):
        return lambda iq, ik, iw: jnp.sum(sharded_student.sharded_fused_indexer_distill_loss(
            mesh, iq, ik, iw, c["q"], c["compressed_kv"], **kw, **axis_kwargs(axes), reduction=reduction))

    def kernels(fn):
        text = str(jax.make_jaxpr(fn)(*args))
        return {name for name in ("csa_student_gather_kl_grads", "csa_student_gather_scores") if name in text}
    assert kernels(jax.grad(loss("sum"), argnums=(0, 1, 2))) == {"csa_student_gather_kl_grads"}
    assert kernels(jax.grad(loss("none"), argnums=(0, 1, 2))) == {"csa_student_gather_scores"}
    assert kernels(loss("sum")) == {"csa_student_gather_scores"}
    value = jax.jit(loss("sum"), compiler_options=FAST)(*args)
    differentiated, _ = jax.jit(jax.value_and_grad(loss("sum")), compiler_options=FAST)(*args)
    np.testing.assert_allclose(float(value), float(differentiated), rtol=1e-6)


@pytest.mark.parametrize("axes, topk", [({"data": 2, "seq": 4}, None), ({"seq": 2, "heads": 4}, 5)])
def test_bf16_index_k_gradient_sums_over_the_devices_in_f32(axes, topk):
    """bf16 indexer inputs: index_k enters every device in f32 (exact), so its cotangent is summed over the
    devices it is replicated on in f32 and rounded to bf16 once, the unsharded op's value (within one bf16 ulp:
    the f32 sums differ by their order). Until this round the per-device bf16 cotangents were summed in bf16:
    7% off on entries above 1e-3 of the max at seq 4 x data 2."""
    c, kw = _case(3, topk=topk)
    c = {name: v.astype(jnp.bfloat16) for name, v in c.items()}
    mesh = mesh_of(axes)
    sharded = lambda *a, **k: sharded_student.sharded_fused_indexer_distill_loss(mesh, *a, **axis_kwargs(axes), **k)
    got = _run(sharded, c, dict(kw, target="per_head"), "sum")
    want = _run(csa_pallas.fused_indexer_distill_loss, c, dict(kw, target="per_head"), "sum")
    for name, a, b in zip(("index_q", "index_k", "index_weights"), got[1], want[1]):
        assert a.dtype == jnp.bfloat16, name
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.abs(a - b) <= 2.0 ** -7 * np.abs(b) + 1e-6 * np.max(np.abs(b))), name
