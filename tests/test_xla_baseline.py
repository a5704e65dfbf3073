"""The MaxText-style XLA baseline (benchmarks/xla_baseline.py) computes the per-head loss of SPEC §3-§5.

It is checked against the library's pure-JAX reference (`implementation="xla"`, target="per_head"): loss, gradient wrt
the indexer logits and target P, for every head chunk (1, a middle divisor, all heads), one document and packed
documents (segment ids with restarting positions, a block straddling two documents), f32 and bf16 teacher inputs, and
NaN / -inf student logits outside V(t).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, for `benchmarks`

from benchmarks import xla_baseline  # noqa: E402

B, S, H, D, M = 2, 64, 4, 32, 4
N = S // M


def _case(dtype, packed: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, S, H, D)) * 2.0, dtype)
    kv = jnp.asarray(rng.normal(size=(B, N, D)), dtype)
    logits = rng.normal(size=(B, S, N)).astype(np.float32) * 3.0
    if packed:
        # batch 0: documents of 22, 30, 12 tokens (block 5 = tokens 20..23 straddles two documents);
        # batch 1: one document after 7 padding-like tokens of segment 9.
        seg = np.zeros((B, S), np.int32)
        pos = np.zeros((B, S), np.int32)
        lens0 = [22, 30, 12]
        start = 0
        for i, ln in enumerate(lens0):
            seg[0, start:start + ln] = i + 1
            pos[0, start:start + ln] = np.arange(ln)
            start += ln
        seg[1, :7] = 9
        pos[1, :7] = np.arange(7)
        seg[1, 7:] = 2
        pos[1, 7:] = np.arange(S - 7)
        segment_ids, positions = jnp.asarray(seg), jnp.asarray(pos)
    else:
        segment_ids = positions = None
    # Student values outside V(t) must never matter: poison every invisible entry.
    seg_ = segment_ids if segment_ids is not None else jnp.zeros((B, S), jnp.int32)
    pos_ = positions if positions is not None else jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    visible = np.asarray(xla_baseline.block_mask(seg_, pos_, M, N))
    logits = np.where(visible, logits, np.where(rng.random(logits.shape) < 0.5, np.nan, -np.inf)).astype(np.float32)
    return jnp.asarray(logits), q, kv, segment_ids, positions, visible


@pytest.mark.parametrize("head_chunk", [1, 2, H])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_baseline_matches_reference(head_chunk, packed, dtype):
    logits, q, kv, seg, pos, visible = _case(dtype, packed)
    assert visible.any(axis=-1).sum() < B * S  # some empty rows (t <= m-2, first tokens of each document)
    err = xla_baseline.check_against_reference(logits, q, kv, segment_ids=seg, positions=pos, compress_ratio=M,
                                               head_chunk=head_chunk)
    assert np.isfinite(err["loss_baseline"]) and err["loss_baseline"] > 0.0
    assert err["grad_finite"]
    assert err["loss_abs_err"] <= 1e-6 * max(1.0, abs(err["loss_ref"])), err
    assert err["grad_rel_err"] <= 1e-6, err
    assert err["target_abs_err"] <= 1e-6, err


def test_gradient_zero_outside_support_and_for_teacher_inputs():
    logits, q, kv, seg, pos, visible = _case(jnp.float32, packed=True, seed=3)
    grads = jax.grad(lambda x, a, b: xla_baseline.dense_loss(x, a, b, segment_ids=seg, positions=pos,
                                                             compress_ratio=M, head_chunk=2),
                     argnums=(0, 1, 2))(logits, q, kv)
    g_logits, g_q, g_kv = (np.asarray(g) for g in grads)
    assert np.all(g_logits[~visible] == 0.0)
    assert np.all(np.isfinite(g_logits))
    assert np.all(g_q == 0.0) and np.all(g_kv == 0.0)
    # SPEC §5: the gradient of a non-empty row sums to 0 (sum Q - sum P = 0).
    assert np.max(np.abs(g_logits.sum(-1))) < 1e-7


def test_head_chunk_must_divide_heads():
    logits, q, kv, *_ = _case(jnp.float32, packed=False)
    with pytest.raises(ValueError, match="head_chunk"):
        xla_baseline.teacher_per_head(q, kv, head_chunk=3)
