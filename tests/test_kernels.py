"""Dense Pallas kernels (interpret mode on CPU, compiled on a TPU) against the pure-JAX reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental.pallas import tpu as pltpu

import csa_pallas
from csa_pallas import reference, validation
from csa_pallas.kernels import runtime
from csa_pallas.kernels.teacher_config import TeacherConfig

from kernel_cases import assert_matches, make_case, run_case

# Small tiles so that modest shapes still walk many query tiles, several kv tiles, padding and the block tables.
SMALL_TILES = TeacherConfig(block_q=16, block_k=128, head_chunk=1, cache_scores=False, vmem_limit_bytes=32 << 20)

FAST = {"xla_backend_optimization_level": 0}  # CPU compiles of the interpreted kernels dominate


def small_tiles(head_chunk, cache=False):
    return TeacherConfig(block_q=16, block_k=128, head_chunk=head_chunk, cache_scores=cache,
                         vmem_limit_bytes=32 << 20)


@settings(max_examples=8)
@given(
    seq=st.integers(5, 300),
    heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([32, 64, 128]),
    ratio=st.sampled_from([1, 2, 4]),
    target=st.sampled_from(["per_head", "joint"]),
    num_docs=st.integers(1, 3),
    sinks=st.booleans(),
    bf16=st.booleans(),
    window=st.integers(1, 40),
    chunk_pick=st.integers(0, 3),
    tiles=st.sampled_from(["default", "small", "small_cached"]),
    seed=st.integers(0, 2**16),
)
def test_kernels_match_reference(seq, heads, head_dim, ratio, target, num_docs, sinks, bf16, window, chunk_pick,
                                 tiles, seed):
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    head_chunk = divisors[chunk_pick % len(divisors)]
    arrays = make_case(seed, seq=seq, heads=heads, head_dim=head_dim, ratio=ratio, num_docs=num_docs, sinks=sinks,
                       dtype=jnp.bfloat16 if bf16 else jnp.float32)
    cfg = None if tiles == "default" else small_tiles(head_chunk, cache=tiles == "small_cached")
    out = run_case(arrays, target=target, ratio=ratio, window=window, head_chunk=head_chunk, cfg=cfg)
    # bf16 inputs are upcast exactly and everything accumulates in f32, so the f32 tolerances still apply.
    assert_matches(out)


@pytest.mark.parametrize("head_chunk", [1, 2, 4])
def test_every_head_chunk_divisor_gives_the_same_loss(head_chunk, target="joint"):
    arrays = make_case(1, seq=300, heads=8, head_dim=32, num_docs=2)
    out = run_case(arrays, target=target, head_chunk=head_chunk, cfg=small_tiles(head_chunk))
    assert_matches(out)
    base = run_case(arrays, target=target, head_chunk=8, cfg=small_tiles(8))
    np.testing.assert_allclose(out["loss_pallas"], base["loss_pallas"], rtol=1e-6)
    np.testing.assert_allclose(out["grad_pallas"], base["grad_pallas"], atol=1e-6 * np.abs(base["grad_pallas"]).max())


@pytest.mark.parametrize("target, heads, head_chunk, cache", [("per_head", 8, 8, True), ("joint", 2, 1, False)])
def test_causal_diagonal_tiles_of_two_chunks(target, heads, head_chunk, cache):
    # block_k = 256 > 128: diagonal kv tiles compute only their visible 128-lane chunks (both widths occur, and the
    # last tile holds padding blocks); token-major (8 heads per chunk) and head-major rows.
    arrays = make_case(7, seq=600, heads=heads, head_dim=32, ratio=2)
    cfg = TeacherConfig(block_q=32, block_k=256, head_chunk=head_chunk, cache_scores=cache,
                        vmem_limit_bytes=32 << 20)
    assert_matches(run_case(arrays, target=target, ratio=2, head_chunk=head_chunk, cfg=cfg))


@pytest.mark.parametrize("reduction", ["mean", "sum", "mean_all"])
@pytest.mark.parametrize("traced_scale", [False, True])
def test_uniform_row_weight_loss_with_static_and_traced_scale(reduction, traced_scale):
    # Default ids: every row has the same static weight (for "mean": 1 / (B * (S - m + 1))), so the kernel saves G
    # pre-scaled and the loss is one custom_vjp output (`loss_vjp.fused_weighted_loss`); a traced scale multiplies
    # after.
    from csa_pallas import ops
    arrays = make_case(4, batch=2, seq=96, heads=4, head_dim=32)
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], target="per_head")
    assert ops.default_ids_nonempty_rows(problem) == 2 * (96 - 4 + 1)
    weight = ops.uniform_row_weight(reduction, 0.37, 2, 96, ops.default_ids_nonempty_rows(problem))
    assert weight[1] is None and weight[0] == pytest.approx(0.37 * {"mean": 1 / 186, "sum": 1.0, "mean_all": 1 / 192}[
        reduction])
    assert ops.uniform_row_weight("mean", 0.37, 2, 96, None) is None  # packed documents: counted by the kernel

    def loss(logits, scale, implementation):
        return csa_pallas.indexer_distill_loss(logits, arrays["q"], arrays["compressed_kv"], target="per_head",
                                               reduction=reduction, scale=scale, implementation=implementation)

    def value_and_grad(implementation):
        if traced_scale:
            return jax.jit(jax.value_and_grad(functools.partial(loss, implementation=implementation)),
                           compiler_options=FAST)(
                arrays["logits"], jnp.float32(0.37))
        return jax.value_and_grad(lambda x: loss(x, 0.37, implementation))(arrays["logits"])

    (got, got_grad), (want, want_grad) = value_and_grad("pallas"), value_and_grad("xla")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-5 * np.abs(want_grad).max())


@pytest.mark.parametrize("reduction", ["mean_all", "sum", "none"])
def test_reductions_and_scale(reduction):
    arrays = make_case(2, seq=96, heads=4, head_dim=32, num_docs=2)
    out = run_case(arrays, reduction=reduction, scale=0.37, cfg=small_tiles(2, cache=True))
    assert_matches(out)


def test_joint_and_per_head_coincide_for_one_head_and_differ_for_two():
    one = make_case(3, seq=64, heads=1, head_dim=32)
    joint = run_case(one, target="joint")["P_pallas"]
    per_head = run_case(one, target="per_head")["P_pallas"]
    np.testing.assert_allclose(joint, per_head, atol=1e-6)
    two = make_case(3, seq=64, heads=2, head_dim=32, q_scale=2.0)
    joint, per_head = run_case(two, target="joint")["P_pallas"], run_case(two, target="per_head")["P_pallas"]
    assert np.max(np.abs(joint - per_head)) > 1e-3


def _full_lse(arrays, window):
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"],
                                  sinks=arrays.get("sinks"), window_size=window)
    u = reference.noncompressed_lse(problem)
    z = reference.teacher_logits(problem)
    valid = reference.support(problem)
    c = jnp.where(jnp.any(valid, -1)[:, None], jax.nn.logsumexp(jnp.where(valid[:, None], z, -jnp.inf), -1),
                  -jnp.inf)
    return u, jnp.logaddexp(u, jnp.transpose(c, (0, 2, 1)))


def test_full_lse_and_noncompressed_lse_paths_equal_the_window_path():
    arrays = make_case(4, seq=200, heads=4, head_dim=64)
    u, full = _full_lse(arrays, 16)
    window = run_case(arrays, cfg=small_tiles(4))
    given_u = {k: v for k, v in arrays.items() if k not in ("window_kv", "sinks")}
    given_u["noncompressed_lse"] = u
    given_f = {k: v for k, v in arrays.items() if k not in ("window_kv", "sinks")}
    given_f["full_lse"] = full
    for variant in (given_u, given_f):
        out = run_case(variant, cfg=small_tiles(4))
        assert_matches(out)
        np.testing.assert_allclose(out["P_pallas"], window["P_pallas"], atol=1e-6)
        np.testing.assert_allclose(out["loss_pallas"], window["loss_pallas"], rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 128, 1000])
@pytest.mark.parametrize("num_docs", [1, 3])
def test_window_lse_kernel(window, num_docs):
    arrays = make_case(5, seq=260, heads=4, head_dim=32, num_docs=num_docs)
    kwargs = {k: arrays[k] for k in ("sinks", "segment_ids", "positions") if k in arrays}
    f = jax.jit(lambda q, w, impl: csa_pallas.noncompressed_lse(q, w, window_size=window, implementation=impl,
                                                                head_chunk=2, **kwargs), static_argnums=2)
    got = np.asarray(f(arrays["q"], arrays["window_kv"], "pallas"))
    want = np.asarray(f(arrays["q"], arrays["window_kv"], "xla"))
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)


def test_empty_rows_local_heads_and_extreme_sinks_stay_finite():
    # u >> C for every head (window keys scaled up), huge and tiny sinks, empty rows t <= m-2.
    for sink_scale in (30.0, -30.0):
        arrays = make_case(6, seq=64, heads=2, head_dim=32, window_scale=3.0, sink_scale=sink_scale)
        out = run_case(arrays)
        assert_matches(out)
        assert np.all(out["P_pallas"][:, :3] == 0)
        assert np.all(out["grad_pallas"][:, :3] == 0)


def test_masked_logits_may_be_nan_or_inf():
    arrays = make_case(7, seq=48, heads=2, head_dim=32, num_docs=2)
    clean = run_case(arrays)
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], segment_ids=arrays["segment_ids"],
                                  positions=arrays["positions"], target="per_head")
    hidden = ~np.asarray(reference.support(problem))
    poisoned = dict(arrays)
    logits = np.asarray(arrays["logits"]).copy()
    logits[hidden] = np.where(np.arange(hidden.sum()) % 2, np.nan, -np.inf)
    poisoned["logits"] = jnp.asarray(logits)
    out = run_case(poisoned)
    np.testing.assert_allclose(out["loss_pallas"], clean["loss_pallas"], rtol=1e-6)
    np.testing.assert_array_equal(out["grad_pallas"], clean["grad_pallas"])


def test_sequence_shorter_than_a_block_gives_zero_loss():
    arrays = make_case(8, seq=3, heads=2, head_dim=32, ratio=4)
    loss, grad = jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
        x, arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"], implementation="pallas"))(
        arrays["logits"])
    assert float(loss) == 0.0 and grad.shape == (1, 3, 0)


def test_teacher_inputs_get_exact_zero_gradients():
    arrays = make_case(9, seq=64, heads=2, head_dim=32)

    def loss(q, kv, w, sinks, logits):
        return csa_pallas.indexer_distill_loss(logits, q, kv, window_kv=w, sinks=sinks, window_size=16,
                                               implementation="pallas")

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), compiler_options=FAST)(
        arrays["q"], arrays["compressed_kv"], arrays["window_kv"], arrays["sinks"], arrays["logits"])
    for g in grads[:4]:
        assert np.all(np.asarray(g) == 0)
    assert np.any(np.asarray(grads[4]) != 0)


@pytest.mark.parametrize("target", ["per_head", "joint"])
def test_race_and_out_of_bounds_checking_interpreter(target):
    # The TPU-semantics interpreter raises on any out-of-bounds block read and reports races between the two
    # cores; the block tables, zig-zag order and padding all go through it here.
    arrays = make_case(10, seq=80, heads=2, head_dim=32, num_docs=2)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", num_cores_or_threads=2)
    with runtime.interpret_override(params):
        out = run_case(arrays, target=target, cfg=small_tiles(2, cache=True))
    assert_matches(out)


def test_head_chunk_must_divide_heads():
    arrays = make_case(11, seq=32, heads=4, head_dim=32)
    with pytest.raises(ValueError, match="head_chunk"):
        csa_pallas.indexer_distill_loss(arrays["logits"], arrays["q"], arrays["compressed_kv"],
                                        window_kv=arrays["window_kv"], head_chunk=3, implementation="pallas")


def test_default_implementation_is_pallas_for_dense_mode():
    arrays = make_case(12, seq=32, heads=2, head_dim=32)
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"])
    from csa_pallas import api
    assert api.choose_implementation(problem) == "pallas"


def _fused_rows_program(problem, *, kl_chunk, cfg):
    """Per-row KL of the fused teacher + KL kernel and its logits gradient (weighted rows), jitted."""
    from csa_pallas import ops

    def rows(logits):
        layout = ops.dense_layout(problem, cfg)
        rows, _ = ops.fused_kl_rows(logits, ops.teacher_inputs(problem, layout), layout, problem, kl_chunk=kl_chunk)
        return rows

    weights = jax.random.uniform(jax.random.PRNGKey(1), (problem.batch, problem.seq_len))
    weighted = lambda x: jnp.sum(weights * rows(x))
    return jax.jit(lambda x: (rows(x), jax.grad(weighted)(x)), compiler_options=FAST)


@pytest.mark.parametrize("num_docs", [1, 3])
def test_fused_kl_in_lane_chunks_matches_reference(num_docs):
    # N_p = 256 in 128-lane chunks: the two-sweep epilogue (running student LSE across chunks, dynamic lane
    # offsets), causal iota masks (one document) and metadata masks (packing), padding rows past S.
    arrays = make_case(13, seq=600, heads=2, head_dim=32, num_docs=num_docs)
    kwargs = {k: arrays[k] for k in ("segment_ids", "positions") if k in arrays}
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], target="per_head", **kwargs)
    cfg = TeacherConfig(block_q=64, block_k=256, head_chunk=2, cache_scores=True, vmem_limit_bytes=32 << 20)
    got_rows, got_grad = _fused_rows_program(problem, kl_chunk=128, cfg=cfg)(arrays["logits"])
    one_rows, one_grad = _fused_rows_program(problem, kl_chunk=4096, cfg=cfg)(arrays["logits"])
    weights = jax.random.uniform(jax.random.PRNGKey(1), (problem.batch, problem.seq_len))
    want_rows = reference.indexer_distill_loss(arrays["logits"], problem, reduction="none")
    want_grad = jax.grad(lambda x: jnp.sum(weights * reference.indexer_distill_loss(x, problem, reduction="none")))(
        arrays["logits"])
    for rows, grad in ((got_rows, got_grad), (one_rows, one_grad)):
        np.testing.assert_allclose(rows, want_rows, rtol=1e-5, atol=1e-6)
        scale = float(np.max(np.abs(want_grad)))
        np.testing.assert_allclose(np.asarray(grad) / scale, np.asarray(want_grad) / scale, atol=1e-5, rtol=0)
    assert np.all(np.asarray(got_grad)[:, :3] == 0)  # rows t <= m - 2 see no block


def test_fused_weighted_loss_in_lane_chunks_matches_reference():
    # G saved pre-scaled by the static row weight (`fused_kl.FusedKL.grad_scale`) in both epilogue forms: one sweep
    # and the two-sweep 128-lane chunks (N_p = 256).
    from csa_pallas import ops
    arrays = make_case(13, seq=600, heads=2, head_dim=32)
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], target="per_head")
    cfg = TeacherConfig(block_q=64, block_k=256, head_chunk=2, cache_scores=True, vmem_limit_bytes=32 << 20)
    weight = 0.37 / ops.default_ids_nonempty_rows(problem)
    want_loss, want_grad = jax.value_and_grad(
        lambda x: reference.indexer_distill_loss(x, problem, reduction="mean", scale=0.37))(arrays["logits"])
    for kl_chunk in (128, 4096):
        def loss(logits):
            layout = ops.dense_layout(problem, cfg)
            return ops.fused_kl_loss(logits, ops.teacher_inputs(problem, layout), layout, problem, weight,
                                     kl_chunk=kl_chunk)

        got_loss, got_grad = jax.jit(jax.value_and_grad(loss), compiler_options=FAST)(arrays["logits"])
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
        scale = float(np.max(np.abs(want_grad)))
        np.testing.assert_allclose(np.asarray(got_grad) / scale, np.asarray(want_grad) / scale, atol=1e-5, rtol=0)


def test_bf16_logits_gradient_is_the_rounded_f32_gradient():
    # The forward saves G in the logits' dtype; the backward multiplies by the row cotangent and rounds again:
    # at most one bf16 ulp from the f32 gradient rounded once.
    arrays = make_case(14, seq=200, heads=4, head_dim=32, num_docs=2)
    kwargs = {k: arrays[k] for k in ("window_kv", "sinks", "segment_ids", "positions")}
    logits = arrays["logits"].astype(jnp.bfloat16)

    def loss(x, implementation):
        return csa_pallas.indexer_distill_loss(x, arrays["q"], arrays["compressed_kv"], window_size=16, scale=0.3,
                                               implementation=implementation, **kwargs)

    got_loss, got = jax.jit(jax.value_and_grad(lambda x: loss(x, "pallas")), compiler_options=FAST)(logits)
    want_loss, want = jax.value_and_grad(lambda x: loss(x, "xla"))(logits.astype(jnp.float32))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ulp = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32)) * 2.0 ** -7
    assert np.all(np.abs(got - want) <= ulp + 1e-12)
    assert np.any(got != 0)


@pytest.mark.parametrize("seq, heads, ratio, block_q, block_k, target, merged", [
    (500, 8, 1, 16, 128, "per_head", True),  # token-major rows, 1..4 kv tiles per query tile, padding rows
    (500, 2, 2, 32, 128, "joint", True),  # head-major rows
    (512, 2, 32, 16, 16, "joint", False),  # the first query tile sees no block; second tiles see one kv tile
])
def test_paired_causal_query_tiles(seq, heads, ratio, block_q, block_k, target, merged):
    # Default ids, cached scores, one head chunk and an even number of query tiles: tiles (i, nq-1-i) share one
    # walk of grid steps, the first tile's pass 2 (and fused KL) in the second tile's first step; the second
    # tile's pass 2 in its own last pass-1 step (merged) or in a step of its own.
    from csa_pallas import ops
    arrays = make_case(15, seq=seq, heads=heads, head_dim=32, ratio=ratio)
    cfg = TeacherConfig(block_q=block_q, block_k=block_k, head_chunk=heads, cache_scores=True,
                        vmem_limit_bytes=32 << 20)
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], compress_ratio=ratio, target="per_head")
    schedule = ops.dense_layout(problem, cfg).schedule
    assert schedule.causal and schedule.pairs_fit()
    assert schedule.pairs_merge() == merged
    assert_matches(run_case(arrays, target=target, ratio=ratio, head_chunk=heads, cfg=cfg))


@pytest.mark.parametrize("seq, heads, head_chunk, bf16, window, num_docs", [
    (300, 16, 16, True, 7, 1), (300, 16, 16, True, 128, 2), (300, 16, 16, True, 200, 1),
    (300, 4, 4, False, 7, 2), (300, 4, 4, False, 200, 1),
    (300, 4, 2, False, 128, 1), (300, 4, 2, False, 7, 2),
    (100, 16, 16, True, 200, 2), (100, 16, 16, True, 7, 1),
])
def test_window_lse_layouts(seq, heads, head_chunk, bf16, window, num_docs):
    # Lane-dense statistics token-major (bf16, 16 heads) and head-major (f32, all heads), the per-lane fallback
    # (2 of 4 heads; a query tile under 128); default ids (iota mask) and packed documents; W below, at and above
    # the 128-key tile (one step for the band, or one tile per step); S not a multiple of the query tile.
    arrays = make_case(9, seq=seq, heads=heads, head_dim=32, num_docs=num_docs,
                       dtype=jnp.bfloat16 if bf16 else jnp.float32)
    kwargs = {k: arrays[k] for k in ("sinks", "segment_ids", "positions") if k in arrays}
    f = jax.jit(lambda q, w, impl: csa_pallas.noncompressed_lse(q, w, window_size=window, implementation=impl,
                                                                head_chunk=head_chunk, **kwargs), static_argnums=2)
    got = np.asarray(f(arrays["q"], arrays["window_kv"], "pallas"))
    want = np.asarray(f(arrays["q"].astype(jnp.float32), arrays["window_kv"].astype(jnp.float32), "xla"))
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)
    no_sinks = {k: v for k, v in kwargs.items() if k != "sinks"}
    got = csa_pallas.noncompressed_lse(arrays["q"], arrays["window_kv"], window_size=window, head_chunk=head_chunk,
                                       implementation="pallas", **no_sinks)
    want = csa_pallas.noncompressed_lse(arrays["q"].astype(jnp.float32), arrays["window_kv"].astype(jnp.float32),
                                        window_size=window, head_chunk=head_chunk, implementation="xla", **no_sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-6)
