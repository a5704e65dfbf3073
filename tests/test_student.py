"""The fused student (SPEC §8): `indexer_scores` and `fused_indexer_distill_loss` against the float64 oracle.

The loss and all three indexer gradients (the chain rule from SPEC §5's dI) within 1e-6 (loss, absolute) and 1e-6
relative to each gradient's max, for the reference (implementation="xla") and with the teacher / KL in the Pallas
kernels (interpret mode; dense mode's student through the student kernels unless student="xla"); dense and
sparse, both targets, packing, loss_mask, bf16 inputs, indexer head chunks, ReLU ties at exactly 0, exact zero
teacher-side gradients, every reduction (per-row losses through the rematerialised scan), field-named errors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import csa_pallas
import oracle
from csa_pallas.kernels import student_scores as sk
from csa_pallas.kernels.student_gather import StudentGatherConfig
from kernel_cases import packed_ids

TOL = 1e-6

FAST = {"xla_backend_optimization_level": 0}  # CPU compiles of the interpreted kernels dominate


def make_student_case(seed, *, batch=1, seq=32, heads=2, head_dim=16, index_heads=3, index_dim=16, ratio=4,
                      topk=None, num_docs=1, dtype=jnp.float32, loss_mask=False):
    rng = np.random.default_rng(seed)
    n = seq // ratio
    c = dict(
        index_q=jnp.asarray(rng.standard_normal((batch, seq, index_heads, index_dim)), dtype),
        index_k=jnp.asarray(rng.standard_normal((batch, n, index_dim)), dtype),
        index_weights=jnp.asarray(rng.standard_normal((batch, seq, index_heads)) * 0.5, dtype),
        q=jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype),
        compressed_kv=jnp.asarray(rng.standard_normal((batch, n, head_dim)), dtype),
    )
    kw = dict(compress_ratio=ratio, window_size=8, window_kv=jnp.asarray(rng.standard_normal((batch, seq, head_dim)),
                                                                          dtype),
              sinks=jnp.asarray(rng.standard_normal(heads), jnp.float32))
    if topk is not None:
        kw["topk_indices"] = jnp.asarray(rng.integers(-1, n + 1, size=(batch, seq, topk)), jnp.int32)
    if num_docs > 1:
        seg, pos = packed_ids(rng, batch, seq, num_docs)
        kw["segment_ids"], kw["positions"] = jnp.asarray(seg), jnp.asarray(pos)
    if loss_mask:
        kw["loss_mask"] = jnp.asarray(rng.random((batch, seq)) > 0.25)
    return c, kw


def _oracle_kw(kw, target, reduction="mean", scale=1.0):
    return dict({k: np.asarray(v) for k, v in kw.items() if not isinstance(v, (int, float))},
                compress_ratio=kw["compress_ratio"], window_size=kw["window_size"], target=target,
                reduction=reduction, scale=scale)


def _loss_and_grads(c, kw, **options):
    def loss(iq, ik, iw):
        return csa_pallas.fused_indexer_distill_loss(iq, ik, iw, c["q"], c["compressed_kv"], **kw, **options)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=FAST)(
        c["index_q"], c["index_k"], c["index_weights"])


def _check(c, kw, target, *, implementation="xla", reduction="mean", scale=1.3, index_head_chunk=None, **options):
    value, grads = _loss_and_grads(c, kw, target=target, reduction=reduction, scale=scale,
                                   implementation=implementation, index_head_chunk=index_head_chunk, **options)
    okw = _oracle_kw(kw, target, reduction, scale)
    args = [np.asarray(c[k], np.float64) for k in ("index_q", "index_k", "index_weights", "q", "compressed_kv")]
    expected = oracle.fused_loss(*args, **okw)
    assert abs(float(value) - expected) <= TOL * max(1.0, abs(expected)), (float(value), expected)
    # A gradient that cancels to ~0 in exact arithmetic (e.g. Q = P on every row) is computed from f32 differences
    # Q - P of O(2^-24), which the chain rule scales by the inputs: an absolute floor of 1e-9 x their scales.
    floor = 1e-9 * float(np.prod([max(np.max(np.abs(a), initial=0.0), 1.0) for a in args[:3]]))
    for name, got, want in zip(("index_q", "index_k", "index_weights"), grads,
                               oracle.fused_loss_grads(*args, **okw)):
        assert got.dtype == c[name].dtype, name
        err = np.max(np.abs(np.asarray(got, np.float64) - want), initial=0.0)
        # a bf16 input gets its gradient in bf16: the f32 gradient rounded once (half an ulp, 2^-9 relative)
        tol = TOL if got.dtype == jnp.float32 else 2.0 ** -8
        assert err <= tol * max(np.max(np.abs(want), initial=0.0), 1e-30) + floor, (name, err)


@pytest.mark.parametrize("target", ["per_head", "joint"])
@pytest.mark.parametrize("topk", [None, 5])
def test_reference_matches_the_oracle(target, topk):
    c, kw = make_student_case(0, batch=2, topk=topk, num_docs=2)
    _check(c, kw, target)


@pytest.mark.parametrize("topk", [None, 5])
def test_pallas_teacher_with_the_student_matches_the_oracle(topk):
    c, kw = make_student_case(1, seq=64, topk=topk, num_docs=2, loss_mask=True)
    _check(c, kw, "joint", implementation="pallas", index_head_chunk=1)


@pytest.mark.parametrize("query_chunk, reduction", [(None, "sum"), (16, "mean")])
def test_default_ids_through_the_kernels(query_chunk, reduction):
    """One document, no ids passed: one chunk takes the student kernels' causal schedule from the grid (and the
    teacher's), several chunks their tables; both against the oracle. Both reductions weigh every row by one
    static number (mean: B (S - m + 1) non-empty rows), which goes into the kernel's G."""
    c, kw = make_student_case(14, seq=64)
    _check(c, kw, "per_head", implementation="pallas", reduction=reduction, query_chunk=query_chunk)


