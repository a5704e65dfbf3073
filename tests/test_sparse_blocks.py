"""Sparse mode's KL over blocks (`csa_pallas.sparse_blocks`) and the visit student that takes it
(`fused_student`): the teacher kernel's block-order target (interpret mode, every pass-2 variant, against the
reference's slot-order P summed per block), the duplicate counts, the fused op with the visit student against the
float64 oracle, and the dispatch between the visit and gather students. The v5p compiles are in
test_aot_student.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from csa_pallas import ops_sparse, reference, sparse_blocks, student_plan, validation
from csa_pallas.kernels import runtime
from csa_pallas.kernels.student_gather import StudentGatherConfig
from csa_pallas.kernels.student_scores import StudentKernelConfig
from test_sparse_kernels import _problem, sparse_case
from student_cases import check, make_student_case

FAST = {"xla_backend_optimization_level": 0}


def _expected_block_target(problem):
    """The reference's slot-order P scattered onto the blocks (float64), and the selected blocks."""
    p_slots, _ = reference.teacher(problem)
    valid = np.asarray(ops_sparse.slot_validity(problem))
    idx = np.asarray(problem.topk_indices)
    b, s, _ = idx.shape
    out = np.zeros((b, s, problem.num_blocks))
    selected = np.zeros((b, s, problem.num_blocks), bool)
    bi, ti, ki = np.nonzero(valid)
    np.add.at(out, (bi, ti, idx[bi, ti, ki]), np.asarray(p_slots, np.float64)[bi, ti, ki])
    selected[bi, ti, idx[bi, ti, ki]] = True
    return out, selected


@pytest.mark.parametrize("name, overrides, head_chunk, target, num_docs", [
    ("cached", {}, None, "joint", 1),
    ("walked_pass2", {"cache_scores": False}, None, "per_head", 2),
    ("head_chunks", {"cache_scores": False}, 1, "joint", 2),
    ("cached_head_chunks", {"cache_scores": True, "walk": "plain"}, 1, "per_head", 1),
    ("tile_lists", {"tile_list": True}, None, "joint", 2),
    ("tile_lists_walked_pass2", {"tile_list": True, "cache_scores": False}, 1, "per_head", 1),
])
def test_block_target_is_the_slot_target_summed_per_block(name, overrides, head_chunk, target, num_docs):
    """P~[t, s] = the sum of P over row t's valid slots holding s (duplicates, -1, out-of-range, future and
    cross-document slots in the case), -1 on every other block; under the race- and bounds-checking interpreter.
    walked_pass2 recomputes each tile's slot counts in pass 2 (not cached); head chunks rescale across chunks;
    tile_lists walk lists of the selected kv tiles (3 of 128 blocks, the later query tiles' lists missing some)."""
    listed = overrides.get("tile_list", False)
    seq, ratio = (384, 1) if listed else (96, 4)
    arrays = sparse_case(31, width=24, seq=seq, ratio=ratio, heads=2, head_dim=32, num_docs=num_docs)
    if listed:  # the rows of the last 128 queries pick no block of kv tile 1: their lists are [0, 2], [0], ...
        idx = np.asarray(arrays["topk_indices"]).copy()
        late = idx[:, 256:]
        late[(late >= 128) & (late < 256)] = 5
        arrays["topk_indices"] = jnp.asarray(idx)
    problem = _problem(arrays, target=target, ratio=ratio, window=16, head_chunk=head_chunk)
    layout = ops_sparse.sparse_layout(problem, dict(path="visit", block_q=16, block_k=128, **overrides))
    assert layout.path == "visit" and layout.schedule.listed == listed
    if listed:  # each query tile's list: the kv tiles its valid slots select
        sel = ops_sparse.selection_inputs(problem, layout)
        lists, counts = np.asarray(sel.firsts).reshape(-1, 3), np.asarray(sel.counts)
        valid = np.asarray(ops_sparse.slot_validity(problem))
        tiles = np.where(valid, np.asarray(problem.topk_indices) // 128, -1).reshape(-1, 16 * 24)
        want = [sorted(set(row[row >= 0].tolist())) for row in tiles]
        assert [lists[r, :counts[r]].tolist() for r in range(len(want))] == want
        assert counts[-1] == max(map(len, want)) and any(w and w != list(range(w[0], w[-1] + 1)) for w in want)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", num_cores_or_threads=2)
    with runtime.interpret_override(params):
        def run(a):
            p, sel = sparse_blocks.block_target(_problem(a, target=target, ratio=ratio, window=16,
                                                         head_chunk=head_chunk), layout)
            return p, sparse_blocks.has_duplicates(sel)
        target_p, duplicates = jax.jit(run, compiler_options=FAST)(arrays)
    expected, selected = _expected_block_target(problem)
    s, n = problem.seq_len, problem.num_blocks
    got = np.asarray(target_p)[:, :s, :n]
    np.testing.assert_allclose(np.where(selected, got, 0.0), expected, atol=1e-6)
    assert np.all(got[~selected] == -1.0)
    assert np.all(np.asarray(target_p)[:, s:] == -1.0) and np.all(np.asarray(target_p)[:, :, n:] == -1.0)
    assert bool(duplicates)  # the case holds duplicated indices


def test_slot_counts_are_added_only_where_some_row_has_duplicates():
    arrays = sparse_case(32, width=16, seq=64, heads=2, head_dim=32)
    k = np.arange(16)[None, None, :]
    limit = (np.arange(64)[None, :, None] + 1) // 4
    arrays["topk_indices"] = jnp.asarray(np.where(k < limit, limit - 1 - k, -1), jnp.int32)  # distinct, recent
    problem = _problem(arrays, target="per_head", ratio=4, window=16, head_chunk=None)
    layout = sparse_blocks.layout_of(problem)
    sel = ops_sparse.selection_inputs(problem, layout)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, problem.num_blocks)), jnp.float32)
    idx, valid = np.asarray(problem.topk_indices), np.asarray(ops_sparse.slot_validity(problem))
    counts = np.zeros(logits.shape)
    bi, ti, ki = np.nonzero(valid)
    np.add.at(counts, (bi, ti, idx[bi, ti, ki]), 1.0)
    assert counts.max() == 1 and not bool(sparse_blocks.has_duplicates(sel))  # no row repeats a block: I as is
    np.testing.assert_array_equal(sparse_blocks.with_slot_counts(logits, sel, layout.padded_blocks), logits)
    # the same rows with slot 1 repeating slot 0: I + log c exactly
    idx2 = np.asarray(problem.topk_indices).copy()
    idx2[..., 1] = idx2[..., 0]
    problem2 = _problem(dict(arrays, topk_indices=jnp.asarray(idx2)), target="per_head", ratio=4, window=16,
                        head_chunk=None)
    sel2 = ops_sparse.selection_inputs(problem2, layout)
    valid2 = np.asarray(ops_sparse.slot_validity(problem2))
    counts2 = np.zeros(logits.shape)
    bi, ti, ki = np.nonzero(valid2)
    np.add.at(counts2, (bi, ti, idx2[bi, ti, ki]), 1.0)
    assert counts2.max() == 2 and bool(sparse_blocks.has_duplicates(sel2))
    got = sparse_blocks.with_slot_counts(logits, sel2, layout.padded_blocks)
    np.testing.assert_allclose(got, np.asarray(logits) + np.log(np.maximum(counts2, 1.0)), rtol=1e-6)


