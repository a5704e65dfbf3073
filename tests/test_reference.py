"""The pure-JAX reference (`implementation="xla"` through the public API) against the float64 oracle (SPEC §2-§4, §6).

Every check compares real numbers: the target P (`teacher_distribution`), the per-row KL (`reduction="none"`) and the
four reductions times a `scale` != 1, for both targets, dense and sparse mode, packed and unpacked sequences, f32 and
bf16 inputs (the oracle is fed the same bf16 values upcast exactly). Tolerances are SPEC §6: 1e-6 absolute on P and on
the KL rows, 1e-6 relative + absolute on the reduced loss; the one exception is the KL rows of local-dominant rows
(u - C > 15 nats), held to 1e-6 relative + absolute (see `check_against_oracle`).

Speed: each configuration is compiled once by `jax.jit` (eager dispatch of the reference is ~5 s per call on CPU) with
the XLA:CPU backend optimisation level 0, which only changes LLVM code generation, not the float semantics, and cuts the
compile time of these small programs by ~2.5x.

The problems and runners (`make_case`, `cases`, `check_against_oracle`, ...) are `reference_cases.py`.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import csa_pallas
import oracle
from reference_cases import (FAST, REDUCTIONS, SPARSE, TARGETS, TOL, Case, cases, check_against_oracle, f64,
                             fresh_logits, make_case, named_case, oracle_compressed_lse, oracle_u, run_forward, support,
                             value_and_grad)

# ----------------------------------------------------------------------------------------------------------------------
# Grid and property tests
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("target", TARGETS)
def test_grid_matches_oracle(target, sparse, packed, dtype):
    """Every target x mode x packing x dtype, all four reductions, at one shape with S % m != 0."""
    seed = 1000 + 8 * TARGETS.index(target) + 4 * sparse + 2 * packed + (dtype == "bfloat16")
    case = make_case(seed, B=2, S=19, H=3, D=8, m=4, W=5, K=6 if sparse else None, target=target, dtype=dtype,
                     packed=packed, sinks="normal", min_docs=3, explicit_ids=True)
    if packed:
        assert all(len(np.unique(row)) >= 3 for row in case.arrays["segment_ids"]), "packing precondition"
    out = check_against_oracle(case)
    assert np.any(out["rows"] > 1e-3), "the test must compare non-trivial KL values"


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@settings(max_examples=6)
@given(data=st.data())
def test_property_matches_oracle(sparse, data):
    check_against_oracle(data.draw(cases(sparse)))


# ----------------------------------------------------------------------------------------------------------------------
# Named edge cases (SPEC §6, anchors §I)
# ----------------------------------------------------------------------------------------------------------------------


@SPARSE
def test_empty_rows(sparse):
    """t <= m-2 sees no block; sparse rows of only -1 / future / out-of-range slots are empty too: finite, 0, grad 0."""
    case = named_case(1, sparse)
    empty = np.zeros((1, 16), bool)
    empty[0, :3] = True
    if sparse:
        topk = case.arrays["topk_indices"].copy()
        topk[0, 5] = -1
        topk[0, 7] = [3, 4, -1, 2**31 - 1, -3]  # future block 3 (ends at 15), out of range, -1, huge, negative
        topk[0, 9] = [0, 1, 0, 1, 0]  # visible: guards against declaring everything empty
        empty[0, [5, 7]] = True
        case = fresh_logits(case.replace(topk_indices=topk), 101)
    V = support(case)
    np.testing.assert_array_equal(~V.any(-1), empty)
    out = check_against_oracle(case)
    assert np.all(out["P"][empty] == 0) and np.all(out["rows"][empty] == 0)
    val, grad = value_and_grad(case, "sum")
    assert np.isfinite(val) and np.all(np.isfinite(grad))
    assert np.all(grad[empty] == 0)
    assert np.any(grad[~empty] != 0)


def test_all_rows_empty_dense_no_blocks():
    """S < m: N = 0 blocks, every row empty; dense loss is exactly 0 (mean divides by max(1, 0))."""
    case = make_case(2, S=3, m=4, H=2)
    assert case.compressed_kv.shape[1] == 0
    out = check_against_oracle(case)
    assert out["mean"] == 0 and out["sum"] == 0 and np.all(out["rows"] == 0)


def test_sparse_without_blocks():
    """S < m in sparse mode: every slot is out of range, every row empty; the loss must be 0 like in dense mode."""
    case = make_case(3, S=3, m=4, H=2, K=2)
    out = check_against_oracle(case)
    assert out["mean"] == 0 and np.all(out["rows"] == 0)


@SPARSE
def test_block_boundary_flip(sparse):
    """Block s becomes visible exactly at t = (s+1)m-1, not at t = (s+1)m-2; S = 14 is not a multiple of m = 4."""
    m, S = 4, 14
    case = make_case(4, S=S, m=m, H=2, K=5 if sparse else None)
    N = case.compressed_kv.shape[1]
    assert N == 3
    if sparse:  # slot k holds block k in every row (slot 3 is out of range, slot 4 empty)
        case = fresh_logits(case.replace(topk_indices=np.tile(np.array([0, 1, 2, 3, -1], np.int32), (1, S, 1))), 102)
    out = check_against_oracle(case)
    for s in range(N):
        t_before, t_at = (s + 1) * m - 2, (s + 1) * m - 1
        assert out["P"][0, t_before, s] == 0, f"block {s} visible too early at t={t_before}"
        assert out["P"][0, t_at, s] > 0, f"block {s} not visible at t={t_at}"
    assert np.all(out["P"][0, :, N:] == 0)


@SPARSE
def test_straddling_block_invisible_and_documents_isolated(sparse):
    """Docs [0, 6) and [6, 16), m = 4: block 1 (tokens 4..7) straddles and is invisible to every query; doc-2 queries
    never see doc-1 block 0; doc-2 positions restart, so its blocks appear by position, not by index."""
    S = 16
    seg = np.array([[0] * 6 + [1] * 10], np.int32)
    pos = np.array([list(range(6)) + list(range(10))], np.int32)
    case = named_case(5, sparse).replace(segment_ids=seg, positions=pos)
    slots = [0, 1, 2, 3, 1]
    if sparse:
        case = case.replace(topk_indices=np.tile(np.array(slots, np.int32), (1, S, 1)))
    case = fresh_logits(case, 103)
    out = check_against_oracle(case)
    P = out["P"][0]
    col = (lambda s: [k for k in range(len(slots)) if slots[k] == s]) if sparse else (lambda s: [s])
    assert np.all(P[:, col(1)] == 0), "straddling block 1 must be invisible"
    assert np.all(P[6:, col(0)] == 0), "doc-2 queries must give 0 to doc-1 block 0"
    assert np.all(P[:3, col(0)] == 0) and np.all(P[3:6, col(0)] > 0)
    # block 2 = tokens 8..11 (doc 2, positions 2..5): visible from t = 6 + 5 on
    assert np.all(P[6:11, col(2)] == 0) and np.all(P[11:, col(2)] > 0)
    # block 3 = tokens 12..15 (doc 2, positions 6..9): visible to t = 15 only
    assert np.all(P[:15, col(3)] == 0) and np.all(P[15, col(3)] > 0)


def local_dominant_case(seed, sparse) -> Case:
    """Every head's window logits sit ~32 nats above its compressed logits: u - C ~ 30 nats (well below the
    87-104 nats where f32 exp flushes to 0). Same shapes and arrays as `named_case` (the -30 sinks are negligible)."""
    case = named_case(seed, sparse, sinks="tiny")
    rng = np.random.default_rng(seed)
    B, S, H, D = case.q.shape
    v = rng.normal(size=D)
    v /= np.linalg.norm(v)
    q = 2.0 * v + 0.05 * rng.normal(size=(B, S, H, D))
    window = np.broadcast_to(16.0 / case.tau * v, (B, S, D)) + 0.05 * rng.normal(size=(B, S, D))
    return case.replace(q=q.astype(np.float32), window_kv=window.astype(np.float32))


@SPARSE
def test_local_dominant_heads(sparse):
    case = local_dominant_case(6, sparse)
    V = support(case)
    gap = (oracle_u(case) - oracle_compressed_lse(case))[V.any(-1)]
    assert 25 < gap.min() and gap.max() < 60, f"precondition: u - C = {gap.min()}..{gap.max()} nats"
    out = check_against_oracle(case)
    np.testing.assert_allclose(out["P"].sum(-1)[V.any(-1)], 1.0, rtol=0, atol=TOL)


@pytest.mark.parametrize("sinks", ["huge", "tiny", "mixed"])
@SPARSE
def test_extreme_sinks(sparse, sinks):
    """Sinks of +30 (every head's mass goes to the sink: u - C ~ 30), -30 (negligible) and one of each."""
    case = named_case(7, sparse, sinks=np.array([30.0, -30.0]) if sinks == "mixed" else sinks)
    out = check_against_oracle(case)
    # sinks are data here, so this reuses the same compiled program
    normal = run_forward(case.replace(sinks=np.zeros(2, np.float32) - 1e4))  # a sink of -1e4 is no sink at all
    diff = np.max(np.abs(out["P"] - normal["P"]))
    assert (diff < 1e-6) if sinks == "tiny" else (diff > 1e-3), diff


@SPARSE
def test_single_visible_block(sparse):
    """A row with exactly one entry in V(t) has P = 1 there, KL 0 and gradient 0 (to one f32 rounding: the row
    normalisation divides by a broadcast sum, which XLA computes as a reciprocal times the sum)."""
    case = named_case(8, sparse)
    if sparse:
        topk = case.arrays["topk_indices"].copy()
        topk[0, 12] = [-1, 2, 3, 9, -1]  # block 2 (ends at 11) visible, block 3 (ends at 15) future, 9 out of range
        case = fresh_logits(case.replace(topk_indices=topk), 104)
        single = [(12, 1)]
    else:
        single = [(t, 0) for t in range(3, 7)]  # t = 3..6 see block 0 only
    V = support(case)
    for t, k in single:
        assert V[0, t].sum() == 1 and V[0, t, k]
    out = check_against_oracle(case)
    _, grad = value_and_grad(case, "sum")
    for t, k in single:  # exact up to the one rounding of the row normalisation
        assert abs(out["P"][0, t, k] - 1.0) <= 1.2e-7
        assert abs(out["rows"][0, t]) <= 1.2e-7
        assert np.all(np.abs(grad[0, t]) <= 1.2e-7)


def test_k_greater_than_n():
    """K = 12 slots over N = 4 blocks: duplicates and invalid slots necessarily; values still match the oracle."""
    case = named_case(9, True, K=12)
    out = check_against_oracle(case)
    assert np.any(out["rows"] > 1e-3)


@SPARSE
def test_joint_equals_per_head_for_one_head(sparse):
    """H = 1: the joint normaliser F cancels, so both targets coincide (within 1e-6) although u is comparable to C."""
    case = named_case(10, sparse, H=1, sinks="normal")
    V = support(case)
    gap = np.abs(oracle_u(case) - oracle_compressed_lse(case))[V.any(-1)]
    assert gap.min() < 3, "precondition: the window must carry real mass, or the test is vacuous"
    joint = check_against_oracle(case)
    per_head = run_forward(case.replace(static={"target": "per_head"}))
    np.testing.assert_allclose(joint["P"], per_head["P"], rtol=0, atol=TOL)
    np.testing.assert_allclose(joint["rows"], per_head["rows"], rtol=0, atol=TOL)
    for red in REDUCTIONS:
        np.testing.assert_allclose(joint[red], per_head[red], rtol=TOL, atol=TOL)


@SPARSE
def test_joint_differs_from_per_head_for_two_heads(sparse):
    """H = 2 with different conditionals and different window/sink shares: the targets differ by > 1e-3."""
    case = named_case(11, sparse, sinks=np.array([3.0, -3.0]))
    joint = check_against_oracle(case)
    per_head = check_against_oracle(case.replace(static={"target": "per_head"}))
    assert np.max(np.abs(joint["P"] - per_head["P"])) > 1e-3
    assert np.max(np.abs(joint["rows"] - per_head["rows"])) > 1e-3


@SPARSE
def test_nan_and_inf_logits_outside_support_do_not_leak(sparse):
    """Logits outside V(t) (NaN, -inf, +inf, 1e30) leave the loss and gradient bitwise unchanged and finite."""
    case = named_case(12, sparse, garbage=False)
    V = support(case)
    assert (~V).sum() > 10
    rng = np.random.default_rng(0)
    v_clean, g_clean = value_and_grad(case, "sum", 1.3, logits=np.where(V, case.logits, 0.0).astype(np.float32))
    assert np.any(g_clean != 0)
    for junk in (np.nan, -np.inf, np.inf, "mixed"):
        fill = rng.choice(np.array([np.nan, -np.inf, np.inf, 1e30]), size=V.shape) if junk == "mixed" else junk
        dirty = np.where(V, case.logits, fill).astype(np.float32)
        v_dirty, g_dirty = value_and_grad(case, "sum", 1.3, logits=dirty)
        assert np.isfinite(v_dirty) and np.all(np.isfinite(g_dirty))
        assert v_dirty == v_clean
        np.testing.assert_array_equal(g_dirty, g_clean)
    check_against_oracle(case.replace(logits=dirty))


@SPARSE
def test_full_lse_and_noncompressed_lse_paths_match_window_path(sparse):
    """F (oracle, float64, cast f32) via full_lse and u via noncompressed_lse give the window_kv path's values."""
    case = named_case(13, sparse, packed=True, sinks="normal")
    window = check_against_oracle(case)
    u = oracle_u(case)
    F = np.logaddexp(u, oracle_compressed_lse(case))
    via_u = case.replace(window_kv=None, sinks=None, noncompressed_lse=u.astype(np.float32))
    via_f = case.replace(window_kv=None, sinks=None, full_lse=F.astype(np.float32))
    for alt in (via_u, via_f):
        out = check_against_oracle(alt)
        np.testing.assert_allclose(out["P"], window["P"], rtol=0, atol=TOL)
        np.testing.assert_allclose(out["rows"], window["rows"], rtol=0, atol=TOL)
        for red in REDUCTIONS:
            np.testing.assert_allclose(out[red], window[red], rtol=TOL, atol=TOL)
    # the oracle's own full_lse path agrees with its window path (guards the comparison above)
    np.testing.assert_allclose(oracle.teacher(f64(case.q), f64(case.compressed_kv), **via_f.oracle_kw()),
                               oracle.teacher(f64(case.q), f64(case.compressed_kv), **case.oracle_kw()),
                               rtol=0, atol=1e-6)


def test_public_noncompressed_lse_matches_oracle():
    """u from the public `noncompressed_lse` (window + sinks, packed) against the oracle's u."""
    case = make_case(14, B=2, H=3, packed=True, sinks="normal", W=4)
    kw = case.arrays
    fn = jax.jit(functools.partial(csa_pallas.noncompressed_lse, window_size=4, implementation="xla"),
                 compiler_options=FAST)
    u = fn(case.q, kw["window_kv"], sinks=kw["sinks"], segment_ids=kw["segment_ids"], positions=kw["positions"])
    np.testing.assert_allclose(np.asarray(u, np.float64), oracle_u(case), rtol=TOL, atol=TOL)


def test_duplicate_topk_indices():
    """A block selected in two slots is counted per slot (oracle convention): both slots get the same P."""
    case = named_case(15, True)
    topk = case.arrays["topk_indices"].copy()
    topk[0, 9:] = [1, 0, 1, -1, 1]  # block 1 three times, block 0 once
    topk[0, 5] = [0, 0, 0, 0, 0]  # a single block in every slot: uniform P = 1/5
    case = fresh_logits(case.replace(topk_indices=topk), 105)
    out = check_against_oracle(case)
    P = out["P"][0, 9:]
    assert np.all(P[:, 0] == P[:, 2]) and np.all(P[:, 0] == P[:, 4])
    assert np.all(P[:, 0] > 0) and np.all(P[:, 3] == 0)
    np.testing.assert_allclose(out["P"][0, 5], 0.2, rtol=0, atol=TOL)


def test_context_parallel_query_shard():
    """S_kv = 2S: the queries are the second half of the key sequence (kv ids given, packed key side)."""
    S, m = 12, 4
    rng = np.random.default_rng(16)
    kv_seg = np.array([[0] * 6 + [1] * 18], np.int32)
    kv_pos = np.array([list(range(6)) + list(range(18))], np.int32)
    case = make_case(16, S=2 * S, m=m, H=2, W=5, sinks="normal")  # full-length key side
    q = rng.normal(size=(1, S, 2, 8)).astype(np.float32)
    case = case.replace(q=q, logits=case.logits[:, S:], segment_ids=kv_seg[:, S:], positions=kv_pos[:, S:],
                        kv_segment_ids=kv_seg, kv_positions=kv_pos)
    case = fresh_logits(case, 106)
    out = check_against_oracle(case)
    # block 2 = key tokens 8..11 (doc 2, positions 2..5) lies before the shard: every query of the shard sees it;
    # block 0 (doc 1) and the straddling block 1 are invisible
    assert np.all(out["P"][0, :, 2] > 0) and np.all(out["P"][0, :, :2] == 0)


@pytest.mark.parametrize("W", [1, 100])
def test_window_extremes(W):
    """W = 1 (the query's own key only) and W >= S (still causal)."""
    check_against_oracle(make_case(17, S=16, H=2, W=W, packed=True, sinks=None))