@pytest.mark.parametrize("topk, target, reduction", [(None, "joint", "mean"), (6, "joint", "sum"),
                                                      (None, "per_head", "mean_all")])
def test_query_chunks_through_the_kernels(topk, target, reduction):
    """The Pallas path in chunks of 16 query rows (4 chunks; u from the window kernel once for all rows)."""
    c, kw = make_student_case(11, batch=2, seq=64, topk=topk, num_docs=2, loss_mask=True)
    _check(c, kw, target, implementation="pallas", reduction=reduction, query_chunk=16, index_head_chunk=1)


def test_query_chunk_must_divide_s_and_default_chunks_fit():
    from csa_pallas import student_plan, validation
    c, kw = make_student_case(12)
    with pytest.raises(ValueError, match="query_chunk: expected a divisor of S=32"):
        _loss_and_grads(c, kw, implementation="pallas", query_chunk=12)
    big = validation.validate(jax.ShapeDtypeStruct((1, 131072, 64, 512), jnp.bfloat16),
                              jax.ShapeDtypeStruct((1, 32768, 512), jnp.bfloat16), target="per_head")
    chunk = student_plan.default_query_chunk(big, index_head_chunk=8)
    assert chunk == student_plan.MIN_QUERY_CHUNK  # 64 MiB / (26 [chunk, N] f32 rows) would be 19 rows
    small = validation.validate(jax.ShapeDtypeStruct((1, 32768, 64, 512), jnp.bfloat16),
                                jax.ShapeDtypeStruct((1, 8192, 512), jnp.bfloat16), target="per_head")
    assert student_plan.default_query_chunk(small, index_head_chunk=8) == 64  # 78 rows fit: the largest divisor
    # the student kernels: 409 rows fit
    assert student_plan.default_query_chunk(small, index_head_chunk=8, student_kernels=True) == 256
    sparse = dataclasses.replace(small, topk_indices=jax.ShapeDtypeStruct((1, 32768, 512), jnp.int32))
    # the XLA student's gathered keys [chunk, K, d_I]: 94 rows of 64 MiB at K = 512, d_I = 128
    assert student_plan.default_query_chunk(sparse, index_head_chunk=8, index_dim=128) == 64
    # the sparse student kernels: ~9 bytes per index_q element and 5 [chunk, K] f32 arrays a row, 799 rows fit
    assert student_plan.default_query_chunk(sparse, index_head_chunk=8, index_dim=128, student_kernels=True,
                                             index_heads=64) == 512
    # One chunk where the unchunked program fits 64 MiB (chunking would add the chunks' copies of q and index_q):
    # S = 4K (dense ~40 MiB, sparse ~28 MiB), not 8K (dense ~160 MiB, sparse ~72 MiB), nor with the XLA student.
    def flash(seq, width=None):
        shapes = validation.validate(jax.ShapeDtypeStruct((1, seq, 64, 512), jnp.bfloat16),
                                     jax.ShapeDtypeStruct((1, seq // 4, 512), jnp.bfloat16), target="per_head")
        topk = None if width is None else jax.ShapeDtypeStruct((1, seq, width), jnp.int32)
        return dataclasses.replace(shapes, topk_indices=topk)
    for seq, width, chunked in ((4096, None, 4096), (8192, None, 1024), (4096, 512, 4096), (8192, 512, 512)):
        assert student_plan.default_query_chunk(flash(seq, width), 8, 128, student_kernels=True,
                                                 index_heads=64) == chunked
    assert student_plan.default_query_chunk(flash(4096), 8) == 512  # the XLA student: 630 rows of 64 MiB fit
    assert student_plan.default_index_head_chunk(64) == 8 and student_plan.default_index_head_chunk(6) == 6
    assert student_plan.default_index_head_chunk(64, sparse=True) == 32


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), seq=st.sampled_from([12, 20, 36]), index_heads=st.integers(1, 8),
       index_dim=st.sampled_from([16, 32, 128]), sparse=st.booleans(), reduction=st.sampled_from(["mean", "sum"]))
def test_drawn_shapes(seed, seq, index_heads, index_dim, sparse, reduction):
    c, kw = make_student_case(seed, seq=seq, index_heads=index_heads, index_dim=index_dim,
                              topk=3 if sparse else None, loss_mask=bool(seed % 2))
    _check(c, kw, "per_head" if seed % 3 else "joint", reduction=reduction)


def test_index_head_chunks_agree_and_bf16_inputs():
    c, kw = make_student_case(2, index_heads=4, dtype=jnp.bfloat16)
    for chunk in (1, 2, 4):
        _check(c, kw, "joint", index_head_chunk=chunk)


def test_relu_ties_at_zero_take_the_indicator():
    """q_I . k_I exactly 0 (orthogonal integer vectors): the ReLU's derivative there is 0 (SPEC §8)."""
    c, kw = make_student_case(3, index_heads=2, index_dim=16)
    iq = np.zeros((1, 32, 2, 16), np.float32)
    iq[..., 0] = 1.0  # every query along e0
    ik = np.asarray(c["index_k"]).copy()
    ik[0, ::2, 0] = 0.0  # even blocks orthogonal to every query: q . k = 0 exactly
    c = dict(c, index_q=jnp.asarray(iq), index_k=jnp.asarray(ik))
    _check(c, kw, "per_head")
    _, (_, dk, _) = _loss_and_grads(c, kw, target="per_head")
    assert np.all(np.asarray(dk)[0, ::2] == 0.0)  # no query reaches an orthogonal block through the ReLU


def test_teacher_side_gets_exact_zero_gradients():
    c, kw = make_student_case(4, topk=4)

    def loss(q, kv, window_kv, sinks):
        return csa_pallas.fused_indexer_distill_loss(c["index_q"], c["index_k"], c["index_weights"], q, kv,
                                                     **dict(kw, window_kv=window_kv, sinks=sinks),
                                                     implementation="xla")
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(c["q"], c["compressed_kv"], kw["window_kv"], kw["sinks"])
    assert all(not np.any(np.asarray(g)) for g in grads)


def test_static_zero_scale_is_exact_zero_without_work():
    c, kw = make_student_case(5)
    value, grads = _loss_and_grads(c, kw, scale=0.0)
    assert float(value) == 0.0 and all(not np.any(np.asarray(g)) for g in grads)


def test_indexer_scores_masks_outside_the_visible_set():
    c, kw = make_student_case(6, batch=2, num_docs=2, topk=6)
    ids = dict(segment_ids=kw["segment_ids"], positions=kw["positions"])
    args = [np.asarray(c[k], np.float64) for k in ("q", "compressed_kv")]
    for topk in (None, kw["topk_indices"]):
        got = np.asarray(csa_pallas.indexer_scores(c["index_q"], c["index_k"], c["index_weights"],
                                                   topk_indices=topk, **ids))
        want = oracle.indexer_scores(c["index_q"], c["index_k"], c["index_weights"], topk)
        visible = oracle.support(*args, topk_indices=None if topk is None else np.asarray(topk),
                                 **{k: np.asarray(v) for k, v in ids.items()})
        assert np.all(np.isneginf(got[~visible]))
        np.testing.assert_allclose(got[visible], want[visible], rtol=1e-6, atol=1e-6)
    chunked = csa_pallas.indexer_scores(c["index_q"], c["index_k"], c["index_weights"], index_head_chunk=1, **ids)
    np.testing.assert_allclose(np.asarray(chunked), got if topk is None else np.asarray(
        csa_pallas.indexer_scores(c["index_q"], c["index_k"], c["index_weights"], **ids)), rtol=1e-6)
    kernels = csa_pallas.indexer_scores(c["index_q"], c["index_k"], c["index_weights"], implementation="pallas",
                                        **ids)
    dense = csa_pallas.indexer_scores(c["index_q"], c["index_k"], c["index_weights"], **ids)
    assert np.array_equal(np.isneginf(kernels), np.isneginf(dense))
    np.testing.assert_allclose(np.where(np.isneginf(dense), 0, kernels), np.where(np.isneginf(dense), 0, dense),
                               rtol=1e-6, atol=1e-6)
    # sparse mode through the gather kernels: the same scores on the visible slots, -inf elsewhere
    gathered = csa_pallas.indexer_scores(c["index_q"], c["index_k"], c["index_weights"], implementation="pallas",
                                         topk_indices=kw["topk_indices"], **ids)
    xla = csa_pallas.indexer_scores(c["index_q"], c["index_k"], c["index_weights"], topk_indices=kw["topk_indices"],
                                    **ids)
    assert np.array_equal(np.isneginf(gathered), np.isneginf(xla))
    np.testing.assert_allclose(np.where(np.isneginf(xla), 0, gathered), np.where(np.isneginf(xla), 0, xla),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, error, match", [
    (dict(index_q=np.zeros((1, 32, 3), np.float32)), ValueError, "index_q: expected rank 4"),
    (dict(index_q=jnp.zeros((1, 16, 3, 16))), ValueError, "index_q: .*S=32 like q"),
    (dict(index_k=jnp.zeros((1, 9, 16))), ValueError, "index_k: expected shape .*N of compressed_kv"),
    (dict(index_k=jnp.zeros((1, 8, 8))), ValueError, "index_k: expected shape"),
    (dict(index_weights=jnp.zeros((1, 32, 2))), ValueError, "index_weights: expected shape"),
    (dict(index_weights=jnp.zeros((1, 32, 3), jnp.int32)), TypeError, "index_weights: expected a floating"),
    (dict(index_q=[[0.0]]), TypeError, "index_q: expected an array"),
])
def test_bad_student_inputs_name_the_argument(change, error, match):
    c, kw = make_student_case(7)
    c = dict(c, **change)
    with pytest.raises(error, match=match):
        csa_pallas.fused_indexer_distill_loss(c["index_q"], c["index_k"], c["index_weights"], c["q"],
                                              c["compressed_kv"], **kw)
    with pytest.raises(ValueError, match="index_head_chunk: expected a divisor"):
        c, kw = make_student_case(7)
        csa_pallas.fused_indexer_distill_loss(c["index_q"], c["index_k"], c["index_weights"], c["q"],
                                              c["compressed_kv"], **kw, index_head_chunk=2)


