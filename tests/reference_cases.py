"""Problems and runners shared by the reference's tests (`test_reference.py`, `test_reference_grad.py`).

`make_case` builds a small random problem (SPEC §1 shapes: packing, sinks, window, top-k with its edge slots),
`cases` draws them for hypothesis, `named_case` is the named edge cases' shared configuration; `run_forward` /
`value_and_grad` run the reference through the public API (`implementation="xla"`), jitted once per configuration
at XLA:CPU optimisation level 0 (it only changes LLVM code generation, not the float semantics, and cuts these
small programs' compile time ~2.5x; eager dispatch is ~5 s per call), and `check_against_oracle` compares P, the
KL rows and the four reductions with the float64 oracle at SPEC §6's tolerances.
"""


from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import csa_pallas
import oracle

FAST = {"xla_backend_optimization_level": 0}
TOL = 1e-6
SCALE = 0.5  # the loss coefficient of every loss below (SPEC §4); a power of 2, so rows = loss("none") / SCALE exactly
REDUCTIONS = ("mean", "mean_all", "sum", "none")
TARGETS = ("joint", "per_head")
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}
FLOAT_ARRAYS = ("window_kv", "sinks", "noncompressed_lse", "full_lse")


# ----------------------------------------------------------------------------------------------------------------------
# Problem construction
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: the student logits, the teacher inputs and the optional arrays/static arguments of the API."""

    logits: np.ndarray  # [B, S, N] or [B, S, K], input dtype (may hold NaN / inf outside V(t))
    q: np.ndarray  # [B, S, H, D]
    compressed_kv: np.ndarray  # [B, N, D]
    arrays: dict  # optional array arguments (topk_indices, window_kv, sinks, segment_ids, ...), only the given ones
    static: dict  # compress_ratio, window_size, target, softmax_scale

    @property
    def sparse(self) -> bool:
        return "topk_indices" in self.arrays

    @property
    def tau(self) -> float:
        s = self.static.get("softmax_scale")
        return self.q.shape[-1] ** -0.5 if s is None else s

    @property
    def static_key(self) -> tuple:
        return tuple(sorted(self.static.items()))

    def api_kw(self) -> dict:
        return dict(self.arrays, **self.static)

    def oracle_kw(self) -> dict:
        kw = {k: (np.asarray(v, np.float64) if k in FLOAT_ARRAYS else np.asarray(v)) for k, v in self.arrays.items()}
        return dict(kw, **self.static)

    def replace(self, logits=None, q=None, compressed_kv=None, static=None, **arrays) -> "Case":
        """A copy with some inputs changed; an array argument set to None is removed."""
        new_arrays = dict(self.arrays)
        for k, v in arrays.items():
            if v is None:
                new_arrays.pop(k, None)
            else:
                new_arrays[k] = v
        return Case(logits=self.logits if logits is None else logits, q=self.q if q is None else q,
                    compressed_kv=self.compressed_kv if compressed_kv is None else compressed_kv, arrays=new_arrays,
                    static=dict(self.static, **(static or {})))


def f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def packed_layout(rng, B: int, S: int, min_docs: int = 1, max_docs: int = 4):
    """Sorted segment ids (random documents, ids not starting at 0) and positions restarting per document."""
    seg = np.zeros((B, S), np.int32)
    pos = np.zeros((B, S), np.int32)
    for b in range(B):
        ndocs = int(rng.integers(min(min_docs, S), min(max_docs, S) + 1))
        cuts = np.sort(rng.choice(np.arange(1, S), size=ndocs - 1, replace=False)) if ndocs > 1 else []
        starts = [0] + [int(c) for c in cuts] + [S]
        base = int(rng.integers(0, 3))
        for i in range(ndocs):
            seg[b, starts[i]:starts[i + 1]] = base + i
            pos[b, starts[i]:starts[i + 1]] = np.arange(starts[i + 1] - starts[i])
    return seg, pos


def random_topk(rng, visible: np.ndarray, K: int) -> np.ndarray:
    """[B, S, K] int32 mixing visible blocks, -1, out-of-range (>= N, huge, < -1) and arbitrary (future /
    other-document / straddling) blocks; ~10% of the rows are all -1."""
    B, S, N = visible.shape
    out = np.empty((B, S, K), np.int64)
    for b in range(B):
        for t in range(S):
            vis = np.nonzero(visible[b, t])[0]
            if rng.random() < 0.1:
                out[b, t] = -1
                continue
            for k in range(K):
                r = rng.random()
                if r < 0.5 and vis.size:
                    out[b, t, k] = rng.choice(vis)
                elif r < 0.6:
                    out[b, t, k] = -1
                elif r < 0.7:
                    out[b, t, k] = N + int(rng.integers(0, 3))
                elif r < 0.75:
                    out[b, t, k] = rng.choice([2**31 - 1, -7])
                else:
                    out[b, t, k] = int(rng.integers(0, max(N, 1)))
    return out.astype(np.int32)


SINKS = {"huge": 30.0, "tiny": -30.0}


def make_case(seed: int, *, B=1, S=16, H=2, D=8, m=4, W=6, K=None, target="joint", dtype="float32", packed=False,
              sinks="normal", window=True, softmax_scale=None, garbage=True, logit_scale=2.0, logits_dtype=None,
              min_docs=1, explicit_ids=False) -> Case:
    """A random problem. sinks: None, "normal", "huge" (+30), "tiny" (-30) or an array; garbage: fill the logits
    outside V(t) with NaN / +-inf / +-1e30. explicit_ids: pass one-document segment_ids / positions arrays instead
    of the defaults when not packed (same values; lets packed and unpacked cases share one compiled program)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    N = S // m
    q = rng.normal(size=(B, S, H, D)).astype(dt)
    ckv = rng.normal(size=(B, N, D)).astype(dt)
    arrays = {}
    if packed:
        seg, pos = packed_layout(rng, B, S, min_docs)
        arrays.update(segment_ids=seg, positions=pos)
    elif explicit_ids:
        arrays.update(segment_ids=np.zeros((B, S), np.int32), positions=np.tile(np.arange(S, dtype=np.int32), (B, 1)))
    if window:
        arrays["window_kv"] = rng.normal(size=(B, S, D)).astype(dt)
        if sinks is not None:
            if isinstance(sinks, str):
                sk = rng.normal(size=(H,)) if sinks == "normal" else np.full((H,), SINKS[sinks])
            else:
                sk = np.asarray(sinks)
            arrays["sinks"] = sk.astype(np.float32)
    if K is not None:
        vis = oracle.visible_blocks(arrays.get("segment_ids"), arrays.get("positions", np.tile(np.arange(S), (B, 1))),
                                    compress_ratio=m, num_blocks=N)
        arrays["topk_indices"] = random_topk(rng, vis, K)
    static = dict(compress_ratio=m, window_size=W, target=target, softmax_scale=softmax_scale)
    case = Case(logits=None, q=q, compressed_kv=ckv, arrays=arrays, static=static)
    return fresh_logits(case, seed + 1, garbage=garbage, logit_scale=logit_scale, dtype=logits_dtype or dtype)


