"""Every kernel variant, forced through the public `config=`, against the reference (interpret mode) and compiled
for v5p (AOT on this host).

A variant is a field of `TeacherConfig` (score cache, slot-weight cache, the plain / pairs / merged walks,
straight-line or looped cached pass 2, token- or head-major rows, one- or two-sweep fused KL, the transposed or
row-major multiplicity, head chunks, causal or table schedules). The heuristics pick one per shape; these tests
pick each of them on purpose, so no path is only reached by a shape nobody runs. Sparse mode has two paths (the
teacher kernel reading the selection, and the K-proportional gather kernel), forced with config "path".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_pallas
from csa_pallas import aot, ops, ops_sparse, validation
from csa_pallas.kernels import teacher_config

from aot_cases import require_libtpu
from kernel_cases import make_case

FAST = {"xla_backend_optimization_level": 0}

# name -> (sparse, case kwargs, config overrides, expected resolved variant facts)
VARIANTS = {
    # Dense, default ids (causal schedule): 512 queries, m = 1, 4 kv tiles of 128, query tiles of 16.
    "dense_merged_pairs": (False, dict(seq=512, ratio=1), dict(block_q=16, block_k=128, cache_scores=True,
                                                             walk="merged"), dict(walk="merged")),
    "dense_pairs": (False, dict(seq=512, ratio=1), dict(block_q=16, block_k=128, cache_scores=True, walk="pairs"),
                    dict(walk="pairs")),
    "dense_plain_straight": (False, dict(seq=512, ratio=1), dict(block_q=16, block_k=128, cache_scores=True,
                                                               walk="plain", straight_pass2=True),
                             dict(walk="plain", straight_pass2=True)),
    "dense_plain_looped": (False, dict(seq=512, ratio=1), dict(block_q=16, block_k=128, cache_scores=True,
                                                             walk="plain", straight_pass2=False),
                           dict(walk="plain", straight_pass2=False)),
    "dense_two_pass": (False, dict(seq=512, ratio=1), dict(block_q=16, block_k=128, cache_scores=False),
                       dict(walk="plain")),
    "dense_head_major_rows": (False, dict(seq=256, ratio=1, heads=16, dtype=jnp.bfloat16),
                              dict(block_q=16, block_k=128, head_chunk=16, row_order="head"), dict(token_major=False)),
    "dense_token_major_rows": (False, dict(seq=256, ratio=1, heads=16, dtype=jnp.bfloat16),
                               dict(block_q=16, block_k=128, head_chunk=16, row_order="token"),
                               dict(token_major=True)),
    "dense_two_sweep_kl": (False, dict(seq=512, ratio=1), dict(block_q=16, block_k=128, kl_chunk=128), {}),
    "dense_head_chunks_cached": (False, dict(seq=256, ratio=1), dict(block_q=16, block_k=128, head_chunk=1,
                                                                   cache_scores=True), dict(walk="plain")),
    "dense_head_chunks_two_pass": (False, dict(seq=256, ratio=1), dict(block_q=16, block_k=128, head_chunk=1,
                                                                     cache_scores=False), dict(walk="plain")),
    # Dense, packed documents (table schedule).
    "dense_table_cached": (False, dict(seq=256, ratio=1, num_docs=3), dict(block_q=16, block_k=128,
                                                                        cache_scores=True), dict(walk="plain")),
    "dense_table_two_pass": (False, dict(seq=256, ratio=1, num_docs=3), dict(block_q=16, block_k=128,
                                                                          cache_scores=False), dict(walk="plain")),
    # Sparse, the teacher kernel with a selection (2 kv tiles of 128; duplicates in every case: the exact-count
    # branch runs on the tiles that hold them, the bits on the others).
    "sparse_visit_cached": (True, dict(seq=256, ratio=1), dict(block_q=16, block_k=128, cache_scores=True), {}),
    "sparse_visit_two_pass": (True, dict(seq=256, ratio=1), dict(block_q=16, block_k=128, cache_scores=False), {}),
    "sparse_visit_table": (True, dict(seq=256, ratio=1, num_docs=2), dict(block_q=16, block_k=128,
                                                                       cache_scores=True), {}),
    "sparse_visit_row_major_counts": (True, dict(seq=256, ratio=1), dict(block_q=16, block_k=128,
                                                                        slot_fold=False), {}),
    "sparse_visit_head_major_rows": (True, dict(seq=256, ratio=1, heads=16, dtype=jnp.bfloat16), dict(
        block_q=16, block_k=128, head_chunk=16, row_order="head"), {}),
    "sparse_visit_head_chunks_two_sweep_kl": (True, dict(seq=256, ratio=1), dict(block_q=16, block_k=128,
                                                                                head_chunk=1, kl_chunk=128), {}),
    "sparse_visit_pairs": (True, dict(seq=512, ratio=1), dict(block_q=16, block_k=128, cache_scores=True,
                                                             walk="pairs"), dict(walk="pairs")),
    # Sparse, the walk over lists of the selected kv tiles (a dynamic grid; 4 kv tiles of 128).
    "sparse_visit_tile_lists": (True, dict(seq=512, ratio=1), dict(block_q=16, block_k=128, tile_list=True),
                                dict(walk="plain", tile_list=True)),
    "sparse_visit_tile_lists_table_two_pass": (True, dict(seq=512, ratio=1, num_docs=2), dict(
        block_q=16, block_k=128, cache_scores=False, tile_list=True), dict(walk="plain", tile_list=True)),
    # Sparse, the K-proportional gather kernel (f32 rows; bf16 packed rows in two 128-lane planes).
    "sparse_gather": (True, dict(seq=64, ratio=1), dict(path="gather"), {}),
    "sparse_gather_looped_slots": (True, dict(seq=64, ratio=1), dict(path="gather", unroll_slots=False), {}),
    "sparse_gather_bf16_planes": (True, dict(seq=16, ratio=1, head_dim=512, dtype=jnp.bfloat16),
                                  dict(path="gather", unroll_slots=False), {}),
}
CASE = dict(heads=4, head_dim=32)
WIDTH = 160  # top-k slots: K_p = 256, two 128-lane chunks


def arrays_for(name):
    sparse, case_kw, _, _ = VARIANTS[name]
    kw = dict(CASE, **case_kw)
    a = make_case(sorted(VARIANTS).index(name), **kw)
    if sparse:
        rng = np.random.default_rng(7)
        b, s = a["q"].shape[:2]
        ratio = kw.get("ratio", 4)
        t = np.arange(s)[None, :, None]
        picks = (rng.random((b, s, WIDTH)) * np.maximum((t + 1) // ratio, 1)).astype(np.int32)
        junk = rng.integers(-3, s // ratio + 4, (b, s, WIDTH)).astype(np.int32)
        idx = np.where(rng.random((b, s, WIDTH)) < 0.3, junk, picks)
        idx[:, :, 1::7] = idx[:, :, ::7][:, :, :idx[:, :, 1::7].shape[2]]  # duplicates
        if "tile_lists" in name:  # the last 128 queries pick no block of kv tile 1: lists with a gap
            late = idx[:, 384:]
            late[late // 128 == 1] = -1
        a["topk_indices"] = jnp.asarray(idx, jnp.int32)
        a["logits"] = jnp.asarray(rng.standard_normal((b, s, WIDTH)) * 2.0, jnp.float32)
    return a


TEACHER_KEYS = ("window_kv", "sinks", "segment_ids", "positions", "topk_indices")


def call_kwargs(a):
    return dict({k: a[k] for k in TEACHER_KEYS if k in a}, compress_ratio=VARIANTS_RATIO(a), window_size=16)


def VARIANTS_RATIO(a):  # noqa: N802 - the ratio the case was built with (N = S / m)
    return a["q"].shape[1] // a["compressed_kv"].shape[1]


def loss_and_grad(name):
    """The variant's loss + gradient wrt the logits, forced to its config (a function of `arrays_for(name)`)."""
    config = config_of(name)

    def run(a):
        loss = lambda x: csa_pallas.indexer_distill_loss(x, a["q"], a["compressed_kv"], head_chunk=config.get(
            "head_chunk"), implementation="pallas", config=config, **call_kwargs(a))
        return jax.value_and_grad(loss)(a["logits"])
    return run


