"""The sparse student's gather kernels (`csa_pallas/kernels/student_gather.py`, SPEC §8) in interpret mode against
an XLA gather of the selected index_k rows.

Scores on every slot that names a block (0 <= index < N; future and cross-document blocks included: the loss masks
those, the kernels score them like any row) and the three gradients for a cotangent that is zero on the other
slots (what the loss hands them): within 1e-5 of f32 XLA for f32 inputs and one rounding for 16-bit ones. Drawn
shapes (K below, at and above N, H_I 1-5, d_I 16-128), -1 / out-of-range / duplicated slots, adversarial
selections, mixed dtypes, and the race- and out-of-bounds-checking interpreter (through the loss:
test_student.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import runtime, slot_rows, student_scores
from csa_pallas.kernels import student_gather as sg
from kernel_cases import compiled_pallas_calls

FAST = {"xla_backend_optimization_level": 0}  # CPU compiles of the interpreted kernels dominate


def _case(seed, *, batch=1, seq=24, blocks=20, width=12, heads=3, dim=16, q_dtype=jnp.float32, k_dtype=None,
          topk=None):
    rng = np.random.default_rng(seed)
    k_dtype = k_dtype or q_dtype
    idx = rng.integers(-1, blocks + 2, (batch, seq, width)).astype(np.int32) if topk is None else np.asarray(topk)
    valid = (idx >= 0) & (idx < blocks)
    return dict(q=jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), q_dtype),
                k=jnp.asarray(rng.standard_normal((batch, blocks, dim)), k_dtype),
                w=jnp.asarray(rng.standard_normal((batch, seq, heads)), q_dtype), idx=jnp.asarray(idx),
                valid=valid, g=jnp.asarray(rng.standard_normal(idx.shape), jnp.float32) * valid)


def _xla_scores(q, k, w, idx):
    rows = jax.vmap(lambda kb, ib: kb[jnp.clip(ib, 0, kb.shape[0] - 1)])(k.astype(jnp.float32), idx)  # [B,S,K,d]
    dots = jnp.einsum("bsjd,bskd->bsjk", q.astype(jnp.float32), rows, precision="highest")
    return jnp.einsum("bsj,bsjk->bsk", w.astype(jnp.float32), jax.nn.relu(dots), precision="highest")


def _compare(c, cfg=None):
    operand = student_scores.operand_dtype(c["q"].dtype, c["k"].dtype)
    run = lambda q, k, w: sg.scores(q, sg.resident_keys(k), w, c["idx"], operand, cfg)

    def scores_and_grads(q, k, w):  # one program (interpret-mode compiles dominate these tests' time)
        out, vjp = jax.vjp(run, q, k, w)
        return out, vjp(c["g"])
    got, grads = jax.jit(scores_and_grads, compiler_options=FAST)(c["q"], c["k"], c["w"])
    want = _xla_scores(c["q"], c["k"], c["w"], c["idx"])
    assert got.shape == want.shape and got.dtype == jnp.float32
    scale = max(float(jnp.max(jnp.abs(want))), 1.0)
    assert float(jnp.max(jnp.where(c["valid"], jnp.abs(got - want), 0.0))) <= 1e-5 * scale
    f32 = [x.astype(jnp.float32) for x in (c["q"], c["k"], c["w"])]
    wants = jax.grad(lambda *a: jnp.sum(_xla_scores(*a, c["idx"]) * c["g"]), argnums=(0, 1, 2))(*f32)
    for name, a, b, like in zip(("index_q", "index_k", "index_weights"), grads, wants, (c["q"], c["k"], c["w"])):
        assert a.dtype == like.dtype, name
        tol = {jnp.float32: 1e-5, jnp.float16: 2.0 ** -10, jnp.bfloat16: 2.0 ** -7}[jnp.dtype(a.dtype).type]
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= tol * max(np.max(np.abs(b)), 1e-30), name


@settings(max_examples=4, deadline=None)  # test_student_gather_kl draws the same gathers again
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 2), seq=st.integers(1, 40), blocks=st.integers(1, 40),
       width=st.integers(1, 140), heads=st.integers(1, 5), dim=st.sampled_from([16, 24, 128]), bf16=st.booleans())
def test_drawn_shapes_match_an_xla_gather(seed, batch, seq, blocks, width, heads, dim, bf16):
    """K below, at and above N; S and K off the tiles; -1, out-of-range and duplicated slots."""
    _compare(_case(seed, batch=batch, seq=seq, blocks=blocks, width=width, heads=heads, dim=dim,
                   q_dtype=jnp.bfloat16 if bf16 else jnp.float32))


@pytest.mark.parametrize("pattern", ["same_block", "distinct_far", "duplicates", "all_empty"])
def test_adversarial_selections(pattern):
    """Every query picks the same block (its dk row takes every query's read-modify-write); every query picks
    distinct blocks far away; each slot twice; no slot names a block (all -1: zero gradients)."""
    seq, blocks, width = 24, 300, 16
    rows = np.arange(seq)[:, None]
    topk = {"same_block": np.full((seq, width), 7),
            "distinct_far": (blocks - 1 - (rows * width + np.arange(width)) % blocks),
            "duplicates": np.repeat(np.random.default_rng(0).integers(0, blocks, (seq, width // 2)), 2, axis=1),
            "all_empty": np.full((seq, width), -1)}[pattern]
    _compare(_case(3, seq=seq, blocks=blocks, width=width, topk=topk[None].astype(np.int32)))


@pytest.mark.parametrize("q_dtype, k_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16),
                                              (jnp.float16, jnp.float32)])
def test_mixed_dtypes_run_f32_operands(q_dtype, k_dtype):
    _compare(_case(4, batch=2, seq=20, heads=2, dim=32, q_dtype=q_dtype, k_dtype=k_dtype))


def test_forced_query_tile():
    _compare(_case(5, batch=2, seq=70, blocks=50, width=130, heads=4, dim=64), sg.StudentGatherConfig(block_q=16))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows_log2=st.integers(0, 6), groups=st.integers(1, 3))
def test_scatter_plan_keeps_the_sums_and_makes_each_group_s_targets_distinct(seed, rows_log2, groups):
    """`scatter_plan`: scatter-adding the planned cotangent at the planned targets gives, on the R resident rows,
    what scatter-adding each slot's cotangent at the row it reads gives; the targets of each group of
    SCATTER_GROUP slots are distinct (what lets the kernel batch its read-modify-writes); discarded targets lie
    in [R, R + SCATTER_GROUP) and carry zero cotangent. Few rows force many duplicates."""
    rng = np.random.default_rng(seed)
    rows, width = 1 << rows_log2, groups * sg.SCATTER_GROUP
    read = rng.integers(0, rows, (5, width)).astype(np.int32)
    g = rng.standard_normal((5, width)).astype(np.float32)
    targets, planned = (np.asarray(x) for x in sg.scatter_plan(jnp.asarray(read), jnp.asarray(g), rows))
    want, got = np.zeros((5, rows)), np.zeros((5, rows + sg.SCATTER_GROUP))
    for t in range(5):
        np.add.at(want[t], read[t], g[t].astype(np.float64))
        np.add.at(got[t], targets[t], planned[t].astype(np.float64))
        for start in range(0, width, sg.SCATTER_GROUP):
            assert len(set(targets[t, start:start + sg.SCATTER_GROUP])) == sg.SCATTER_GROUP
    np.testing.assert_allclose(got[:, :rows], want, rtol=1e-6, atol=1e-6)
    discarded = targets >= rows
    assert np.all(targets < rows + sg.SCATTER_GROUP) and np.all(planned[discarded] == 0.0)


def test_race_and_out_of_bounds_checking_interpreter():
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", num_cores_or_threads=2)
    with runtime.interpret_override(params):
        _compare(_case(6, batch=1, seq=16, blocks=30, width=20, heads=2, dim=16, q_dtype=jnp.bfloat16))


def test_config_and_vmem_budget():
    with pytest.raises(ValueError, match="block_q: expected a positive multiple of 8, got 12"):
        sg.StudentGatherConfig(block_q=12)
    with pytest.raises(ValueError, match="vmem_limit_bytes: expected at least 1 MiB, got 1024"):
        sg.StudentGatherConfig(vmem_limit_bytes=1024)
    # S = 128K: N = 32768 resident f32 keys (16 MiB) and dk's accumulator fit; a million blocks do not
    assert sg.default_config(num_blocks=32768, heads=64, head_dim=128, width=512) is not None
    assert sg.default_config(num_blocks=1 << 20, heads=64, head_dim=128, width=512) is None


def test_declared_hbm_bytes_count_every_fetch():
    """CostEstimate.bytes_accessed is each operand's and result's HBM bytes once, plus the resident keys once more
    per extra fetch: the backward's grid fetches them per TensorCore and batch element, the forward's per batch
    element of each core's half of the query tiles (B = 3: the split falls inside the second element)."""
    b, s, h, d, n, k = 3, 32, 4, 16, 64, 8
    q, kk, w = jnp.ones((b, s, h, d), jnp.bfloat16), jnp.ones((b, n, d), jnp.bfloat16), jnp.ones((b, s, h))
    idx = jnp.zeros((b, s, k), jnp.int32)
    loss = lambda q, kk, w: jnp.sum(sg.scores_of_one_chunk(q, kk, w, idx))
    calls = {eqn.params["name"]: eqn for eqn in compiled_pallas_calls(
        jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kk, w).jaxpr)}
    nbytes = lambda avals: sum(a.size * a.dtype.itemsize for a in avals)
    one_key_set = (sg.sparse_gather.resident_row_count(n) + sg.ZERO_ROWS) * 128 * 4
    for name, eqn in calls.items():
        moved = nbytes([v.aval for v in eqn.invars]) + nbytes([v.aval for v in eqn.outvars])
        extra = (sg.CORES - 1) * b * one_key_set if "grads" in name else one_key_set
        assert eqn.params["cost_estimate"].bytes_accessed == moved + extra, name
    assert len(calls) == 2
    # the helper's cases: one element over both cores; a boundary between elements; a boundary inside one
    assert [sg.common.resident_fetches(b, 4) for b in (1, 2, 3)] == [2, 2, 4]


