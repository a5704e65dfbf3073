"""The student kernels (`csa_pallas/kernels/student_scores.py`, SPEC §8) in interpret mode against the XLA student.

Scores on every entry a query may see, and the three gradients for a cotangent that is zero outside V(t) (what the
loss hands them), within 1e-5 of the f32 XLA student for f32 inputs and one bf16 rounding for bf16 ones: drawn
shapes (S and N off the tiles, H_I 1-8, d_I 16-128), packed documents, forced tiles, the skip table's coverage, and the
race- and out-of-bounds-checking interpreter (`student=` on the fused op: test_student.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from csa_pallas import masks
from csa_pallas.kernels import runtime, student_schedule
from csa_pallas.kernels import student_scores as sk
from kernel_cases import packed_ids

RATIO = 4

FAST = {"xla_backend_optimization_level": 0}  # CPU compiles of the interpreted kernels dominate


def _case(seed, *, batch=1, seq=40, blocks=None, heads=3, dim=16, dtype=jnp.float32, num_docs=1):
    rng = np.random.default_rng(seed)
    n = blocks if blocks is not None else seq // RATIO
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, n, dim)), dtype)
    w = jnp.asarray(rng.standard_normal((batch, seq, heads)), dtype)
    if num_docs > 1:
        seg, pos = packed_ids(rng, batch, seq, num_docs)
    else:
        seg, pos = np.zeros((batch, seq), np.int32), np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    kv_len = n * RATIO
    kv_seg = np.zeros((batch, kv_len), np.int32)
    kv_pos = np.broadcast_to(np.arange(kv_len, dtype=np.int32), (batch, kv_len))
    if kv_len == seq:
        kv_seg, kv_pos = seg, pos
    block_seg, block_end = masks.block_keys(jnp.asarray(kv_seg), jnp.asarray(kv_pos), RATIO, n)
    visible = masks.block_visible(jnp.asarray(seg), jnp.asarray(pos), block_seg, block_end)
    g = jnp.asarray(rng.standard_normal((batch, seq, n)), jnp.float32) * visible
    return dict(q=q, k=k, w=w, positions=jnp.asarray(pos), block_end=block_end, visible=visible, g=g)


def _xla_scores(q, k, w):
    dots = jnp.einsum("bsjd,bnd->bsjn", q.astype(jnp.float32), k.astype(jnp.float32), precision="highest")
    return jnp.einsum("bsj,bsjn->bsn", w.astype(jnp.float32), jax.nn.relu(dots), precision="highest")


def _scores_and_grads(run, c):
    """(scores, the three gradients for the cotangent c["g"]) from one jitted program (interpret-mode compiles
    dominate these tests' time)."""
    def both(q, k, w):
        out, vjp = jax.vjp(run, q, k, w)
        return out, vjp(c["g"])
    return jax.jit(both, compiler_options=FAST)(c["q"], c["k"], c["w"])


def _compare(c, cfg=None):
    """The kernels' scores and gradients against the XLA student's; returns them."""
    run = lambda q, k, w: sk.scores(q, k, w, c["positions"], c["block_end"], cfg)
    got, grads = _scores_and_grads(run, c)
    want = _xla_scores(c["q"], c["k"], c["w"])
    scale = float(jnp.max(jnp.abs(want)))
    assert got.shape == want.shape and got.dtype == jnp.float32
    err = float(jnp.max(jnp.where(c["visible"], jnp.abs(got - want), 0.0)))
    assert err <= 1e-5 * max(scale, 1.0), err
    wants = jax.grad(lambda *a: jnp.sum(_xla_scores(*a) * c["g"]), argnums=(0, 1, 2))(c["q"], c["k"], c["w"])
    for name, a, b in zip(("index_q", "index_k", "index_weights"), grads, wants):
        assert a.dtype == b.dtype, name
        # bf16 / f16 gradients: the f32 gradient rounded once on each side (one ulp apart at most)
        tol = {jnp.float32: 1e-5, jnp.float16: 2.0 ** -10, jnp.bfloat16: 2.0 ** -7}[jnp.dtype(a.dtype).type]
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= tol * max(np.max(np.abs(b)), 1e-30), name
    return got, grads


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), seq=st.integers(1, 150), heads=st.integers(1, 8),
       dim=st.sampled_from([16, 24, 64, 128]), bf16=st.booleans(), docs=st.sampled_from([1, 2]))