def test_indexer_scores_errors_name_the_indexer_arguments():
    c, _ = make_student_case(8)
    with pytest.raises(ValueError, match=r"^index_k: expected N = S_kv // compress_ratio"):
        csa_pallas.indexer_scores(c["index_q"], c["index_k"][:, :3], c["index_weights"],
                                  kv_segment_ids=jnp.zeros((1, 40), jnp.int32),
                                  kv_positions=jnp.zeros((1, 40), jnp.int32))


def test_sharded_inputs_partition_themselves():
    """Inputs committed to a (data, seq) mesh: the op enters `sharded_fused_indexer_distill_loss` by itself with
    the axes read off the inputs (`csa_pallas.placement`); value and gradients equal the unsharded call."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    import platform_select
    sizes = platform_select.fit_mesh_axes({"data": 2, "seq": 2}, len(jax.devices()))
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes))
    c, kw = make_student_case(9, batch=2, seq=64, num_docs=2)
    whole = _loss_and_grads(c, kw, target="per_head", implementation="pallas")
    rows = lambda x: NamedSharding(mesh, P("data", "seq", *([None] * (x.ndim - 2))))
    placed = {k: jax.device_put(v, rows(v) if k != "index_k" and k != "compressed_kv" else
                                NamedSharding(mesh, P("data", None, None))) for k, v in c.items()}
    kw = dict(kw, **{k: jax.device_put(kw[k], rows(kw[k])) for k in ("segment_ids", "positions", "window_kv")})
    sharded = _loss_and_grads(placed, kw, target="per_head", implementation="pallas")
    np.testing.assert_allclose(float(sharded[0]), float(whole[0]), rtol=1e-6)
    for got, want in zip(sharded[1], whole[1]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_flax_modules_take_the_indexer_tensors():
    from csa_pallas import nn as csa_nn
    c, kw = make_student_case(10)
    args = [c[k] for k in ("index_q", "index_k", "index_weights", "q", "compressed_kv")]
    arrays = dict(window_kv=kw["window_kv"], sinks=kw["sinks"])
    want = float(csa_pallas.fused_indexer_distill_loss(*args, **kw, implementation="xla"))
    module = csa_nn.CSAIndexerLoss(compress_ratio=4, window_size=8, implementation="xla")
    assert float(module.fused(*args, **arrays)) == want
    linen = csa_nn.CSAIndexerLossLinen(compress_ratio=4, window_size=8, implementation="xla")
    value, state = linen.apply({}, *args, **arrays, method="fused", mutable=["intermediates"])
    assert float(value) == want
    assert float(csa_nn.collect_indexer_losses(state["intermediates"])[0]) == want
    with pytest.raises(TypeError, match="windw_kv: not an argument"):
        module.fused(*args, windw_kv=kw["window_kv"])


def test_signatures_show_the_declared_teacher_arguments():
    import inspect
    scores = inspect.signature(csa_pallas.indexer_scores).parameters
    assert list(scores)[:4] == ["index_q", "index_k", "index_weights", "topk_indices"]
    assert scores["compress_ratio"].default == 4 and "window_kv" not in scores and "teacher" not in scores
    fused = inspect.signature(csa_pallas.fused_indexer_distill_loss).parameters
    assert {"window_kv", "loss_mask", "target", "query_chunk", "index_head_chunk"} <= set(fused)
    with pytest.raises(TypeError, match="window_kv"):
        c, _ = make_student_case(13)
        csa_pallas.indexer_scores(c["index_q"], c["index_k"], c["index_weights"], window_kv=c["q"])


@pytest.mark.parametrize("spec", ["bsjd,bnd->bsjn", "bsjd,bskd->bsjk"])
def test_split_bf16_matmuls_keep_f32_cotangents(spec):
    """bf16 indexer inputs: one bf16 pass forward (exact products), two backward (the f32 cotangent as bf16
    hi + lo): within 1e-5 of float64 (rounding the cotangent to bf16, MaxText's numerics, costs up to 2^-9)."""
    from csa_pallas import student
    rng = np.random.default_rng(14)
    a_shape = (1, 8, 2, 32)
    b_shape = (1, 16, 32) if spec == "bsjd,bnd->bsjn" else (1, 8, 5, 32)  # dense keys, or keys per slot
    a = jnp.asarray(rng.standard_normal(a_shape), jnp.bfloat16).astype(jnp.float32)
    b = jnp.asarray(rng.standard_normal(b_shape), jnp.bfloat16).astype(jnp.float32)
    out, vjp = jax.vjp(lambda x, y: student._split_dots(x, y, spec), a, b)
    g = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    da, db = vjp(g)
    a64, b64, g64 = (np.asarray(x, np.float64) for x in (a, b, g))
    np.testing.assert_allclose(np.asarray(out), np.einsum(spec, a64, b64), rtol=1e-6, atol=1e-5)
    operands, result = spec.split("->")
    sa, sb = operands.split(",")
    wants = (np.einsum(f"{result},{sb}->{sa}", g64, b64), np.einsum(f"{result},{sa}->{sb}", g64, a64))
    for got, want in zip((da, db), wants):
        assert got.dtype == jnp.float32
        assert np.max(np.abs(np.asarray(got) - want)) <= 1e-5 * np.max(np.abs(want))


def test_fused_op_student_choices():
    """student="pallas" (forced, with a config) and "xla" on the chunked Pallas path, both against the oracle."""
    c, kw = make_student_case(5, seq=64, num_docs=2, loss_mask=True)
    _check(c, kw, "joint", implementation="pallas", student=sk.StudentKernelConfig(block_q=16, block_k=128),
           query_chunk=32)
    _check(c, kw, "per_head", implementation="pallas", student="xla")
    _check(c, kw, "per_head", implementation="pallas", student="pallas", reduction="sum")
    # sparse mode: the gather kernels ("auto" and forced with a config) and the XLA student
    c, kw = make_student_case(5, seq=64, num_docs=2, loss_mask=True, topk=6)
    _check(c, kw, "joint", implementation="pallas", student=StudentGatherConfig(block_q=16), query_chunk=32)
    _check(c, kw, "joint", implementation="pallas", student=StudentGatherConfig(fuse_kl=False), query_chunk=32)
    _check(c, kw, "per_head", implementation="pallas", student="xla")
    _check(c, kw, "per_head", implementation="pallas", student="pallas", reduction="sum")


@pytest.mark.parametrize("change, match", [
    (dict(student="gpu"), "student: expected one of"),
    (dict(student=StudentGatherConfig()), "student: dense mode's kernels take a StudentKernelConfig, got "
                                          "StudentGatherConfig"),
    (dict(student="pallas", implementation="xla"), "student: the student kernels run on the Pallas path"),
    (dict(student=sk.StudentKernelConfig(), implementation="xla"), "student: the student kernels run"),
    (dict(student=StudentGatherConfig(block_q=64, vmem_limit_bytes=1 << 20), topk_indices=True),
     r"student: StudentGatherConfig.vmem_limit_bytes: expected at least \d+ bytes \(the gather kernels' VMEM at "
     r"N=\d+, H_I=\d+, d_I=\d+, K=3, block_q=64, fuse_kl=True\), got 1048576"),
])
def test_student_choice_errors_name_the_argument(change, match):
    c, kw = make_student_case(6)
    if change.pop("topk_indices", False):
        kw["topk_indices"] = jnp.zeros((1, 32, 3), jnp.int32)
    with pytest.raises(ValueError, match=match):
        csa_pallas.fused_indexer_distill_loss(c["index_q"], c["index_k"], c["index_weights"], c["q"],
                                              c["compressed_kv"], **kw, **change)


@pytest.mark.parametrize("student, topk", [("pallas", None), ("xla", None),
                                           (sk.StudentKernelConfig(block_q=16, block_k=128), 7)],
                         ids=["pallas", "xla", "sparse_visit"])
def test_per_row_losses_differentiate_through_the_rematerialised_chunks(student, topk):
    """reduction="none" (a cotangent per row) takes the checkpointed scan, not the gradient-in-forward path: its
    rows and the gradients of a weighted sum of them match the reference (sparse_visit: the KL over blocks)."""
    c, kw = make_student_case(13, batch=2, seq=64, num_docs=2, loss_mask=True, topk=topk)
    weights = jnp.asarray(np.random.default_rng(0).random((2, 64)), jnp.float32)

    def weighted(implementation, **options):
        def f(iq, ik, iw):
            rows = csa_pallas.fused_indexer_distill_loss(iq, ik, iw, c["q"], c["compressed_kv"], **kw,
                                                         target="joint", reduction="none",
                                                         implementation=implementation, **options)
            return jnp.sum(rows * weights), rows
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True), compiler_options=FAST)(
            c["index_q"], c["index_k"], c["index_weights"])

    (_, got_rows), got = weighted("pallas", student=student, query_chunk=16)
    (_, want_rows), want = weighted("xla")
    np.testing.assert_allclose(got_rows, want_rows, atol=1e-6, rtol=1e-6)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-6 * float(jnp.max(jnp.abs(b))), rtol=0)


