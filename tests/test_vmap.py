"""`jax.vmap` over the ops (a leading axis of problems: pipeline stages, microbatches, stacked layers): every
kernel call batches through `kernels.runtime`'s own rule, so a vmapped loss and its gradient equal the loss of
each element, in interpret mode and as compiled for v5p (before it, the vmapped sparse loss failed v5p's compile
on a lost VMEM limit and the fused op Mosaic's verifier on a reinterpreted ref)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import csa_pallas
from csa_pallas import aot
from aot_cases import require_libtpu
from kernel_cases import compiled_pallas_calls
from test_sharding import mesh_of
from test_placement import make_mesh

MiB = 1 << 20
L, B, S, H, D, M, K = 2, 1, 32, 2, 16, 4, 4  # L: the vmapped axis
N = S // M
HI, DI = 2, 16


def _stacked(seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal((L, *shape)), jnp.float32)
    half = np.arange(S) >= S // 2  # two documents per row: the teacher's tables differ per element
    return dict(
        logits=normal(B, S, N), sparse_logits=normal(B, S, K), q=normal(B, S, H, D), kv=normal(B, N, D),
        window=normal(B, S, D), index_q=normal(B, S, HI, DI), index_k=normal(B, N, DI), index_w=normal(B, S, HI),
        topk=jnp.asarray(rng.integers(-1, N, (L, B, S, K)), jnp.int32),
        segments=jnp.asarray(np.broadcast_to(np.stack([half, ~half]).astype(np.int32)[:, None], (L, B, S))),
        positions=jnp.asarray(np.broadcast_to(np.where(half, np.arange(S) - S // 2, np.arange(S)), (L, B, S)),
                              jnp.int32))


def _assert_vmap_equals_each_element(fn, args, unbatched=(), **vmap_kwargs):
    """jax.vmap(fn, **vmap_kwargs) over the leading axis of `args` (those named in `unbatched` are shared, element
    0) against fn on each element."""
    in_axes = [None if i in unbatched else 0 for i in range(len(args))]
    shared = [a[0] if i in unbatched else a for i, a in enumerate(args)]
    batched = jax.jit(jax.vmap(fn, in_axes=in_axes, **vmap_kwargs))(*shared)
    for element in range(args[in_axes.index(0)].shape[0]):
        one = fn(*[a if i in unbatched else a[element] for i, a in enumerate(shared)])
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(one)):
            np.testing.assert_allclose(got[element], want, rtol=1e-6, atol=1e-7)


def _plain_loss_and_grad(logits, q, kv, **kwargs):
    return jax.value_and_grad(
        lambda x: csa_pallas.indexer_distill_loss(x, q, kv, implementation="pallas", **kwargs))(logits)


def _kernel_operand_shapes(fn, args):
    """{kernel name: the shapes of its operands} of jax.vmap(fn)(*args)'s Mosaic calls."""
    jaxpr = jax.make_jaxpr(jax.vmap(fn))(*args).jaxpr
    shapes = {}
    for eqn in compiled_pallas_calls(jaxpr):
        shapes.setdefault(eqn.params["name"], set()).update(tuple(v.aval.shape) for v in eqn.invars)
    return shapes


def test_vmapped_dense_joint_loss_reads_each_element_in_place():
    """Dense, default ids: every kernel runs once per element and reads q whole, the element axis folded into its
    batch axis ([L * B, S, H, D], the element picked by the index maps), never a copied [B, S, H, D] slice."""
    a = _stacked()
    fn = lambda x, q, kv, window: _plain_loss_and_grad(x, q, kv, window_kv=window, window_size=8)
    args = (a["logits"], a["q"], a["kv"], a["window"])
    _assert_vmap_equals_each_element(fn, args)
    shapes = _kernel_operand_shapes(fn, args)
    readers = [name for name, found in shapes.items() if (L * B, S, H, D) in found]
    assert any("teacher" in name for name in readers) and any("window" in name for name in readers), shapes
    assert not any((B, S, H, D) in found for found in shapes.values()), shapes