def config_of(name):
    """The forced config (the gather path has no head chunk: it computes all heads of a query at once)."""
    _, case_kw, overrides, _ = VARIANTS[name]
    if overrides.get("path") == "gather":
        return dict(overrides)
    return dict(overrides, head_chunk=overrides.get("head_chunk", case_kw.get("heads", CASE["heads"])))


@functools.lru_cache(maxsize=None)
def program(name, impl):
    config = config_of(name)

    def run(a):
        kw = call_kwargs(a)
        hc = config.get("head_chunk")
        extra = dict(config=config) if impl == "pallas" else {}
        weights = jax.random.uniform(jax.random.PRNGKey(1), a["logits"].shape[:2])
        loss = lambda x: jnp.sum(weights * csa_pallas.indexer_distill_loss(
            x, a["q"], a["compressed_kv"], reduction="none", head_chunk=hc, implementation=impl, **kw, **extra))
        value, grad = jax.value_and_grad(loss)(a["logits"])
        p = csa_pallas.teacher_distribution(a["q"], a["compressed_kv"], head_chunk=hc, implementation=impl, **kw,
                                            **extra)
        return dict(P=p, loss=value, grad=grad)
    return jax.jit(run, compiler_options=FAST)


def resolved(name):
    """The variant facts the kernel resolves for the case's config (walk, straight pass 2, row order)."""
    sparse, case_kw, overrides, _ = VARIANTS[name]
    a = arrays_for(name)
    config = config_of(name)
    problem = validation.validate(a["q"], a["compressed_kv"], **call_kwargs(a), head_chunk=config.get("head_chunk"))
    layout = (ops_sparse.sparse_layout if sparse else ops.dense_layout)(problem, config)
    cfg, schedule = layout.cfg, layout.schedule
    facts = dict(path=getattr(layout, "path", "dense"))
    if facts["path"] == "gather":
        return facts, cfg
    nh = problem.num_heads // cfg.head_chunk
    facts["token_major"] = teacher_config.resolve_row_layout(cfg, problem.num_heads, a["q"].dtype).token_major
    facts["walk"] = teacher_config.resolve_walk(cfg, schedule, cached=cfg.cache_scores, num_chunks=nh,
                                                normalize=True, sparse=sparse)
    facts["straight_pass2"] = teacher_config.resolve_straight_pass2(cfg, schedule, cfg.cache_scores)
    facts["tile_list"] = schedule.listed
    return facts, cfg


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forced_variant_matches_reference(name):
    _, _, overrides, expected = VARIANTS[name]
    facts, cfg = resolved(name)
    for key, value in expected.items():
        assert facts[key] == value, (key, facts)
    for key, value in overrides.items():
        if key == "path":
            assert facts["path"] == value
        else:
            assert getattr(cfg, key) == value, key
    a = arrays_for(name)
    got = {k: np.asarray(v, np.float64) for k, v in program(name, "pallas")(a).items()}
    want = {k: np.asarray(v, np.float64) for k, v in program(name, "xla")(a).items()}
    np.testing.assert_allclose(got["P"], want["P"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-7)
    scale = max(np.max(np.abs(want["grad"])), 1e-30)
    np.testing.assert_allclose(got["grad"] / scale, want["grad"] / scale, atol=1e-5, rtol=0)
    assert np.max(np.abs(want["grad"])) > 1e-4


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forced_variant_compiles_for_v5p(name):
    require_libtpu()
    a = arrays_for(name)
    config = config_of(name)
    structs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in a.items()}

    def fwd_bwd(a):
        kw = call_kwargs(a)
        loss = lambda x: csa_pallas.indexer_distill_loss(x, a["q"], a["compressed_kv"],
                                                         head_chunk=config.get("head_chunk"),
                                                         implementation="pallas", config=config, **kw)
        return jax.value_and_grad(loss)(a["logits"])

    compiled = aot.compile_for_tpu(fwd_bwd, structs)
    assert "tpu_custom_call" in compiled.as_text()


