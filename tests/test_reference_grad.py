"""Gradients of the reference (`implementation="xla"` through the public API) against the float64 oracle (SPEC §5).

Only `indexer_logits` gets a gradient. csa_pallas differentiates the loss it computes, whose derivative on V(t) is
scale * g * (Q * sum(P) - P) / n; SPEC §5 and `oracle.loss_grad` write Q - P. The two agree whenever the teacher row
has mass 1, i.e. everywhere except on rows whose joint teacher mass falls below f32 `tiny` (u - C > ~87 nats; the
tests avoid the 87-104 nats band where f32 denormals / flushing decide the result). Past ~104 nats the mass is exactly 0
in f32: the reference's loss row is 0 and so is its gradient (`test_underflowed_teacher_row_has_zero_loss_and_grad`).
`exact_oracle_grad` below is the float64 derivative of the loss as computed, Q * sum(P) - P; everywhere else the
tests compare with `oracle.loss_grad` directly.

Tolerance: 1e-6 relative to the maximum magnitude of the expected gradient; masked slots and empty rows must be exact
zeros, and so must the gradients wrt q, compressed_kv, window_kv, sinks, noncompressed_lse and full_lse.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import csa_pallas
import oracle
from reference_cases import (FAST, SPARSE, TOL, Case, cases, check_against_oracle, f64, make_case, named_case,
                             oracle_compressed_lse, reference_kwargs, support, value_and_grad)

GSCALE = 1.7  # a loss coefficient != 1 for every gradient below
GRAD_REDUCTIONS = ("mean", "mean_all", "sum", "none")


@functools.partial(jax.jit, static_argnames=("static_key",), compiler_options=FAST)
def _all_grads(logits, q, ckv, arrays, static_key, cotangent):
    """d loss / d indexer_logits for the four reductions ("none" through jax.vjp with `cotangent`)."""
    kw = reference_kwargs(arrays, static_key)
    loss = lambda x, red: csa_pallas.indexer_distill_loss(x, q, ckv, reduction=red, scale=GSCALE, **kw)
    out = {red: jax.grad(loss)(logits, red) for red in ("mean", "mean_all", "sum")}
    rows, vjp = jax.vjp(lambda x: loss(x, "none"), logits)
    out["none"] = vjp(cotangent)[0]
    out["rows"] = rows
    return out


@functools.partial(jax.jit, static_argnames=("static_key", "reduction"), compiler_options=FAST)
def _one_grad(logits, q, ckv, arrays, static_key, cotangent, reduction):
    """d loss / d indexer_logits for one reduction (a smaller program than `_all_grads`)."""
    kw = reference_kwargs(arrays, static_key)
    _, vjp = jax.vjp(
        lambda x: csa_pallas.indexer_distill_loss(x, q, ckv, reduction=reduction, scale=GSCALE, **kw), logits)
    return vjp(cotangent if reduction == "none" else jnp.ones((), jnp.float32))[0]


def reference_grads(case: Case, cotangent) -> dict:
    out = _all_grads(case.logits, case.q, case.compressed_kv, case.arrays, case.static_key,
                     jnp.asarray(cotangent, jnp.float32))
    return {k: np.asarray(v) for k, v in out.items()}


def oracle_grads(case: Case, cotangent) -> dict:
    lg, q, ckv, kw = f64(case.logits), f64(case.q), f64(case.compressed_kv), case.oracle_kw()
    return {red: oracle.loss_grad(lg, q, ckv, reduction=red, scale=GSCALE,
                                  cotangent=cotangent if red == "none" else 1.0, **kw) for red in GRAD_REDUCTIONS}


def exact_oracle_grad(case: Case, reduction: str, cotangent=1.0) -> np.ndarray:
    """float64 derivative of the loss as csa_pallas computes it: scale * g * (Q * sum(P) - P) / n on V(t)."""
    lg, q, ckv, kw = f64(case.logits), f64(case.q), f64(case.compressed_kv), case.oracle_kw()
    P = oracle.teacher(q, ckv, **kw)
    V = support(case)
    x = np.where(V, lg, -np.inf)
    mx = np.max(x, axis=-1, keepdims=True) if x.shape[-1] else np.zeros(x.shape[:-1] + (1,))
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(V, np.exp(x - mx), 0.0)
    Q = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    nonempty = V.any(-1)
    n = {"mean": max(1, int(nonempty.sum())), "mean_all": nonempty.size, "sum": 1, "none": 1}[reduction]
    g = np.broadcast_to(np.asarray(cotangent, np.float64), nonempty.shape)[..., None]
    return np.where(V, GSCALE * g * (Q * P.sum(-1, keepdims=True) - P) / n, 0.0)


def assert_grad_close(actual, expected, what=""):
    actual = np.asarray(actual, np.float64)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite gradient"
    bound = TOL * np.max(np.abs(expected), initial=0.0)
    err = np.max(np.abs(actual - expected), initial=0.0)
    assert err <= bound, f"{what}: max error {err} > 1e-6 * max|grad| = {bound}"


def check_grads(case: Case, seed: int = 0) -> dict:
    cot = np.random.default_rng(seed).normal(size=case.logits.shape[:2]).astype(np.float32)
    got = reference_grads(case, cot)
    want = oracle_grads(case, f64(cot))
    V = support(case)
    for red in GRAD_REDUCTIONS:
        assert got[red].dtype == case.logits.dtype and got[red].shape == case.logits.shape
        assert_grad_close(got[red], want[red], f"reduction={red}")
        assert np.all(got[red][~V] == 0), f"reduction={red}: masked slots / empty rows must get exactly 0"
    return got


# ----------------------------------------------------------------------------------------------------------------------


@SPARSE
@settings(max_examples=8)
@given(data=st.data())
def test_property_grad_matches_oracle(sparse, data):
    """Random shapes / packing / sinks / masks (`reference_cases.cases`), f32 logits, scale 1.7, one drawn reduction
    per example ("none" with a random cotangent through jax.vjp); the named tests below cover every reduction."""
    case = data.draw(cases(sparse, f32_logits=True))
    reduction = data.draw(st.sampled_from(GRAD_REDUCTIONS))
    cot = np.random.default_rng(0).normal(size=case.logits.shape[:2]).astype(np.float32)
    got = np.asarray(_one_grad(case.logits, case.q, case.compressed_kv, case.arrays, case.static_key,
                               jnp.asarray(cot), reduction))
    want = oracle_grads(case, f64(cot))[reduction]
    assert got.dtype == np.float32 and got.shape == case.logits.shape
    assert_grad_close(got, want, f"reduction={reduction}")
    assert np.all(got[~support(case)] == 0), "masked slots / empty rows must get exactly 0"


@pytest.mark.parametrize("target", ["joint", "per_head"])
@SPARSE
def test_grad_matches_oracle_named(sparse, target):
    """The shared named configuration (packed) for both targets; the oracle's Q - P equals the exact Q*sum(P) - P."""
    case = named_case(20, sparse, packed=True, target=target)
    got = check_grads(case)
    assert np.max(np.abs(got["sum"])) > 1e-2, "the gradient must be non-trivial"
    for red in ("mean", "sum"):
        np.testing.assert_allclose(exact_oracle_grad(case, red), oracle_grads(case, 1.0)[red], rtol=0, atol=1e-12)