@pytest.mark.parametrize("topk", [None, 6])
@pytest.mark.parametrize("query_chunk", [None, 16])
def test_a_non_finite_key_block_makes_exactly_its_readers_nan(topk, query_chunk):
    """SPEC §3 through the fused op: the rows with a non-finite compressed_kv block in V(t) are NaN, the others
    equal the reference. One chunk NaN-fills the key rows; several chunks in dense mode leave compressed_kv as
    given (no filled copy) and make the readers' query rows NaN; sparse chunks (visit path here) read the filled
    keys: all give the reference's rows."""
    c, kw = make_student_case(21, batch=2, seq=64, topk=topk, num_docs=2, loss_mask=True)
    kv = np.array(c["compressed_kv"])
    kv[0, 3, 1], kv[1, 9, 0], kv[1, 12, 2] = np.nan, -np.inf, np.inf
    c["compressed_kv"] = jnp.asarray(kv)

    def rows(implementation, **options):
        return csa_pallas.fused_indexer_distill_loss(
            c["index_q"], c["index_k"], c["index_weights"], c["q"], c["compressed_kv"], **kw, target="joint",
            reduction="none", implementation=implementation, **options)

    want = np.asarray(rows("xla"))
    got = np.asarray(jax.jit(lambda: rows("pallas", query_chunk=query_chunk), compiler_options=FAST)())
    assert 0 < np.isnan(want).sum() < want.size  # some rows read a bad block, some do not
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=0, atol=1e-6)