@pytest.mark.parametrize("target, query_chunk, reduction, dtype", [
    ("joint", None, "mean", jnp.float32),
    ("per_head", 16, "sum", jnp.float32),
    ("joint", 32, "mean", jnp.float32),
    ("per_head", None, "mean_all", jnp.bfloat16),
])
def test_visit_student_matches_the_oracle(target, query_chunk, reduction, dtype):
    """The visit student forced by a StudentKernelConfig (packing, loss_mask, duplicated and invalid slots), one
    chunk and chunked (table schedules), the scalar reductions, bf16: value and the three gradients (per-row
    cotangents: test_student_chunks.py's rematerialised-chunks test)."""
    c, kw = make_student_case(41, batch=2, seq=64, topk=7, num_docs=2, loss_mask=True, dtype=dtype)
    check(c, kw, target, implementation="pallas", reduction=reduction, query_chunk=query_chunk,
           student=StudentKernelConfig(block_q=16, block_k=128))


def test_an_infinite_sink_empties_the_row_for_the_visit_student():
    """Every head's mass on its sink (+inf): the row is empty (P = 0 on its selected blocks), as in the oracle."""
    c, kw = make_student_case(42, seq=64, topk=6)
    kw["sinks"] = jnp.asarray([np.inf, np.inf], jnp.float32)
    check(c, kw, "joint", implementation="pallas", student=StudentKernelConfig(block_q=16, block_k=128))


def _flash(seq, heads=64, width=512):
    s = jax.ShapeDtypeStruct
    found = {}

    def trace(q, kv, idx):
        found["p"] = validation.validate(q, kv, topk_indices=idx, target="per_head")
        return jnp.zeros(())
    jax.eval_shape(trace, s((1, seq, heads, 512), jnp.bfloat16), s((1, seq // 4, 512), jnp.bfloat16),
                   s((1, seq, width), jnp.int32))
    return found["p"]


def test_the_dispatch_between_the_visit_and_gather_students():
    """`student_plan.visit_rule`: the visit student where the sparse teacher takes its visit path and the visit
    student's program fits one query chunk (S = 4K at m = 4: 48 MiB), the gather student otherwise (Flash and Pro
    widths alike). A config forces either; the visit student's chunks count [rows, N] arrays, as dense mode's."""
    shape = (1, 0, 64, 128)
    for seq, heads, width, visit in [(4096, 64, 512, True), (8192, 64, 512, False), (16384, 64, 512, False),
                                     (32768, 64, 512, False), (4096, 128, 1024, True), (16384, 128, 1024, False)]:
        problem = _flash(seq, heads, width)
        assert student_plan.visit_rule(problem) == visit, seq
        cfg = student_plan.kernel_config("auto", problem, shape)
        assert isinstance(cfg, StudentKernelConfig if visit else StudentGatherConfig), seq
        assert student_plan.visit_student("auto", problem, shape) == visit
        assert student_plan.visit_student(StudentKernelConfig(), problem, shape)
        assert not student_plan.visit_student(StudentGatherConfig(), problem, shape)
        assert not student_plan.visit_student("xla", problem, shape)
    # one chunk at 4K (12 N bytes per row: 48 MiB), 1024-row chunks at 8K (dense mode's 5 f32 [rows, N] arrays)
    assert student_plan.default_query_chunk(_flash(4096), 8, 128, student_kernels=True, index_heads=64,
                                             visit=True) == 4096
    assert student_plan.default_query_chunk(_flash(8192), 8, 128, student_kernels=True, index_heads=64,
                                             visit=True) == 1024