def test_vmapped_dense_loss_of_packed_documents():
    """Packed ids batch the teacher's scalar-prefetched tables (sliced per element)."""
    a = _stacked()
    fn = lambda x, q, kv, seg, pos: _plain_loss_and_grad(x, q, kv, target="per_head", segment_ids=seg,
                                                              positions=pos)
    _assert_vmap_equals_each_element(fn, (a["logits"], a["q"], a["kv"], a["segments"], a["positions"]))


@pytest.mark.parametrize("config", [{"path": "visit"}, {"path": "visit", "tile_list": True}, {"path": "gather"}],
                         ids=["visit", "listed", "gather"])
def test_vmapped_sparse_loss_equals_each_element(config):
    """Every sparse path, the listed walk's dynamic grid (read per element) included; packed documents."""
    a = _stacked()
    fn = lambda x, q, kv, idx, seg, pos: _plain_loss_and_grad(x, q, kv, target="per_head", config=config,
                                                                   topk_indices=idx, segment_ids=seg, positions=pos)
    _assert_vmap_equals_each_element(fn, (a["sparse_logits"], a["q"], a["kv"], a["topk"], a["segments"],
                                          a["positions"]))


def test_vmapped_axis_of_size_one_is_squeezed():
    """Size 1 (one element per device when the vmapped axis is sharded): the kernels run unbatched, no loop."""
    a = _stacked()
    fn = lambda x, q, kv, idx, seg, pos: _plain_loss_and_grad(x, q, kv, target="per_head", topk_indices=idx,
                                                              segment_ids=seg, positions=pos)
    args = [a[name][:1] for name in ("sparse_logits", "q", "kv", "topk", "segments", "positions")]
    _assert_vmap_equals_each_element(fn, args)
    loops = lambda text: text.count("while[") + text.count("scan[")
    assert loops(str(jax.make_jaxpr(jax.vmap(fn))(*args))) == loops(str(jax.make_jaxpr(fn)(*[x[0] for x in args])))


@pytest.mark.parametrize("op", ["teacher_distribution", "teacher_distribution_sparse", "noncompressed_lse",
                                "indexer_scores", "indexer_scores_sparse"])
def test_the_other_public_ops_vmap(op):
    """The ops that return arrays (P, u, I) batch by the same rule; I's -inf entries included."""
    a = _stacked()
    fn, names = {
        "teacher_distribution": (lambda q, kv, w: csa_pallas.teacher_distribution(
            q, kv, window_kv=w, window_size=8, implementation="pallas"), ("q", "kv", "window")),
        "teacher_distribution_sparse": (lambda q, kv, idx: csa_pallas.teacher_distribution(
            q, kv, topk_indices=idx, target="per_head", implementation="pallas"), ("q", "kv", "topk")),
        "noncompressed_lse": (lambda q, w: csa_pallas.noncompressed_lse(q, w, window_size=8, implementation="pallas"),
                              ("q", "window")),
        "indexer_scores": (lambda iq, ik, iw: csa_pallas.indexer_scores(iq, ik, iw, implementation="pallas"),
                           ("index_q", "index_k", "index_w")),
        "indexer_scores_sparse": (lambda iq, ik, iw, idx: csa_pallas.indexer_scores(
            iq, ik, iw, topk_indices=idx, implementation="pallas"), ("index_q", "index_k", "index_w", "topk")),
    }[op]
    _assert_vmap_equals_each_element(fn, tuple(a[name] for name in names))


def test_vmapped_loss_with_shared_teacher_inputs():
    """Only the logits batched: q and compressed_kv are shared by every element (not broadcast by the caller)."""
    a = _stacked()
    fn = lambda x, q, kv: _plain_loss_and_grad(x, q, kv, target="per_head")
    _assert_vmap_equals_each_element(fn, (a["logits"], a["q"], a["kv"]), unbatched=(1, 2))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_vmapped_fused_op_and_its_three_gradients(sparse):
    """The student kernels reinterpret index_q's rows (a ref bitcast), which Pallas's rule cannot batch."""
    a = _stacked()

    def fn(iq, ik, iw, q, kv, window, idx):
        loss = lambda *student: csa_pallas.fused_indexer_distill_loss(
            *student, q, kv, topk_indices=idx if sparse else None, window_kv=window, window_size=8,
            student="pallas")
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
    _assert_vmap_equals_each_element(fn, (a["index_q"], a["index_k"], a["index_w"], a["q"], a["kv"], a["window"],
                                          a["topk"]))