def test_query_chunks_on_the_sparse_gather_path_pack_the_resident_keys_once(monkeypatch):
    """Sparse chunks on the gather path share one packed copy of compressed_kv (`Problem.resident_kv`) and the
    teacher reads each chunk's q rows in place (`Problem.q_window`), against the oracle (index_k's gradient summed
    over the chunks in the one student kernel's running partial sums); a non-finite key block still makes exactly
    its readers NaN (the resident rows are packed from the NaN-filled keys, no filled copy besides them)."""
    from csa_pallas import ops_sparse
    from csa_pallas.kernels import sparse_gather
    monkeypatch.setattr(ops_sparse, "GATHER_HEAD_BLOCKS_PER_SLOT", 0)  # the dispatch picks the gather path
    # Looped slots: a small program for the interpreter (test_variants covers the unrolled default).
    default = sparse_gather.default_config
    monkeypatch.setattr(sparse_gather, "default_config",
                        lambda **kw: dataclasses.replace(default(**kw), unroll_slots=False))
    packs = []
    real = sparse_gather.resident_rows
    monkeypatch.setattr(sparse_gather, "resident_rows", lambda kv: packs.append(kv.shape) or real(kv))
    in_place, launch = [], sparse_gather.sparse_gather_pallas

    def spied_launch(q, *args, **kwargs):
        in_place.append(isinstance(q, sparse_gather.RowWindow))
        return launch(q, *args, **kwargs)
    monkeypatch.setattr(sparse_gather, "sparse_gather_pallas", spied_launch)
    c, kw = make_student_case(23, seq=32, topk=6, num_docs=2, loss_mask=True)
    _check(c, kw, "joint", implementation="pallas", reduction="sum", query_chunk=16, index_head_chunk=1)
    assert len(packs) == 1, packs  # once for the two chunks (traced once: value and gradient in one pass)
    assert in_place and all(in_place), in_place

    kv = np.array(c["compressed_kv"])
    kv[0, 2, 0], kv[0, 5, 3], kv[0, 6, 1] = np.nan, np.inf, -np.inf
    c["compressed_kv"] = jnp.asarray(kv)
    rows = lambda implementation, **o: csa_pallas.fused_indexer_distill_loss(
        c["index_q"], c["index_k"], c["index_weights"], c["q"], c["compressed_kv"], **kw, target="per_head",
        reduction="none", implementation=implementation, **o)
    want, got = np.asarray(rows("xla")), np.asarray(rows("pallas", query_chunk=16))
    assert 0 < np.isnan(want).sum() < want.size
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=0, atol=1e-6)