def test_drawn_shapes_match_the_xla_student(seed, seq, heads, dim, bf16, docs):
    seq = max(seq, RATIO * docs)
    c = _case(seed, seq=seq, heads=heads, dim=dim, dtype=jnp.bfloat16 if bf16 else jnp.float32, num_docs=docs)
    _compare(c, sk.StudentKernelConfig(block_q=16, block_k=128))


@pytest.mark.parametrize("block_q, block_k, trim", [(16, 128, True), (32, 256, True), (32, 256, False),
                                                    (128, 128, True), (64, 512, True)])
def test_forced_tiles(block_q, block_k, trim):
    """seq 400 against 600 blocks (keys past the queries): the kv tiles' visible prefixes end inside them."""
    c = _case(1, batch=2, seq=400, blocks=600, heads=2, dim=32, num_docs=1)
    _compare(c, sk.StudentKernelConfig(block_q=block_q, block_k=block_k, trim_kv_tile=trim))


def test_default_tiles_bf16_packed():
    _compare(_case(2, batch=2, seq=160, heads=4, dim=128, dtype=jnp.bfloat16, num_docs=3))


@pytest.mark.parametrize("q_dtype, k_dtype, heads", [
    (jnp.bfloat16, jnp.bfloat16, 5), (jnp.bfloat16, jnp.float32, 3), (jnp.float32, jnp.bfloat16, 1),
    (jnp.float16, jnp.float32, 2)])
def test_query_row_order_for_each_dtype_and_head_count(q_dtype, k_dtype, heads):
    """index_q enters in its own row order: bf16 heads are read in 32-bit pairs (an odd H_I gets a zero head),
    every other dtype as f32 rows one head at a time; the operands are f32 unless both sides are bf16."""
    c = _case(5, batch=2, seq=70, heads=heads, dim=24, num_docs=2)
    c.update(q=c["q"].astype(q_dtype), k=c["k"].astype(k_dtype), w=c["w"].astype(q_dtype))
    _compare(c, sk.StudentKernelConfig(block_q=32, block_k=128))
    assert sk.row_queries(c["q"], sk.StudentKernelConfig(block_q=32)).shape == (
        2 * 96 * sk.padded_heads(heads, jnp.bfloat16 if q_dtype == jnp.bfloat16 else jnp.float32), 128)
    assert (sk.padded_heads(5, jnp.bfloat16), sk.padded_heads(5, jnp.float32)) == (6, 5)


def test_config_fields_are_checked():
    with pytest.raises(ValueError, match="block_q: expected a positive multiple of 16, got 24"):
        sk.StudentKernelConfig(block_q=24)
    with pytest.raises(ValueError, match="block_k: expected a positive multiple of 128, got 64"):
        sk.StudentKernelConfig(block_k=64)
    assert sk.default_config(seq_len=40, num_blocks=100) == sk.StudentKernelConfig(block_q=48, block_k=128)
    assert sk.default_config(seq_len=4096, num_blocks=1024) == sk.StudentKernelConfig(block_q=128, block_k=512)
    assert sk.default_config(seq_len=64, num_blocks=300) == sk.StudentKernelConfig(block_q=64, block_k=384)


