"""Sparse (top-k) Pallas kernels (interpret mode on CPU) against the pure-JAX reference."""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import csa_pallas
from csa_pallas import ops_sparse, reference, validation
from csa_pallas.kernels import runtime, slot_counts
from csa_pallas.kernels.teacher_config import TeacherConfig

from kernel_cases import TEACHER_KEYS, assert_matches, make_case


def small_tiles(head_chunk):
    return TeacherConfig(block_q=16, block_k=128, head_chunk=head_chunk, cache_scores=False,
                         vmem_limit_bytes=32 << 20)


def sparse_case(seed, *, width, seq=64, ratio=4, junk=0.3, dup=0.2, **kwargs):
    """make_case plus top-k indices [B, S, K] mixing causal picks, duplicates, -1, out-of-range (>= N) and
    future slots (and, with num_docs > 1, other-document slots), and [B, S, K] logits."""
    arrays = make_case(seed, seq=seq, ratio=ratio, **kwargs)
    rng = np.random.default_rng(seed + 1000)
    b = arrays["q"].shape[0]
    n = seq // ratio
    t = np.arange(seq)[None, :, None]
    causal = (rng.random((b, seq, width)) * np.maximum((t + 1) // ratio, 1)).astype(np.int32)
    junk_idx = rng.integers(-3, n + 4, (b, seq, width)).astype(np.int32)
    idx = np.where(rng.random((b, seq, width)) < junk, junk_idx, causal)
    if width > 1:  # duplicates: copy a random earlier slot
        src = rng.integers(0, width, (b, seq, width))
        idx = np.where(rng.random((b, seq, width)) < dup, np.take_along_axis(idx, src, axis=2), idx)
    arrays["topk_indices"] = jnp.asarray(idx, jnp.int32)
    arrays["logits"] = jnp.asarray(rng.standard_normal((b, seq, width)) * 2.0, jnp.float32)
    return arrays


def _problem(arrays, *, target, ratio, window, head_chunk):
    teacher_args = {k: arrays[k] for k in TEACHER_KEYS if k in arrays}
    if target == "per_head":
        teacher_args.pop("window_kv", None)
        teacher_args.pop("sinks", None)
    return validation.validate(arrays["q"], arrays["compressed_kv"], topk_indices=arrays["topk_indices"],
                               compress_ratio=ratio, window_size=window, target=target, head_chunk=head_chunk,
                               implementation="pallas", **teacher_args)


@functools.lru_cache(maxsize=None)
def _runner(target, ratio, window, head_chunk, reduction, scale, cfg, interpret, public):
    del interpret  # part of the cache key: the kernels read it at trace time
    cfg = dict(cfg) if isinstance(cfg, tuple) else cfg

    def run(arrays):
        problem = _problem(arrays, target=target, ratio=ratio, window=window, head_chunk=head_chunk)
        logits = arrays["logits"]
        weights = jax.random.uniform(jax.random.PRNGKey(0), logits.shape[:2]) if reduction == "none" else 1.0
        if public:  # through csa_pallas' public API (routing of sparse problems)
            teacher_args = {k: arrays[k] for k in TEACHER_KEYS if k in arrays}
            if target == "per_head":
                teacher_args.pop("window_kv", None)
                teacher_args.pop("sinks", None)
            common = dict(topk_indices=arrays["topk_indices"], compress_ratio=ratio, window_size=window,
                          target=target, head_chunk=head_chunk, implementation="pallas", **teacher_args)
            pallas_loss = lambda x: jnp.sum(weights * csa_pallas.indexer_distill_loss(
                x, arrays["q"], arrays["compressed_kv"], reduction=reduction, scale=scale, **common))
            p_pallas = csa_pallas.teacher_distribution(arrays["q"], arrays["compressed_kv"], **common)
        else:
            pallas_loss = lambda x: jnp.sum(weights * ops_sparse.indexer_distill_loss(
                x, problem, reduction=reduction, scale=scale, cfg=cfg))
            p_pallas = ops_sparse.teacher_distribution(problem, cfg)
        reference_loss = lambda x: jnp.sum(weights * reference.indexer_distill_loss(x, problem, reduction=reduction,
                                                                                    scale=scale))
        out = {"P_pallas": p_pallas, "P_reference": reference.teacher(problem)[0]}
        out["loss_pallas"], out["grad_pallas"] = jax.value_and_grad(pallas_loss)(logits)
        out["loss_reference"], out["grad_reference"] = jax.value_and_grad(reference_loss)(logits)
        return out

    return jax.jit(run, compiler_options={"xla_backend_optimization_level": 0})


def run_case(arrays, *, target="joint", ratio=4, window=16, head_chunk: Optional[int] = None, reduction="mean",
             scale=1.0, cfg=None, public=False):
    """cfg: a TeacherConfig, or config overrides as a tuple of (field, value) pairs (hashable)."""
    out = _runner(target, ratio, window, head_chunk, reduction, scale, cfg, runtime.interpret_mode(), public)(arrays)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


@settings(max_examples=6)
@given(
    seq=st.integers(5, 200),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([32, 64]),
    width_kind=st.sampled_from(["lt", "eq", "gt"]),
    target=st.sampled_from(["per_head", "joint"]),
    num_docs=st.integers(1, 3),
    bf16=st.booleans(),
    chunk_pick=st.integers(0, 2),
    tiles=st.sampled_from(["default", "small", "gather"]),
    seed=st.integers(0, 2**16),
)
def test_sparse_kernels_match_reference(seq, heads, head_dim, width_kind, target, num_docs, bf16, chunk_pick, tiles,
                                        seed):
    """Both sparse paths (the teacher kernel with a selection, default or small tiles; the gather kernel)."""
    n = seq // 4
    width = {"lt": max(1, n // 2), "eq": max(1, n), "gt": n + 7}[width_kind]
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    head_chunk = divisors[chunk_pick % len(divisors)]
    arrays = sparse_case(seed, width=width, seq=seq, heads=heads, head_dim=head_dim, num_docs=num_docs,
                         dtype=jnp.bfloat16 if bf16 else jnp.float32)
    cfg = {"default": None, "small": small_tiles(head_chunk),
           "gather": (("path", "gather"), ("unroll_slots", False))}[tiles]
    out = run_case(arrays, target=target, head_chunk=head_chunk, cfg=cfg)
    assert_matches(out)


def test_many_kv_tiles_wide_k_and_duplicates():
    # N = 150 -> two kv tiles of 128, K = 200 -> two 128-lane slot chunks, 40% duplicated slots, 3 documents.
    arrays = sparse_case(1, width=200, seq=600, heads=2, head_dim=32, num_docs=3, dup=0.4)
    out = run_case(arrays, target="joint", head_chunk=2, cfg=small_tiles(2))
    assert_matches(out)
    out = run_case(arrays, target="per_head", head_chunk=1, cfg=small_tiles(1), reduction="none", scale=0.37)
    assert_matches(out)


def test_public_api_given_lse_paths_and_head_chunks():
    arrays = sparse_case(2, width=24, seq=120, heads=4, head_dim=32, num_docs=2)
    window = run_case(arrays, head_chunk=2, public=True)
    assert_matches(window)
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], window_kv=arrays["window_kv"],
                                  sinks=arrays["sinks"], segment_ids=arrays["segment_ids"],
                                  positions=arrays["positions"], window_size=16)
    u = reference.noncompressed_lse(problem)
    given_u = {k: v for k, v in arrays.items() if k not in ("window_kv", "sinks")}
    given_u["noncompressed_lse"] = u
    out = run_case(given_u, head_chunk=4, public=True)
    assert_matches(out)
    np.testing.assert_allclose(out["P_pallas"], window["P_pallas"], atol=1e-6)
    # full_lse = logaddexp(u, C) with C the sparse compressed LSE from the reference.
    sp = _problem(arrays, target="joint", ratio=4, window=16, head_chunk=None)
    valid = reference.support(sp)
    z = reference.teacher_logits(sp)
    c = jnp.where(jnp.any(valid, -1)[:, None], jax.nn.logsumexp(jnp.where(valid[:, None], z, -jnp.inf), -1),
                  -jnp.inf)
    given_f = {k: v for k, v in given_u.items() if k != "noncompressed_lse"}
    given_f["full_lse"] = jnp.logaddexp(u, jnp.transpose(c, (0, 2, 1)))
    out = run_case(given_f, head_chunk=1, public=True)
    assert_matches(out)
    np.testing.assert_allclose(out["P_pallas"], window["P_pallas"], atol=1e-6)


def test_teacher_inputs_get_exact_zero_gradients_and_no_nan():
    arrays = sparse_case(3, width=10, seq=48, heads=2, head_dim=32)
    logits = np.asarray(arrays["logits"]).copy()
    problem = _problem(arrays, target="joint", ratio=4, window=16, head_chunk=None)
    hidden = ~np.asarray(reference.support(problem))
    logits[hidden] = np.where(np.arange(hidden.sum()) % 2, np.nan, -np.inf)  # ignored outside V(t)

    def loss(q, kv, w, sinks, x):
        return csa_pallas.indexer_distill_loss(x, q, kv, topk_indices=arrays["topk_indices"], window_kv=w,
                                               sinks=sinks, window_size=16, implementation="pallas")

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)),
                    compiler_options={"xla_backend_optimization_level": 0})(
        arrays["q"], arrays["compressed_kv"], arrays["window_kv"], arrays["sinks"], jnp.asarray(logits))
    for g in grads[:4]:
        assert np.all(np.asarray(g) == 0)
    dI = np.asarray(grads[4])
    assert np.all(np.isfinite(dI)) and np.all(dI[hidden] == 0) and np.any(dI != 0)


