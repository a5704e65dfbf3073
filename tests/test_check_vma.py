"""The ops inside a user's `jax.shard_map` with `check_vma=True` (JAX's default): each device runs the op on its
shard, as with check_vma=False, and the results are the same bits. The kernels' outputs vary over every manual axis
their inputs vary over (`kernels.runtime`), and the op first makes its inputs vary alike (`placement.vary_alike`),
so an input replicated over an axis gets its gradient summed over that axis, as JAX gives any replicated input
(checked against the XLA reference in the same shard_map)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import csa_pallas
from csa_pallas import aot
from aot_cases import require_libtpu
from test_sharding import mesh_of

B, S, H, D, M, W, K, HI, DI = 2, 32, 2, 16, 4, 8, 4, 2, 16
N = S // M


def _inputs(seed=0, batch=B):
    """Every input of the cases, B = batch rows (test_partial_manual takes 4: 2 stages x 2 data shards)."""
    B = batch
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    half = np.arange(S) >= S // 2
    return dict(
        logits=normal(B, S, N), sparse_logits=normal(B, S, K), q=normal(B, S, H, D), kv=normal(B, N, D),
        window=normal(B, S, D), sinks=normal(H), index_q=normal(B, S, HI, DI), index_k=normal(B, N, DI),
        index_w=normal(B, S, HI), topk=jnp.asarray(rng.integers(-1, N, (B, S, K)), jnp.int32),
        segments=jnp.asarray(np.broadcast_to(half.astype(np.int32), (B, S))),
        positions=jnp.asarray(np.broadcast_to(np.where(half, np.arange(S) - S // 2, np.arange(S)), (B, S)),
                              jnp.int32),
        loss_mask=jnp.asarray(rng.random((B, S)) > 0.25))


def _loss_and_grad(sparse, implementation="pallas", **kw):
    """The loss and its gradient (reduction="none": the rows and their VJP with a data-dependent cotangent)."""
    def fn(x, q, kv, window, sinks, topk, segments, positions, loss_mask):
        loss, vjp = jax.vjp(lambda y: csa_pallas.indexer_distill_loss(
            y, q, kv, window_kv=window, sinks=sinks, topk_indices=topk if sparse else None, segment_ids=segments,
            positions=positions, loss_mask=loss_mask, compress_ratio=M, window_size=W, target="joint",
            implementation=implementation, **kw), x)
        (grad,) = vjp(jnp.cos(loss) if loss.ndim else jnp.ones_like(loss))
        return loss[None], grad
    return fn


def _fused(sparse, implementation="pallas"):
    def fn(iq, ik, iw, q, kv, topk):
        loss, grads = jax.value_and_grad(lambda *student: csa_pallas.fused_indexer_distill_loss(
            *student, q, kv, topk_indices=topk if sparse else None, compress_ratio=M, target="per_head",
            implementation=implementation, student="pallas" if implementation == "pallas" else "auto"),
            argnums=(0, 1, 2))(iq, ik, iw)
        return loss[None], grads
    return fn


ROWS, SHARED = P("data"), P()
LOSS_ARGS = ("logits", "q", "kv", "window", "sinks", "topk", "segments", "positions", "loss_mask")
CASES = {  # name: (fn, input names, in_specs, out_specs); sinks replicated (it does not vary)
    "dense_joint_packed": (_loss_and_grad(False), LOSS_ARGS, (ROWS,) * 4 + (SHARED,) + (ROWS,) * 4, (ROWS, ROWS)),
    "sparse_joint_packed": (_loss_and_grad(True), ("sparse_logits",) + LOSS_ARGS[1:],
                            (ROWS,) * 4 + (SHARED,) + (ROWS,) * 4, (ROWS, ROWS)),
    "sparse_rows": (_loss_and_grad(True, reduction="none"), ("sparse_logits",) + LOSS_ARGS[1:],  # loss [1, B, S]
                    (ROWS,) * 4 + (SHARED,) + (ROWS,) * 4, (P(None, "data"), ROWS)),
    "fused_dense": (_fused(False), ("index_q", "index_k", "index_w", "q", "kv", "topk"), (ROWS,) * 6,
                    (ROWS, (ROWS,) * 3)),
    "fused_sparse": (_fused(True), ("index_q", "index_k", "index_w", "q", "kv", "topk"), (ROWS,) * 6,
                     (ROWS, (ROWS,) * 3)),
    "teacher_sparse": (lambda q, kv, topk: csa_pallas.teacher_distribution(
        q, kv, topk_indices=topk, compress_ratio=M, target="per_head", implementation="pallas"),
        ("q", "kv", "topk"), (ROWS,) * 3, ROWS),
    "window_lse": (lambda q, window, sinks: csa_pallas.noncompressed_lse(
        q, window, sinks=sinks, window_size=W, implementation="pallas"), ("q", "window", "sinks"),
        (ROWS, ROWS, SHARED), ROWS),
    "indexer_scores": (lambda iq, ik, iw: csa_pallas.indexer_scores(iq, ik, iw, compress_ratio=M,
                                                                    implementation="pallas"),
                       ("index_q", "index_k", "index_w"), (ROWS,) * 3, ROWS),
}


# The losses' XLA references, run in the same shard_map.
REFERENCES = {"dense_joint_packed": _loss_and_grad(False, "xla"), "sparse_joint_packed": _loss_and_grad(True, "xla"),
              "sparse_rows": _loss_and_grad(True, "xla", reduction="none"), "fused_dense": _fused(False, "xla"),
              "fused_sparse": _fused(True, "xla")}


def _run(name, check_vma, mesh, arrays, fn=None):
    case_fn, names, in_specs, out_specs = CASES[name]
    fn = fn or case_fn
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    return jax.jit(mapped)(*[arrays[n] for n in names])


@pytest.mark.parametrize("name", list(CASES))
def test_ops_in_a_check_vma_shard_map_equal_check_vma_false(name):
    mesh = mesh_of({"data": 2})
    arrays = _inputs(1)
    checked, unchecked = _run(name, True, mesh, arrays), _run(name, False, mesh, arrays)
    for got, want in zip(jax.tree.leaves(checked), jax.tree.leaves(unchecked)):
        np.testing.assert_array_equal(got, want)
    if name in REFERENCES:  # and the XLA reference, in the same check_vma=True shard_map
        for got, want in zip(jax.tree.leaves(checked), jax.tree.leaves(_run(name, True, mesh, arrays,
                                                                            REFERENCES[name]))):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_input_replicated_over_an_axis_gets_its_gradient_summed_over_it_like_the_reference():
    """index_k and compressed_kv replicated over "data" (each device's rows read them): inside a check_vma=True
    shard_map JAX sums a replicated input's cotangent over the axis; the kernels' d index_k equals the XLA
    reference's there, i.e. the sum of every device's d index_k."""
    mesh = mesh_of({"data": 2})
    a = _inputs(2)
    args = (a["index_q"], a["index_k"][:1], a["index_w"], a["q"], a["kv"][:1], a["topk"][:, :, :3])
    in_specs = (ROWS, SHARED, ROWS, ROWS, SHARED, ROWS)
    out_specs = (ROWS, (ROWS, SHARED, ROWS))

    def on_mesh(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True))(*args)
    kernels = on_mesh(_fused(True))
    reference = on_mesh(_fused(True, "xla"))
    per_device = [_fused(True)(args[0][d:d + 1], args[1], args[2][d:d + 1], args[3][d:d + 1], args[4],
                               args[5][d:d + 1])[1][1] for d in range(2)]
    np.testing.assert_allclose(kernels[1][1], per_device[0] + per_device[1], rtol=1e-6, atol=1e-6)
    for got, want in zip(jax.tree.leaves(kernels), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def _sparse_loss(x, q, kv, topk, implementation="pallas"):
    return csa_pallas.indexer_distill_loss(x, q, kv, topk_indices=topk, compress_ratio=M, target="per_head",
                                           implementation=implementation)


def _vmapped(x, q, kv, topk, implementation="pallas"):
    """Two problems per batch row, the vmapped axis second (B is the sharded one)."""
    loss = jax.value_and_grad(functools.partial(_sparse_loss, implementation=implementation))
    values, grad = jax.vmap(loss, in_axes=1, out_axes=(0, 1))(x, q, kv, topk)
    return values[None], grad


def _scanned_remat(x, q, kv, topk, implementation="pallas"):  # two rematted "layers" in a scan, own logits each
    rematted = jax.checkpoint(functools.partial(_sparse_loss, implementation=implementation))

    def layer(total, scale):
        loss, grad = jax.value_and_grad(rematted)(x * scale, q, kv, topk)
        return total + loss, grad
    total, grads = jax.lax.scan(layer, jnp.zeros_like(x[0, 0, 0]), jnp.asarray([1.0, 0.5]))
    return total[None], grads


@pytest.mark.parametrize("fn", [_vmapped, _scanned_remat], ids=["vmap", "scan_remat"])
def test_vmap_and_scanned_remat_inside_a_check_vma_shard_map(fn):
    """The model patterns inside the check_vma=True shard_map: the kernels' batching rule and a rematted scan."""
    mesh = mesh_of({"data": 2})
    a = _inputs(4)
    names = ("sparse_logits", "q", "kv", "topk")
    if fn is _vmapped:
        args = [jnp.stack([a[n], a[n][::-1]], axis=1) for n in names]
        out_specs = (ROWS, ROWS)
    else:
        args, out_specs = [a[n] for n in names], (ROWS, P(None, "data"))
    run = lambda check: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(ROWS,) * 4, out_specs=out_specs,
                                              check_vma=check))(*args)
    for got, want in zip(jax.tree.leaves(run(True)), jax.tree.leaves(run(False))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["dense_joint_packed", "sparse_joint_packed", "fused_sparse"])
def test_check_vma_shard_map_compiles_for_v5p(name):
    """The same programs on a v5p:2x2x1 mesh: Mosaic kernels inside the check_vma=True shard_map."""
    require_libtpu()
    mesh = aot.tpu_mesh("v5p:2x2x1", {"data": 2, "other": 2})
    fn, names, in_specs, out_specs = CASES[name]
    arrays = _inputs(3)
    structs = [aot.sharded_struct(arrays[n].shape, arrays[n].dtype, mesh, spec) for n, spec in zip(names, in_specs)]
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
    assert "tpu_custom_call" in jax.jit(mapped).lower(*structs).compile().as_text()