def test_skip_table_covers_every_visible_pair_and_counts_the_causal_steps():
    c = _case(3, batch=2, seq=1100, num_docs=3)
    cfg = sk.StudentKernelConfig(block_q=16, block_k=256)
    s_p, n_p = 1104, 512
    table = np.asarray(student_schedule.skip_table(c["positions"], c["block_end"], s_p, n_p, cfg)).reshape(
        2, s_p // 16, 2)
    b, t, s = np.nonzero(np.asarray(c["visible"]))
    # every visible pair lies in the computed prefix of its kv tile: parts of 128 blocks
    assert np.all(table[b, t // 16, s // 256] >= (s % 256) // 128 + 1)
    untrimmed = dataclasses.replace(cfg, trim_kv_tile=False)
    whole = np.asarray(student_schedule.skip_table(c["positions"], c["block_end"], s_p, n_p, untrimmed)).reshape(
        table.shape)
    np.testing.assert_array_equal(whole, table > 0)
    # One document at S = 4096, N = 1024 with 128 x 256 tiles: kv tile j is needed by query tile i iff
    # 1024 j + 3 <= 128 i + 127 - 80 of the 128 steps; the 32 diagonal steps see 32 (i % 8 + 1) blocks of their
    # tile, so 16 of them compute one part of 128 blocks: 144 parts instead of 160. The default 128 x 512 tiles
    # compute the same 144 parts in 48 steps.
    pos = jnp.arange(4096, dtype=jnp.int32)[None]
    end = (jnp.arange(1024, dtype=jnp.int32) * 4 + 3)[None]
    for cfg, steps, parts in [(sk.StudentKernelConfig(block_q=128, block_k=256), 80, 144),
                              (sk.default_config(seq_len=4096, num_blocks=1024), 48, 144)]:
        full = student_schedule.skip_table(pos, end, 4096, 1024, cfg)
        assert int(jnp.sum(full > 0)) == steps and int(jnp.sum(full)) == parts
        skip = student_schedule.Skip(4096 // cfg.block_q, 1024 // cfg.block_k, cfg.block_q, cfg.block_k, RATIO,
                                     cfg.parts)
        assert skip.active_steps() == steps and skip.active_parts() == parts
        whole = student_schedule.skip_table(pos, end, 4096, 1024, dataclasses.replace(cfg, trim_kv_tile=False))
        assert int(jnp.sum(whole)) == steps


@pytest.mark.parametrize("seq, block_q, block_k, trim", [(200, 16, 128, True), (520, 32, 128, True),
                                                          (1024, 128, 256, True), (1024, 128, 256, False),
                                                          (2048, 64, 512, True)])
def test_causal_schedule_from_the_grid_equals_the_table(seq, block_q, block_k, trim):
    """Default ids: causal_ratio=m takes the skipped tiles and the trimmed prefixes from the grid (what the static
    estimator can follow); same scores and gradients as the table (checked against the XLA student), and both
    compute the same parts."""
    c = _case(7, seq=seq, heads=2, dim=16)
    cfg = sk.StudentKernelConfig(block_q=block_q, block_k=block_k, trim_kv_tile=trim)
    grid = lambda q, k, w: sk.scores(q, k, w, c["positions"], c["block_end"], cfg, causal_ratio=RATIO)
    table_scores, table_grads = _compare(c, cfg)  # the table against the XLA student
    grid_scores, grid_grads = _scores_and_grads(grid, c)
    np.testing.assert_array_equal(np.asarray(grid_scores) * c["visible"], np.asarray(table_scores) * c["visible"])
    for a, b in zip(grid_grads, table_grads):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    n = seq // RATIO
    s_p, n_p = -(-seq // block_q) * block_q, -(-n // block_k) * block_k
    skip = student_schedule.Skip(s_p // block_q, n_p // block_k, block_q, block_k, RATIO, cfg.parts)
    counts = student_schedule.skip_table(c["positions"], c["block_end"], s_p, n_p, cfg)
    assert skip.active_parts() == int(np.sum(counts)) and skip.active_steps() == int(np.sum(counts > 0))


def test_race_and_out_of_bounds_checking_interpreter():
    c = _case(4, batch=1, seq=48, blocks=140, heads=2, dim=16, num_docs=1)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", num_cores_or_threads=2)
    with runtime.interpret_override(params):
        _compare(c, sk.StudentKernelConfig(block_q=16, block_k=128))