def _tiny_case(sparse, target, seed):
    case = make_case(seed, B=1, S=7, H=2, D=4, m=2, W=3, K=4 if sparse else None, target=target, sinks="normal")
    return case


@pytest.mark.parametrize("target", ["joint", "per_head"])
@SPARSE
def test_grad_matches_finite_differences(sparse, target):
    """jax.grad (f32) vs central differences (eps 1e-6) of the float64 oracle loss, every reduction."""
    case = _tiny_case(sparse, target, 21 + sparse)
    cot = np.random.default_rng(3).normal(size=case.logits.shape[:2])
    got = reference_grads(case, cot.astype(np.float32))
    lg, q, ckv, kw = f64(case.logits), f64(case.q), f64(case.compressed_kv), case.oracle_kw()
    V = support(case)
    for red in GRAD_REDUCTIONS:
        if red == "none":
            f = lambda x: float(np.sum(cot * oracle.loss(x, q, ckv, reduction="none", scale=GSCALE, **kw)))
        else:
            f = lambda x: oracle.loss(x, q, ckv, reduction=red, scale=GSCALE, **kw)
        fd = oracle.finite_difference_grad(f, np.where(V, lg, 0.0))
        assert np.max(np.abs(fd)) > 1e-3
        assert_grad_close(got[red], fd, f"finite differences, reduction={red}")
        analytic = oracle.loss_grad(lg, q, ckv, reduction=red, scale=GSCALE,
                                    cotangent=cot if red == "none" else 1.0, **kw)
        np.testing.assert_allclose(analytic, fd, rtol=0, atol=1e-7 * np.max(np.abs(fd)))


ZERO_GRAD_CASES = [  # (teacher path, sparse, dtype)
    ("window_kv", False, "bfloat16"),
    ("window_kv", True, "float32"),
    ("noncompressed_lse", True, "float32"),
    ("full_lse", False, "float32"),
    ("per_head", False, "float32"),
]