def _slot_rows_copy(slots, interpret):
    """Each query's row of an int32 [bq, 128] SMEM block, read through `slot_rows.for_each_query` (DMA'd into the
    static rows) and written out as f32 rows: the copy the kernels' per-slot loops read."""
    def kernel(slots_ref, out_ref, buf_ref, sem_ref):
        def per_query(t, row):
            lane = jax.lax.broadcasted_iota(jnp.int32, (1, 128), 1)
            values = jnp.zeros((1, 128), jnp.float32)
            for k in range(128):  # scalar reads from the static row, as the gathers do
                values = jnp.where(lane == k, row[k].astype(jnp.float32), values)
            out_ref[pl.ds(t, 1), :] = values

        slot_rows.for_each_query([slots_ref], buf_ref, sem_ref, per_query)

    bq = slots.shape[0]
    return pl.pallas_call(
        kernel, grid=(1,), in_specs=[pl.BlockSpec((bq, 128), lambda i: (0, 0), memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((bq, 128), lambda i: (0, 0)), out_shape=jax.ShapeDtypeStruct((bq, 128), jnp.float32),
        scratch_shapes=slot_rows.scratch(128, 1), interpret=interpret)(slots)


def test_slot_rows_hand_each_query_its_own_slots_under_the_race_checking_interpreter():
    slots = jnp.asarray(np.random.default_rng(0).integers(-5, 1000, (6, 128)), jnp.int32)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise")
    np.testing.assert_array_equal(np.asarray(_slot_rows_copy(slots, params)), np.asarray(slots, np.float32))
    with pytest.raises(ValueError, match="block_q: expected an even number of queries per tile, got 5"):
        _slot_rows_copy(slots[:5], True)
