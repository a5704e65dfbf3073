"""The fused student's test problems and their check against the float64 oracle (SPEC §8), shared by
`test_student.py` and `test_student_chunks.py`.

`make_student_case` draws the indexer's and the teacher's inputs (packing, loss_mask, top-k with out-of-range and
empty slots); `check` runs `fused_indexer_distill_loss` under `jax.value_and_grad` and asserts the loss within 1e-6
and each of the three indexer gradients within 1e-6 of its max (16-bit inputs: their gradient rounded once, or
twice where `roundings` says), each plus what f32 rounding of the scores and of Q - P can move it by.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import csa_pallas
import oracle
from kernel_cases import packed_ids

TOL = 1e-6
ROUNDING_ULPS = {"xla": 4, "pallas": 32}  # see `check`

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


def oracle_kw(kw, target, reduction="mean", scale=1.0):
    return dict({k: np.asarray(v) for k, v in kw.items() if not isinstance(v, (int, float))},
                compress_ratio=kw["compress_ratio"], window_size=kw["window_size"], target=target,
                reduction=reduction, scale=scale)


def loss_and_grads(c, kw, **options):
    def loss(iq, ik, iw):
        return csa_pallas.fused_indexer_distill_loss(iq, ik, iw, c["q"], c["compressed_kv"], **kw, **options)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=FAST)(
        c["index_q"], c["index_k"], c["index_weights"])


def roundings(kw, implementation, reduction) -> int:
    """How many times the fused op rounds a 16-bit input's gradient: once, or on the Pallas path twice when the
    loss weighs its rows by a data-dependent number ("mean" over the non-empty rows of a sparse, packed or
    loss-masked problem): the kernels' pass writes d sum_t KL_t in the input's dtype and the custom_vjp's backward
    scales it by that weight (`fused_student._kl_sum_bwd`; README, "16-bit gradients")."""
    data_dependent = reduction == "mean" and any(
        kw.get(name) is not None for name in ("topk_indices", "segment_ids", "loss_mask"))
    return 2 if implementation != "xla" and data_dependent else 1


def check(c, kw, target, *, implementation="xla", reduction="mean", scale=1.3, index_head_chunk=None, **options):
    """`fused_indexer_distill_loss` on the case `c`, `kw` (`make_student_case`) against the float64 oracle: the loss
    within TOL, each gradient in index_q's dtype within TOL of its max (16-bit: `roundings`) plus the entry's f32
    rounding allowance."""
    value, grads = loss_and_grads(c, kw, target=target, reduction=reduction, scale=scale,
                                   implementation=implementation, index_head_chunk=index_head_chunk, **options)
    okw = oracle_kw(kw, target, reduction, scale)
    args = [np.asarray(c[k], np.float64) for k in ("index_q", "index_k", "index_weights", "q", "compressed_kv")]
    expected = oracle.fused_loss(*args, **okw)
    # plus one unit roundoff of the scores' rounding scale: f32 scores are off by ulps of their terms' magnitudes,
    # which no f32 computation of the loss avoids (measured on drawn problems: within 0.05 units)
    loss_scale, scales = oracle.fused_rounding_scales(*args, **okw)
    loss_bound = TOL * max(1.0, abs(expected)) + 2.0 ** -24 * loss_scale
    assert abs(float(value) - expected) <= loss_bound, (float(value), expected, loss_bound)
    # An f32 Q - P is off by a few ulps of Q + P however well they cancel (e.g. Q = P on every row), and the chain
    # rule scales that by the inputs: each entry may also move by a few unit roundoffs of its own rounding scale
    # (`oracle.fused_rounding_scales`, which also carries the f32 scores' own rounding through Q since
    # 2026-12-07, when a longer random run found d_I = 128 problems beyond the Q + P term alone). Measured over 270
    # random problems like test_drawn_shapes' (Q + P term alone): the reference within 1 unit, the kernels within
    # 15 (their G enters the MXU as bf16 hi + lo, 2^-17 per term).
    ulps = ROUNDING_ULPS["xla" if implementation == "xla" else "pallas"]
    for name, got, want, scale_of in zip(("index_q", "index_k", "index_weights"), grads,
                                         oracle.fused_loss_grads(*args, **okw), scales):
        assert got.dtype == c[name].dtype, name
        err = np.abs(np.asarray(got, np.float64) - want)
        # a 16-bit input gets its gradient in its dtype: the f32 gradient rounded once (at most half an ulp: 2^-8
        # of the entry in bf16), twice on the Pallas path when the rows' weight is data-dependent (`roundings`)
        tol = TOL if got.dtype == jnp.float32 else roundings(kw, implementation, reduction) * 2.0 ** -8
        bound = tol * max(np.max(np.abs(want), initial=0.0), 1e-30) + ulps * 2.0 ** -24 * scale_of
        assert np.all(err <= bound), (name, np.max(err - bound))
