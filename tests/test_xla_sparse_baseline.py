"""The sparse gather baseline (benchmarks/xla_baseline.py) computes the same loss as the reference."""

import jax
import jax.numpy as jnp
import numpy as np

import csa_pallas
from benchmarks import xla_baseline


def test_sparse_gather_baseline_matches_the_reference():
    rng = np.random.default_rng(0)
    b, s, h, d, m, k = 1, 64, 4, 16, 4, 12
    n = s // m
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((b, n, d)), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, n + 2, (b, s, k)), jnp.int32)
    logits = jnp.asarray(rng.standard_normal((b, s, k)), jnp.float32)
    ref = jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
        x, q, kv, topk_indices=idx, target="per_head", implementation="xla"))(logits)
    got = jax.value_and_grad(lambda x: xla_baseline.sparse_loss(x, q, kv, idx, query_chunk=16))(logits)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], atol=1e-6 * float(jnp.max(jnp.abs(ref[1]))))