@pytest.mark.parametrize("block_q,block_k,width,base", [(64, 256, 512, 256), (16, 128, 128, 0), (64, 384, 1024, 384),
                                                         (128, 512, 768, 512)])
def test_packed_multiplicity_matches_a_direct_count(block_q, block_k, width, base):
    # The transposed kernel path packs four 8-bit counters per word: rows selecting one block in every slot
    # (> 255 duplicates), extreme int32 values and -1 must not carry into a neighbouring counter or alias a block.
    rng = np.random.default_rng(block_k + width)
    idx = rng.integers(base - 300, base + block_k + 300, (block_q, width)).astype(np.int32)
    idx[0, :] = base + 3
    idx[1, :] = base + block_k - 1
    idx[2, ::2], idx[2, 1::2] = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    idx[3, :] = -1
    fold = slot_counts.slot_fold_width(block_q)

    def kernel(idx_ref, packed_ref, row_major_ref, idx_t_ref):
        idx_t_ref[...] = slot_counts.transpose_slots(idx_ref[...], fold)
        packed_ref[...] = slot_counts.multiplicity_transposed(idx_t_ref, base, block_q=block_q, block_k=block_k,
                                                              fold=fold)
        row_major_ref[...] = slot_counts.multiplicity(idx_ref, base, block_q=block_q, block_k=block_k,
                                                      width_p=width)

    packed, row_major = pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct((block_q, block_k), jnp.int32)] * 2,
        scratch_shapes=[pltpu.VMEM((width // fold, fold * block_q), jnp.int32)], interpret=True)(jnp.asarray(idx))
    expected = (idx[:, :, None] == base + np.arange(block_k)[None, None, :]).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(packed), expected)
    np.testing.assert_array_equal(np.asarray(row_major), expected)


def test_race_and_out_of_bounds_checking_interpreter():
    arrays = sparse_case(4, width=20, seq=80, heads=2, head_dim=32, num_docs=2)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", num_cores_or_threads=2)
    with runtime.interpret_override(params):
        out = run_case(arrays, target="joint", head_chunk=2, cfg=small_tiles(2))
    assert_matches(out)


def test_default_implementation_is_pallas_for_sparse_mode():
    arrays = sparse_case(5, width=8, seq=32, heads=2, head_dim=32)
    problem = validation.validate(arrays["q"], arrays["compressed_kv"], topk_indices=arrays["topk_indices"],
                                  window_kv=arrays["window_kv"])
    from csa_pallas import api
    assert api.choose_implementation(problem) == "pallas"


@pytest.mark.parametrize("num_docs", [1, 2])
def test_fused_kl_over_slots_in_lane_chunks_matches_reference(num_docs):
    # K_p = 384 slots in 128-lane chunks: the two-sweep epilogue with V(t) read from the slot validity (-1,
    # out-of-range, future, cross-document and duplicate slots), against the reference; and the one-sweep path.
    arrays = sparse_case(21, width=300, seq=96, heads=2, head_dim=32, num_docs=num_docs)
    problem = _problem(arrays, target="joint", ratio=4, window=16, head_chunk=None)
    weights = jax.random.uniform(jax.random.PRNGKey(2), (problem.batch, problem.seq_len))

    def program(kl_chunk):
        def rows(logits):
            layout = ops_sparse.sparse_layout(problem, small_tiles(2))
            return ops_sparse.fused_kl_rows(logits, problem, layout, kl_chunk=kl_chunk)[0]
        return jax.jit(lambda x: (rows(x), jax.grad(lambda y: jnp.sum(weights * rows(y)))(x)))

    want_rows = reference.indexer_distill_loss(arrays["logits"], problem, reduction="none")
    want_grad = jax.grad(lambda x: jnp.sum(weights * reference.indexer_distill_loss(x, problem, reduction="none")))(
        arrays["logits"])
    scale = float(np.max(np.abs(want_grad)))
    for kl_chunk in (128, 2048):
        rows, grad = program(kl_chunk)(arrays["logits"])
        np.testing.assert_allclose(rows, want_rows, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(grad) / scale, np.asarray(want_grad) / scale, atol=1e-5, rtol=0)
