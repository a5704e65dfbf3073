"""Input builders and a runner shared by the kernel tests: Pallas (interpret on CPU) vs the pure-JAX reference;
the compiled kernel calls of a traced program (`compiled_pallas_calls`)."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from csa_pallas import ops, reference, validation
from csa_pallas.kernels import runtime


def compiled_pallas_calls(jaxpr):
    """The Mosaic pallas_call equations of `jaxpr` (a jax.extend.core.Jaxpr), in program order, nested jaxprs
    included. A kernel call (`runtime.pallas_call`'s primitive) counts once, by its TPU form: its other form is
    the same kernel interpreted (or, pinned compiled, the same call again)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            if eqn.params["interpret"] is False:
                yield eqn
            continue  # its body is the kernel: no pallas_call nests inside
        if eqn.primitive.name == "csa_pallas_kernel":
            yield from compiled_pallas_calls(eqn.params["tpu"].jaxpr)
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from compiled_pallas_calls(sub)


def packed_ids(rng: np.random.Generator, batch: int, seq: int, num_docs: int):
    """Sorted segment ids with positions restarting at 0 in each document, int32 [B, S] each."""
    seg = np.zeros((batch, seq), np.int32)
    pos = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=min(num_docs - 1, seq - 1), replace=False)) if seq > 1 \
            else np.array([], int)
        bounds = [0, *cuts.tolist(), seq]
        for d in range(len(bounds) - 1):
            seg[b, bounds[d]:bounds[d + 1]] = d + 3 * b
            pos[b, bounds[d]:bounds[d + 1]] = np.arange(bounds[d + 1] - bounds[d])
    return seg, pos


def make_case(seed: int, *, batch=1, seq=64, heads=2, head_dim=32, ratio=4, dtype=jnp.float32, num_docs=1,
              sinks=True, sink_scale=1.0, q_scale=1.0, window_scale=1.0):
    """Random DeepSeek-V4-shaped inputs (numpy/jnp), one dict of arrays."""
    rng = np.random.default_rng(seed)
    n = seq // ratio
    arrays = dict(
        q=jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)) * q_scale, dtype),
        compressed_kv=jnp.asarray(rng.standard_normal((batch, n, head_dim)), dtype),
        window_kv=jnp.asarray(rng.standard_normal((batch, seq, head_dim)) * window_scale, dtype),
        logits=jnp.asarray(rng.standard_normal((batch, seq, n)) * 2.0, jnp.float32),
    )
    if sinks:
        arrays["sinks"] = jnp.asarray(rng.standard_normal(heads) * sink_scale, jnp.float32)
    if num_docs > 1:
        seg, pos = packed_ids(rng, batch, seq, num_docs)
        arrays["segment_ids"] = jnp.asarray(seg)
        arrays["positions"] = jnp.asarray(pos)
    return arrays


TEACHER_KEYS = ("window_kv", "sinks", "noncompressed_lse", "full_lse", "segment_ids", "positions")


def _problem(arrays, *, target, ratio, window, head_chunk, implementation):
    teacher_args = {k: arrays[k] for k in TEACHER_KEYS if k in arrays}
    if target == "per_head":
        teacher_args.pop("window_kv", None)
        teacher_args.pop("sinks", None)
    return validation.validate(arrays["q"], arrays["compressed_kv"], compress_ratio=ratio, window_size=window,
                               target=target, head_chunk=head_chunk, implementation=implementation, **teacher_args)


@functools.lru_cache(maxsize=None)
def _runner(target, ratio, window, head_chunk, reduction, scale, cfg, interpret):
    del interpret  # part of the cache key: the kernels read it at trace time
    def run(arrays):
        problem = _problem(arrays, target=target, ratio=ratio, window=window, head_chunk=head_chunk,
                           implementation="pallas")
        logits = arrays["logits"]
        # reduction="none" returns rows: differentiate a fixed random weighting of them (a [B, S] cotangent).
        weights = jax.random.uniform(jax.random.PRNGKey(0), logits.shape[:2]) if reduction == "none" else 1.0
        pallas_loss = lambda x: jnp.sum(weights * ops.indexer_distill_loss(x, problem, reduction=reduction,
                                                                           scale=scale, cfg=cfg))
        reference_loss = lambda x: jnp.sum(weights * reference.indexer_distill_loss(x, problem, reduction=reduction,
                                                                                    scale=scale))
        out = {}
        out["P_pallas"] = ops.teacher_distribution(problem, cfg)
        out["P_reference"] = reference.teacher(problem)[0]
        out["loss_pallas"], out["grad_pallas"] = jax.value_and_grad(pallas_loss)(logits)
        out["loss_reference"], out["grad_reference"] = jax.value_and_grad(reference_loss)(logits)
        return out
    # -O0 for XLA:CPU: interpret-mode kernels are compile-bound here, and the float maths is unchanged.
    return jax.jit(run, compiler_options={"xla_backend_optimization_level": 0})


def run_case(arrays, *, target="joint", ratio=4, window=16, head_chunk: Optional[int] = None, reduction="mean",
             scale=1.0, cfg=None):
    """Teacher, loss and logits-gradient from the kernels and from the reference, as numpy arrays."""
    out = _runner(target, ratio, window, head_chunk, reduction, scale, cfg, runtime.interpret_mode())(arrays)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def assert_matches(out, *, target_atol=1e-6, rtol=1e-5):
    """SPEC tolerances for f32 inputs: P within 1e-6 abs; loss and dI within 1e-5 relative (to max |dI|)."""
    np.testing.assert_allclose(out["P_pallas"], out["P_reference"], atol=target_atol, rtol=0)
    np.testing.assert_allclose(out["loss_pallas"], out["loss_reference"], rtol=rtol, atol=1e-7)
    g_ref = out["grad_reference"]
    scale = max(np.max(np.abs(g_ref)), 1e-30)
    np.testing.assert_allclose(out["grad_pallas"] / scale, g_ref / scale, atol=rtol, rtol=0)
    for k, v in out.items():
        assert np.all(np.isfinite(v)), f"{k} has non-finite values"