def test_a_forced_variant_that_cannot_run_names_its_field():
    a = arrays_for("dense_table_cached")  # packed ids: a table schedule cannot walk pairs
    with pytest.raises(ValueError, match="^walk: 'pairs' needs the causal schedule"):
        csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], **call_kwargs(a),
                                        implementation="pallas", config=dict(block_q=16, block_k=128, walk="pairs"))
    with pytest.raises(ValueError, match="^tile_list: True needs sparse mode"):
        csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], **call_kwargs(a),
                                        implementation="pallas", config=dict(block_q=16, block_k=128, tile_list=True))
    sparse = arrays_for("sparse_visit_tile_lists")
    with pytest.raises(ValueError, match="^tile_list: True needs the plain walk, got walk='pairs'"):
        csa_pallas.indexer_distill_loss(sparse["logits"], sparse["q"], sparse["compressed_kv"],
                                        **call_kwargs(sparse), implementation="pallas",
                                        config=dict(block_q=16, block_k=128, tile_list=True, walk="pairs"))
    with pytest.raises(ValueError, match="^tile_list: expected None, True or False, got 1"):
        teacher_config.TeacherConfig(16, 128, 1, True, 1 << 25, tile_list=1)
    with pytest.raises(ValueError, match="^config: unknown field 'wlak'"):
        csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], **call_kwargs(a),
                                        implementation="pallas", config=dict(wlak="plain"))
    with pytest.raises(ValueError, match="^config: a kernel variant was given but the call runs the XLA reference"):
        csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], **call_kwargs(a),
                                        implementation="xla", config=dict(walk="plain"))