def test_nested_vmap_batches_the_element_call_again():
    """vmap of vmap: the element call is itself vmappable, so the outer axis takes the same rule."""
    first, second = _stacked(0), _stacked(1)
    names = ("sparse_logits", "q", "kv", "topk")
    args = [jnp.stack([first[name], second[name]]) for name in names]  # [2, L, B, ...]
    fn = lambda x, q, kv, idx: _plain_loss_and_grad(x, q, kv, target="per_head", topk_indices=idx)
    loss, grad = jax.jit(jax.vmap(jax.vmap(fn)))(*args)
    for outer in range(2):
        for inner in range(L):
            want_loss, want_grad = fn(*[a[outer, inner] for a in args])
            np.testing.assert_allclose(loss[outer, inner], want_loss, rtol=1e-6)
            np.testing.assert_allclose(grad[outer, inner], want_grad, rtol=1e-6, atol=1e-7)


def test_vmapped_sharded_loss_over_a_stage_axis_like_maxtexts_pipeline():
    """MaxText's pipeline vmaps each stage's layer with `spmd_axis_name="stage"`: shard_map's batching rule
    shards the vmapped axis over the mesh's stage axis, so each device sees one element (the size-1 rule)."""
    mesh = mesh_of({"stage": L, "data": 2, "heads": 2})
    rng = np.random.default_rng(1)
    normal = lambda *shape: jnp.asarray(rng.standard_normal((L, *shape)), jnp.float32)
    args = (normal(2, S, K), normal(2, S, H, D), normal(2, N, D),
            jnp.asarray(rng.integers(-1, N, (L, 2, S, K)), jnp.int32))

    def fn(x, q, kv, idx):
        return jax.value_and_grad(lambda y: csa_pallas.sharded_indexer_distill_loss(
            mesh, y, q, kv, topk_indices=idx, target="per_head", batch_axes="data", head_axis="heads"))(x)
    _assert_vmap_equals_each_element(fn, args, spmd_axis_name="stage")


def _pipeline_rows_and_grads(fused, implementation="pallas"):
    """A stage's per-row loss and its VJP with a data-dependent cotangent: the plain sparse loss, or the fused sparse
    op's three gradients."""
    def rows(x, iq, ik, iw, q, kv, topk):
        kw = dict(topk_indices=topk, compress_ratio=M, target="per_head", reduction="none",
                  implementation=implementation)
        if fused:
            loss, vjp = jax.vjp(lambda *s: csa_pallas.fused_indexer_distill_loss(*s, q, kv, **kw), iq, ik, iw)
            return loss, vjp(jnp.cos(loss))
        loss, vjp = jax.vjp(lambda y: csa_pallas.indexer_distill_loss(y, q, kv, **kw), x)
        return loss, vjp(jnp.cos(loss))[0]
    return rows


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_plain_ops_under_a_pipeline_vmap_with_flax_rules(axis_type, fused):
    """MaxText's pipeline written the default way: `jax.vmap(layer, spmd_axis_name="stage")` around the plain op,
    whose layout comes from Flax logical axis rules (heads over "heads"), on an Auto mesh: each stage's loss and
    gradients equal the reference's. On an Explicit mesh, a ValueError that says what to change (JAX 0.10.2 keeps
    the vmapped axis Explicit inside the op's shard_map, where its sharding rules reject the reshapes around the
    kernels at the Flash widths; before 2026-12-08, JAX's "slicing on sharded dims ... is not implemented")."""
    mesh = make_mesh({"stage": L, "heads": 2}, axis_type)
    a = _stacked(3)
    args = [a[n] for n in ("sparse_logits", "index_q", "index_k", "index_w", "q", "kv", "topk")]
    rules = [("activation_batch", ("data", "fsdp")), ("activation_heads", "heads"), ("activation_length", None)]

    def step(*stacked):
        with nn.logical_axis_rules(rules):
            return jax.vmap(_pipeline_rows_and_grads(fused), spmd_axis_name="stage")(*stacked)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, P("stage"))) for x in args]
        if axis_type == AxisType.Explicit:
            with pytest.raises(ValueError, match=r"^jax.vmap over the Explicit mesh axes \['stage'\] \(spmd_axis"):
                jax.jit(step).trace(*placed)
            return
        got = jax.jit(step)(*placed)
    want = jax.vmap(_pipeline_rows_and_grads(fused, "xla"))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