def fresh_logits(case: Case, seed: int, *, garbage=True, logit_scale=2.0, dtype=None) -> Case:
    """New random student logits for the case's current V(t); with garbage, ~half of the entries outside V(t) are
    NaN / +-inf / +-1e30. Call it again after changing anything that changes V(t)."""
    rng = np.random.default_rng(seed)
    V = support(case)
    logits = logit_scale * rng.normal(size=V.shape)
    if garbage:
        junk = rng.choice(np.array([np.nan, -np.inf, np.inf, 1e30, -1e30]), size=V.shape)
        logits = np.where(~V & (rng.random(V.shape) < 0.5), junk, logits)
    dt = case.q.dtype if dtype is None else DTYPES[dtype]
    return case.replace(logits=logits.astype(dt))


def support(case: Case) -> np.ndarray:
    """V(t) from the oracle: bool [B, S, N] (dense) or [B, S, K] (per slot)."""
    return oracle.support(f64(case.q), f64(case.compressed_kv), **case.oracle_kw())


def oracle_compressed_lse(case: Case) -> np.ndarray:
    """C[b, t, h] in float64 (per slot in sparse mode: a duplicated block counts twice); -inf on empty rows."""
    V = support(case)
    q, c = f64(case.q), f64(case.compressed_kv)
    B, S, H, D = q.shape
    if case.sparse:
        idx = np.clip(case.arrays["topk_indices"], 0, max(c.shape[1] - 1, 0))
        cs = c[np.arange(B)[:, None, None], idx]  # [B, S, K, D]
    else:
        cs = np.broadcast_to(c[:, None], (B, S) + c.shape[1:])
    z = case.tau * np.einsum("bshd,bskd->bshk", q, cs)
    z = np.where(V[:, :, None, :], z, -np.inf)
    mx = np.max(z, axis=-1, keepdims=True) if z.shape[-1] else np.full(z.shape[:-1] + (1,), -np.inf)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(z - mx), axis=-1)) + mx[..., 0]


def oracle_u(case: Case) -> np.ndarray:
    """u[b, t, h] (SPEC §3) in float64 from the oracle."""
    kw = case.oracle_kw()
    return oracle.noncompressed_lse(f64(case.q), kw.get("window_kv"), sinks=kw.get("sinks"),
                                    segment_ids=kw.get("segment_ids"), positions=kw.get("positions"),
                                    kv_segment_ids=kw.get("kv_segment_ids"), kv_positions=kw.get("kv_positions"),
                                    window_size=case.static["window_size"], softmax_scale=case.tau)


# ----------------------------------------------------------------------------------------------------------------------
# Running the reference (jitted: one compile per configuration)
# ----------------------------------------------------------------------------------------------------------------------