@pytest.mark.parametrize("path,sparse,dtype", ZERO_GRAD_CASES)
def test_teacher_inputs_get_exact_zero_gradients(path, sparse, dtype):
    """q, compressed_kv, window_kv, sinks, noncompressed_lse, full_lse: exact zeros, same shape/dtype, no error."""
    case = named_case(22, sparse, dtype=dtype, sinks="normal")
    if path in ("noncompressed_lse", "full_lse"):
        lse = np.random.default_rng(0).normal(size=case.q.shape[:3]).astype(np.float32) + 2.0
        case = case.replace(window_kv=None, sinks=None, **{path: lse})
    elif path == "per_head":
        case = case.replace(window_kv=None, sinks=None, static={"target": "per_head"})
    floats = {k: v for k, v in case.arrays.items() if np.issubdtype(np.asarray(v).dtype, np.floating)
              or v.dtype == jnp.bfloat16}
    ints = {k: v for k, v in case.arrays.items() if k not in floats}

    @functools.partial(jax.jit, compiler_options=FAST)
    def grads(logits, q, ckv, floats):
        f = lambda lg, q, ckv, fl: csa_pallas.indexer_distill_loss(
            lg, q, ckv, reduction="sum", scale=GSCALE, **fl, **ints, **case.static, implementation="xla")
        return jax.grad(f, argnums=(0, 1, 2, 3))(logits, q, ckv, floats)

    g_logits, g_q, g_ckv, g_floats = grads(case.logits, case.q, case.compressed_kv, floats)
    assert np.max(np.abs(np.asarray(g_logits, np.float64))) > 1e-2  # the student does get a gradient
    named = dict(q=(g_q, case.q), compressed_kv=(g_ckv, case.compressed_kv),
                 **{k: (g_floats[k], floats[k]) for k in floats})
    expected_names = {"q", "compressed_kv"} | {
        "window_kv": {"window_kv", "sinks"}, "noncompressed_lse": {"noncompressed_lse"}, "full_lse": {"full_lse"},
        "per_head": set()}[path]
    assert set(named) == expected_names
    for name, (g, x) in named.items():
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert np.all(np.asarray(g, np.float64) == 0), f"{name}: gradient must be exactly 0"


@SPARSE
@pytest.mark.parametrize("gap", [30.0, 120.0, 200.0])
def test_window_dominated_row_is_exact(sparse, gap):
    """A row whose compressed share is `gap` nats below the window in every head (u - C = gap) keeps the exact
    conditional (SPEC §3, §9.5: no flush band): P matches the oracle and sums to 1, the KL row and the gradient
    (Q - P, SPEC §9.1) match the oracle, and the row counts in the mean like any non-empty row."""
    case = named_case(23, sparse, packed=False)
    V = support(case)
    t0 = 13
    assert V[0, t0].sum() >= 2
    C = oracle_compressed_lse(case)
    u = np.where(np.isfinite(C), C - 1.0, 0.0)
    u[0, t0] = C[0, t0] + gap
    case = case.replace(window_kv=None, sinks=None, noncompressed_lse=u.astype(np.float32))
    got = reference_grads(case, np.ones(case.logits.shape[:2], np.float32))
    fwd = check_against_oracle(case)  # P, KL rows, reductions (the mean counts the row)
    assert abs(fwd["P"][0, t0].sum() - 1.0) < 1e-6 and fwd["rows"][0, t0] > 1e-3
    for red in GRAD_REDUCTIONS:
        assert_grad_close(got[red], exact_oracle_grad(case, red), f"reduction={red}")
        assert_grad_close(got[red], oracle_grads(case, 1.0)[red], f"Q - P, reduction={red}")


def test_bf16_logits_gradient():
    """bf16 student logits: the gradient comes back in bf16, equal to the oracle's up to bf16 rounding."""
    case = named_case(24, False, dtype="bfloat16")
    assert case.logits.dtype == jnp.bfloat16
    cot = np.ones(case.logits.shape[:2], np.float32)
    got = reference_grads(case, cot)
    want = oracle_grads(case, 1.0)
    V = support(case)
    for red in GRAD_REDUCTIONS:
        assert got[red].dtype == jnp.bfloat16
        g = np.asarray(got[red], np.float64)
        assert np.all(g[~V] == 0)
        assert np.max(np.abs(g - want[red])) <= 2.0**-8 * np.max(np.abs(want[red])), red


def test_gradient_is_linear_in_scale():
    """scale multiplies the loss and the gradient (here 1.7 vs -0.5 and 0 on the same compiled program)."""
    case = named_case(25, True)
    v1, g1 = value_and_grad(case, "mean", 1.7)
    v2, g2 = value_and_grad(case, "mean", -0.5)
    v0, g0 = value_and_grad(case, "mean", 0.0)
    assert v0 == 0 and np.all(g0 == 0)
    np.testing.assert_allclose(v2, v1 * (-0.5 / 1.7), rtol=1e-6)
    assert np.max(np.abs(g1)) > 1e-2
    assert_grad_close(g2, g1 * (-0.5 / 1.7), "scale -0.5 vs 1.7")