def test_sparse_chunks_of_default_ids_take_the_prefix_validity(monkeypatch):
    """Query-row chunks of a default-ids problem keep V(t) a prefix of the blocks (`Problem.default_keys`): the
    slot validity comes from the rows' limits, not from XLA gathers of the blocks' metadata; against the oracle,
    loss_mask included."""
    from csa_pallas import masks
    c, kw = make_student_case(24, seq=64, topk=6)
    kw["loss_mask"] = jnp.asarray(np.random.default_rng(3).random((1, 64)) > 0.3)

    def no_gathers(*args, **kwargs):
        raise AssertionError("slot_visible: the chunks of default ids should not gather block metadata")
    monkeypatch.setattr(masks, "slot_visible", no_gathers)
    _check(c, kw, "per_head", implementation="pallas", reduction="sum", query_chunk=16)


@pytest.mark.parametrize("student", ["auto", StudentGatherConfig(fuse_kl=False), "xla"])
def test_a_non_finite_index_k_block_reaches_exactly_the_rows_that_select_it(student):
    """SPEC §3-§4 on the student's side, sparse mode: a NaN index_k block makes NaN exactly the rows that select it
    inside V(t) (their KL and gradients, and dk of the blocks they see). A slot selecting it outside V(t) (a future
    block) and the empty slots that read it through the index mask (N a power of two) change nothing: they once
    made d index_q NaN through 0 * NaN in the products. The kernels' d index_q / d index_k equal the reference's,
    NaN pattern included; d index_weights on the other rows too."""
    c, kw = make_student_case(3, seq=64, topk=6, loss_mask=True)
    n = c["index_k"].shape[1]  # 16 blocks, a power of two: a masked index reads the last block
    idx = np.array(kw["topk_indices"])
    mask = np.asarray(kw["loss_mask"]).copy()
    unseen, seen = n - 1, 6  # block 15 is visible only to t = 63 (masked out); block 6 from t = 27 on
    idx[0, 10, 0] = unseen  # a future block: outside V(10)
    idx[0, 40, 2], idx[0, 50, 3] = seen, seen
    mask[0, 40] = mask[0, 50] = True
    mask[0, 63] = False
    idx[0, 30:40] = np.where(idx[0, 30:40] == seen, -1, idx[0, 30:40])  # rows 30-39 do not select it
    c = dict(c, index_k=c["index_k"].at[0, unseen].set(jnp.nan).at[0, seen].set(jnp.nan))
    kw = dict(kw, topk_indices=jnp.asarray(idx), loss_mask=jnp.asarray(mask))
    rows = np.asarray(csa_pallas.fused_indexer_distill_loss(
        *[c[k] for k in ("index_q", "index_k", "index_weights", "q", "compressed_kv")], **kw, target="per_head",
        reduction="none", implementation="xla"))[0]
    readers = np.isnan(rows)
    assert readers[40] and readers[50] and not readers[30:40].any() and not readers[10]
    want = _loss_and_grads(c, kw, target="per_head", reduction="sum", implementation="xla")
    got = _loss_and_grads(c, kw, target="per_head", reduction="sum", implementation="pallas", student=student)
    assert np.isnan(float(got[0])) and np.isnan(float(want[0]))
    (dq, dk, dw), (want_dq, want_dk, want_dw) = ([np.asarray(x, np.float64) for x in g] for g in (got[1], want[1]))
    for name, a, b in (("index_q", dq, want_dq), ("index_k", dk, want_dk), ("index_weights", dw, want_dw)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=0,
                                   atol=1e-6 * np.max(np.abs(np.nan_to_num(b))), err_msg=name)
    # a reader's G is NaN on V(t): its dw on every head (G ReLU(z) over V(t)), its dq where a head's ReLU is active
    assert np.all(np.isnan(dw[0, readers])) and np.all(np.isfinite(dw[0, ~readers]))
    assert np.isnan(dq[0, readers]).any() and np.all(np.isfinite(dq[0, ~readers]))