def reference_kwargs(arrays, static_key):
    """The public API's keyword arguments: the case's arrays, its static options, the reference."""
    return dict(arrays, **dict(static_key), implementation="xla")


@functools.partial(jax.jit, static_argnames=("static_key",), compiler_options=FAST)
def _forward(logits, q, ckv, arrays, static_key):
    kw = reference_kwargs(arrays, static_key)
    out = {"P": csa_pallas.teacher_distribution(q, ckv, **kw)}
    for red in REDUCTIONS:
        out[red] = csa_pallas.indexer_distill_loss(logits, q, ckv, reduction=red, scale=SCALE, **kw)
    out["rows"] = out["none"] / SCALE  # exact: SCALE is a power of 2
    return out


@functools.partial(jax.jit, static_argnames=("static_key", "reduction"), compiler_options=FAST)
def _value_and_grad(logits, q, ckv, arrays, static_key, reduction, scale):
    kw = reference_kwargs(arrays, static_key)
    return jax.value_and_grad(
        lambda x: csa_pallas.indexer_distill_loss(x, q, ckv, reduction=reduction, scale=scale, **kw))(logits)


def run_forward(case: Case) -> dict:
    out = _forward(case.logits, case.q, case.compressed_kv, case.arrays, case.static_key)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def value_and_grad(case: Case, reduction="mean", scale=1.0, logits=None):
    """(loss, d loss / d indexer_logits) of the reference, as float64 NumPy."""
    logits = case.logits if logits is None else logits
    val, grad = _value_and_grad(logits, case.q, case.compressed_kv, case.arrays, case.static_key, reduction,
                                jnp.float32(scale))
    return np.asarray(val, np.float64), np.asarray(grad, np.float64)


def assert_all_finite(out: dict):
    for k, v in out.items():
        assert np.all(np.isfinite(v)), f"{k} has non-finite values: {v}"


def check_against_oracle(case: Case) -> dict:
    """The SPEC §6 comparison of P, the KL rows and all four reductions; returns the reference outputs.

    P: 1e-6 absolute. Per-row KL: 1e-6 absolute plus 5e-7 relative: a KL row is sum P log P - sum P log Q, two sums
    of terms up to |log Q| ~ 10 whose f32 rounding is a few ulps of the row's own size (rows of ~4 nats would
    otherwise need the result to within 2 ulps). The rebased teacher keeps this at any u - C.
    """
    kl_rtol = 5e-7
    out = run_forward(case)
    assert_all_finite(out)
    lg, q, ckv, kw = f64(case.logits), f64(case.q), f64(case.compressed_kv), case.oracle_kw()
    V = support(case)
    P = oracle.teacher(q, ckv, **kw)
    np.testing.assert_allclose(out["P"], P, rtol=0, atol=TOL, err_msg="target P")
    assert np.all(out["P"][~V] == 0), "P must be exactly 0 outside V(t)"
    rows = oracle.kl_rows(lg, q, ckv, **kw)
    np.testing.assert_allclose(out["rows"], rows, rtol=kl_rtol, atol=TOL, err_msg="per-row KL")
    assert np.all(out["rows"][~V.any(-1)] == 0), "empty rows must give exactly 0"
    for red in REDUCTIONS:
        expected = oracle.loss(lg, q, ckv, reduction=red, scale=SCALE, **kw)
        np.testing.assert_allclose(out[red], expected, rtol=TOL, atol=TOL, err_msg=f"reduction={red}")
    return out




@st.composite
def cases(draw, sparse: bool, f32_logits: bool = False):
    """Random small problems (SPEC §1 shapes); sparse mode keeps N >= 1 (see test_sparse_without_blocks)."""
    m = draw(st.sampled_from([1, 2, 4]))
    S = draw(st.integers(m if sparse else 1, 40))
    kw = dict(B=draw(st.integers(1, 2)), S=S, H=draw(st.integers(1, 4)), D=draw(st.integers(4, 16)), m=m,
              W=draw(st.integers(1, 12)), K=draw(st.integers(1, 12)) if sparse else None,
              target=draw(st.sampled_from(TARGETS)), packed=draw(st.booleans()),
              sinks=draw(st.sampled_from([None, "normal", "huge", "tiny"])),
              softmax_scale=draw(st.sampled_from([None, 0.3])))
    kw["dtype"] = draw(st.sampled_from(["float32", "bfloat16"]))
    return make_case(draw(st.integers(0, 2**31 - 1)), logits_dtype="float32" if f32_logits else None, **kw)




def named_case(seed, sparse, **kw) -> Case:
    """The shared configuration of the named tests (B=1, S=16, H=2, D=8, m=4, W=6, K=5, explicit ids, window + sinks,
    f32), so that most of them reuse one compiled program per mode."""
    kw.setdefault("K", 5 if sparse else None)
    kw.setdefault("explicit_ids", True)
    return make_case(seed, **kw)


SPARSE = pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])