# v5p AOT: the DeepSeek-V4-Flash widths (H = 64, D = 512, bf16), two stacked problems.
FLASH_H, FLASH_D = 64, 512


def _flash_structs(seq, width, *, fused=False):
    st = lambda shape, dtype=jnp.bfloat16: aot.struct((L, *shape), dtype)
    teacher = (st((1, seq, FLASH_H, FLASH_D)), st((1, seq // M, FLASH_D)), st((1, seq, width), jnp.int32),
               st((1, seq, FLASH_D)), st((FLASH_H,), jnp.float32))
    if fused:
        return (st((1, seq, 64, 128)), st((1, seq // M, 128)), st((1, seq, 64))) + teacher
    return (st((1, seq, width), jnp.float32),) + teacher


def _sparse_loss_and_grad(x, q, kv, idx, window, sinks):
    return _plain_loss_and_grad(x, q, kv, topk_indices=idx, window_kv=window, sinks=sinks)


def _fused_loss_and_grads(iq, ik, iw, q, kv, idx, window, sinks):
    return jax.value_and_grad(lambda *student: csa_pallas.fused_indexer_distill_loss(
        *student, q, kv, window_kv=window, sinks=sinks), argnums=(0, 1, 2))(iq, ik, iw)


def _dense_loss_and_grad(x, q, kv, _topk, window, sinks):  # the structs' top-k array is not read
    return _plain_loss_and_grad(x, q, kv, window_kv=window, sinks=sinks)


def test_vmapped_dense_loss_compiles_for_v5p():
    """Dense joint at S = 2K, two stacked problems."""
    require_libtpu()
    report = aot.compile_memory(jax.vmap(_dense_loss_and_grad), *_flash_structs(2048, 2048 // M))
    print(f"vmapped x{L} dense loss: temp {report.temp_bytes / MiB:.1f} MiB")
    assert 0 < report.temp_bytes <= 32 * MiB, report


def test_vmapped_sparse_loss_compiles_for_v5p_reading_q_in_place():
    """S = 4K, K = 512 (the visit path): the case whose vmapped teacher lost its VMEM limit under Pallas's rule
    (22 MiB against XLA's 16 MiB default). q is read in place: a copied element would be 256 MiB of temp."""
    require_libtpu()
    report = aot.compile_memory(jax.vmap(_sparse_loss_and_grad), *_flash_structs(4096, 512))
    print(f"vmapped x{L} sparse loss: temp {report.temp_bytes / MiB:.1f} MiB")
    assert 0 < report.temp_bytes <= 64 * MiB, report


def test_vmapped_fused_op_compiles_for_v5p():
    """The fused op dense at S = 1K: the student kernels' ref bitcasts, which Pallas's rule broke (and a
    squeezed element dimension would break too: Mosaic keeps it in the ref the bitcast reads)."""
    require_libtpu()
    report = aot.compile_memory(jax.vmap(_fused_loss_and_grads), *_flash_structs(1024, 512, fused=True))
    print(f"vmapped x{L} fused op: temp {report.temp_bytes / MiB:.1f} MiB")
    assert 0 < report.temp_bytes <= 64 * MiB, report


def test_pipeline_vmap_compiles_for_v5p():
    """The pipeline vmap of the sparse joint loss on an Auto {stage: 2, heads: 2} mesh of a v5p:2x2x1 slice, heads
    from Flax rules, Flash widths at S = 1K: Mosaic calls in the compiled program (measured temp 33.5 MiB)."""
    require_libtpu()
    mesh = jax.make_mesh((L, 2), ("stage", "heads"), axis_types=(AxisType.Auto,) * 2,
                         devices=aot.tpu_devices("v5p:2x2x1"))
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P("stage")))
               for s in _flash_structs(1024, 128)]

    def step(*stacked):
        with nn.logical_axis_rules([("activation_heads", "heads")]):
            return jax.vmap(_sparse_loss_and_grad, spmd_axis_name="stage")(*stacked)
    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(*structs).compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert 0 < aot.memory_report(compiled).temp_bytes <= 64 * MiB