@pytest.mark.parametrize("topk,student,dtype", [
    (None, "auto", jnp.float32), (None, "auto", jnp.bfloat16), (6, "auto", jnp.float32),
    (6, StudentGatherConfig(fuse_kl=False), jnp.float32)])
def test_non_finite_indexer_inputs_reach_only_their_readers_and_the_kernels_agree(topk, student, dtype):
    """SPEC §6 ("agree on every input") with NaN and +-inf in all three indexer tensors: on rows whose loss reads
    them (NaN rows), on loss-masked rows, and in an index_k block no unmasked row sees. The student kernels' loss
    rows and three gradients equal the reference's, NaN pattern included; the gradients are NaN only through the
    rows whose loss is NaN (a reader's G is NaN on V(t): its d index_weights on every head), so every other row's
    d index_q and d index_weights stay finite, and so does dk without readers. Until this round a masked row's inf
    or a block nobody reads made gradients NaN through 0 x inf in the products, differently in each
    implementation."""
    c, kw = make_student_case(11, seq=64, topk=topk, loss_mask=True, dtype=dtype)
    mask = np.asarray(kw["loss_mask"]).copy()
    readers, masked = [20, 25], [33, 45, 50, 63]
    mask[0, readers], mask[0, masked] = True, False
    kw = dict(kw, loss_mask=jnp.asarray(mask))
    n = c["index_k"].shape[1]
    c = dict(c, index_q=c["index_q"].at[0, 20, 0, 3].set(jnp.nan).at[0, 33, 1, 0].set(jnp.inf)
             .at[0, 45, 2].set(-jnp.inf),
             index_weights=c["index_weights"].at[0, 25, 0].set(jnp.inf).at[0, 50, 2].set(jnp.nan),
             # the last block is visible only to t = 63, which is masked
             index_k=c["index_k"].at[0, n - 1, 5].set(jnp.nan).at[0, n - 1, 6].set(-jnp.inf))
    args = [c[k] for k in ("index_q", "index_k", "index_weights", "q", "compressed_kv")]
    options = dict(target="per_head", reduction="none")
    rows = np.asarray(csa_pallas.fused_indexer_distill_loss(*args, **kw, **options, implementation="xla"))[0]
    got_rows = np.asarray(csa_pallas.fused_indexer_distill_loss(*args, **kw, **options, implementation="pallas",
                                                                student=student))[0]
    assert sorted(np.flatnonzero(np.isnan(rows))) == readers
    np.testing.assert_array_equal(np.isnan(got_rows), np.isnan(rows))
    np.testing.assert_allclose(np.nan_to_num(got_rows), np.nan_to_num(rows), rtol=1e-6, atol=1e-6)
    want = _loss_and_grads(c, kw, target="per_head", reduction="sum", implementation="xla")
    got = _loss_and_grads(c, kw, target="per_head", reduction="sum", implementation="pallas", student=student)
    (dq, dk, dw), (want_dq, want_dk, want_dw) = ([np.asarray(x, np.float64) for x in g] for g in (got[1], want[1]))
    for name, a, b in (("index_q", dq, want_dq), ("index_k", dk, want_dk), ("index_weights", dw, want_dw)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        assert not np.isinf(a).any() and not np.isinf(b).any(), name
        scale = np.max(np.abs(np.nan_to_num(b)))
        tol = 1e-6 if dtype == jnp.float32 else 2.0 ** -8
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=0, atol=tol * scale, err_msg=name)
    others = np.setdiff1d(np.arange(64), readers)
    assert np.all(np.isnan(want_dw[0, readers])) and np.all(np.isfinite(want_dw[0, others]))
    assert np.all(np.isfinite(want_dq[0, others])) and np.isfinite(want_dk[0, n - 1]).all()
    # the masked rows' gradients are exact zeros, whatever their inputs hold
    for x in (want_dq, want_dw, dq, dw):
        assert not np.any(x[0, masked])
