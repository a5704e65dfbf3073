"""The input contract of SPEC §1-§6 at its edges, for both implementations against the float64 oracle.

Rebased teacher at any u - C (0, 30, 90, 200 nats) and with +-inf sinks; non-finite inputs make exactly the rows
that read them NaN (never a finite wrong number); loss_mask; float16; top-k indices of any integer dtype (values
beyond int32 are empty slots); a static scale of 0 (exact zeros, no kernel); the errors of bad calls; the window
kernel's layout contract. Pallas runs in interpret mode. Every case of one (mode, target, implementation) shares one
compiled program: the edge values are data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import csa_pallas
import oracle

FAST = {"xla_backend_optimization_level": 0}
B, S, H, D, M, W, K = 1, 48, 4, 16, 4, 8, 6
N = S // M
IMPLS = ("xla", "pallas")
SPARSE = pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
IMPL = pytest.mark.parametrize("impl", IMPLS)


def arrays(seed: int, sparse: bool) -> dict:
    rng = np.random.default_rng(seed)
    out = dict(q=rng.normal(size=(B, S, H, D)).astype(np.float32),
               compressed_kv=rng.normal(size=(B, N, D)).astype(np.float32),
               window_kv=rng.normal(size=(B, S, D)).astype(np.float32),
               sinks=rng.normal(size=(H,)).astype(np.float32))
    if sparse:
        t = np.arange(S)[None, :, None]
        picks = (rng.random((B, S, K)) * np.maximum((t + 1) // M, 1)).astype(np.int32)
        out["topk_indices"] = np.where(rng.random((B, S, K)) < 0.2, -1, picks).astype(np.int32)
    out["logits"] = (2.0 * rng.normal(size=(B, S, K if sparse else N))).astype(np.float32)
    return out


TEACHER = ("topk_indices", "window_kv", "sinks", "noncompressed_lse", "full_lse", "loss_mask")


@functools.lru_cache(maxsize=None)
def program(impl: str, names: tuple, target: str = "joint", head_chunk=None, reduction: str = "mean"):
    """A jitted (P, KL rows, loss, d loss / d logits) of the public API for the given array names."""
    def run(a):
        kw = {k: a[k] for k in names if k in TEACHER}
        common = dict(compress_ratio=M, window_size=W, target=target, head_chunk=head_chunk, implementation=impl,
                      **kw)
        loss = lambda x: csa_pallas.indexer_distill_loss(x, a["q"], a["compressed_kv"], reduction=reduction,
                                                         **common)
        value, grad = jax.value_and_grad(loss)(a["logits"])
        rows = csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], reduction="none", **common)
        return dict(P=csa_pallas.teacher_distribution(a["q"], a["compressed_kv"], **common), rows=rows, loss=value,
                    grad=grad)
    return jax.jit(run, compiler_options=FAST)


def run(impl: str, a: dict, **static) -> dict:
    names = tuple(sorted(a))
    out = program(impl, names, **static)({k: jnp.asarray(v) for k, v in a.items()})
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def oracle_kw(a: dict, target="joint") -> dict:
    kw = {k: a[k] for k in TEACHER if k in a}
    return dict(compress_ratio=M, window_size=W, target=target, **kw)


def expect(a: dict, target="joint", reduction="mean") -> dict:
    kw = oracle_kw(a, target)
    return dict(P=oracle.teacher(a["q"], a["compressed_kv"], **kw),
                rows=oracle.kl_rows(a["logits"], a["q"], a["compressed_kv"], **kw),
                loss=oracle.loss(a["logits"], a["q"], a["compressed_kv"], reduction=reduction, **kw),
                grad=oracle.loss_grad(a["logits"], a["q"], a["compressed_kv"], reduction=reduction, **kw))


def assert_close(got: dict, want: dict, what: str = ""):
    """SPEC §6: P and KL rows within 1e-6 (KL rows also 5e-7 relative, see test_reference.check_against_oracle),
    the gradient within 1e-6 of its max magnitude; NaN exactly where the oracle has NaN."""
    for key in ("P", "rows", "grad"):
        nan = np.isnan(want[key])
        np.testing.assert_array_equal(np.isnan(got[key]), nan, err_msg=f"{what}: NaN pattern of {key}")
    np.testing.assert_allclose(got["P"], want["P"], rtol=0, atol=1e-6, err_msg=f"{what}: P")
    np.testing.assert_allclose(got["rows"], want["rows"], rtol=5e-7, atol=1e-6, err_msg=f"{what}: KL rows")
    scale = max(np.nanmax(np.abs(want["grad"]), initial=0.0), 1e-30)
    np.testing.assert_allclose(got["grad"] / scale, want["grad"] / scale, rtol=0, atol=1e-6, err_msg=f"{what}: grad")
    if np.isnan(want["loss"]):
        assert np.isnan(got["loss"]), what
    else:
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6, atol=1e-7, err_msg=f"{what}: loss")


def compressed_lse(a: dict) -> np.ndarray:
    """C[b, t, h] (float64, -inf on empty rows) of the dense problem (the gap of a sparse row is set from it too)."""
    q, c = np.asarray(a["q"], np.float64), np.asarray(a["compressed_kv"], np.float64)
    z = np.einsum("bshd,bnd->bshn", q, c) * D ** -0.5
    vis = oracle.visible_blocks(None, np.tile(np.arange(S), (B, 1)), compress_ratio=M, num_blocks=N)
    z = np.where(vis[:, :, None, :], z, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        mx = np.max(z, axis=-1, keepdims=True)
        return np.squeeze(mx, -1) + np.log(np.sum(np.exp(z - np.where(np.isfinite(mx), mx, 0)), axis=-1))


# ----------------------------------------------------------------------------------------------------------------------
# The rebased teacher (SPEC §3)
# ----------------------------------------------------------------------------------------------------------------------


@IMPL
@SPARSE
@pytest.mark.parametrize("gap", [0.0, 30.0, 90.0, 200.0])
def test_exact_at_any_window_dominance(impl, sparse, gap):
    """u - C = gap nats in every head (u given, exact in f32): P matches the oracle within 1e-6 and every non-empty
    row sums to 1; the old form flushed rows past ~87 nats to 0 and lost entries below 2^-126."""
    a = arrays(1, sparse)
    C = compressed_lse(a)
    rng = np.random.default_rng(2)
    u = np.where(np.isfinite(C), C + gap + rng.normal(size=C.shape), 0.0).astype(np.float32)
    a = {k: v for k, v in a.items() if k not in ("window_kv", "sinks")}
    a["noncompressed_lse"] = u
    want = expect(a)
    got = run(impl, a)
    assert_close(got, want, f"gap {gap}")
    nonempty = want["P"].sum(-1) > 0
    np.testing.assert_allclose(got["P"].sum(-1)[nonempty], 1.0, atol=1e-6)


@IMPL
@SPARSE
@pytest.mark.parametrize("sink", [30.0, 90.0, 200.0])
def test_exact_with_large_sinks(impl, sparse, sink):
    """Large sinks put the gap into u through the window LSE (kernel: the window kernel's sink fold)."""
    a = arrays(3, sparse)
    a["sinks"] = (sink + np.random.default_rng(4).normal(size=H)).astype(np.float32)
    assert_close(run(impl, a), expect(a), f"sink {sink}")


@IMPL
@SPARSE
@pytest.mark.parametrize("head_chunk", [1, 2])
def test_exact_across_head_chunks(impl, sparse, head_chunk):
    """Head chunks combine through the running row max (kernels): at a 200-nat gap with sinks 200 apart per head,
    any chunking gives the oracle's P."""
    a = arrays(5, sparse)
    a["sinks"] = np.array([200.0, 190.0, 201.0, 150.0], np.float32)
    assert_close(run(impl, a, head_chunk=head_chunk), expect(a), f"head_chunk {head_chunk}")


@IMPL
@SPARSE
@pytest.mark.parametrize("sinks", [[np.inf, 0.0, 1.0, -1.0], [-np.inf, -np.inf, 0.5, 2.0], [np.inf] * 4],
                         ids=["one_plus_inf", "minus_inf", "all_plus_inf"])
def test_infinite_sinks_are_limits(impl, sparse, sinks):
    """+inf takes a head's whole mass (a_h = -inf), -inf drops the sink term; every sink +inf empties every row
    (loss 0, gradient 0)."""
    a = arrays(6, sparse)
    a["sinks"] = np.asarray(sinks, np.float32)
    want = expect(a)
    got = run(impl, a)
    assert_close(got, want, str(sinks))
    if np.all(np.isinf(sinks) & (np.asarray(sinks) > 0)):
        assert got["loss"] == 0 and np.all(got["grad"] == 0) and np.all(got["P"] == 0)


@IMPL
def test_targets_coincide_for_one_head_and_differ_for_two(impl):
    """SPEC §3: for H = 1 joint and per_head coincide (the rebased weight of the only head is 1); for H >= 2 they
    differ (a test that would pass with the window ignored)."""
    a = arrays(7, False)
    one = dict(a, q=a["q"][:, :, :1], sinks=a["sinks"][:1])
    p_joint, p_head = run(impl, one)["P"], run(impl, {k: v for k, v in one.items() if k not in ("window_kv", "sinks")},
                                                   target="per_head")["P"]
    np.testing.assert_allclose(p_joint, p_head, atol=1e-6)
    two = dict(a, q=a["q"][:, :, :2], sinks=a["sinks"][:2])
    p_joint, p_head = run(impl, two)["P"], run(impl, {k: v for k, v in two.items() if k not in ("window_kv", "sinks")},
                                                   target="per_head")["P"]
    assert np.max(np.abs(p_joint - p_head)) > 1e-3


# ----------------------------------------------------------------------------------------------------------------------
# Non-finite inputs are loud (SPEC §3)
# ----------------------------------------------------------------------------------------------------------------------


def poisoned(a: dict, which: str) -> dict:
    a = {k: np.array(v) for k, v in a.items()}
    if which.startswith("q_"):
        a["q"][0, 20, 1, 3] = {"q_nan": np.nan, "q_pinf": np.inf, "q_ninf": -np.inf}[which]
    elif which.startswith("kv_"):
        a["compressed_kv"][0, 5, 2] = {"kv_nan": np.nan, "kv_pinf": np.inf, "kv_ninf": -np.inf}[which]
    elif which == "window_nan":
        a["window_kv"][0, 30, 0] = np.nan
    elif which == "sink_nan":
        a["sinks"][2] = np.nan
    elif which in ("lse_nan", "full_nan"):
        u = oracle.noncompressed_lse(a["q"], a["window_kv"], sinks=a["sinks"], window_size=W).astype(np.float32)
        u[0, 33, 1] = np.nan
        del a["window_kv"], a["sinks"]
        a["noncompressed_lse" if which == "lse_nan" else "full_lse"] = (u if which == "lse_nan" else
                                                                        np.logaddexp(u, 3.0).astype(np.float32))
    elif which == "logit_nan":  # at an entry of V(t): block 0 (dense) or the first valid slot (sparse)
        k = int(np.argmax(a["topk_indices"][0, 25] >= 0)) if "topk_indices" in a else 0
        a["logits"][0, 25, k] = np.nan
    return a


NONFINITE = ["q_nan", "q_pinf", "q_ninf", "kv_nan", "kv_pinf", "kv_ninf", "window_nan", "sink_nan", "lse_nan",
             "full_nan", "logit_nan"]


@IMPL
@SPARSE
@pytest.mark.parametrize("which", NONFINITE)
def test_nonfinite_inputs_make_their_rows_nan(impl, sparse, which):
    """Exactly the rows that read the non-finite value are NaN (P, KL row, gradient on V(t)); every other row keeps
    its finite value; the reduced loss is NaN. A -inf in q or kv (a score of -inf, which would silently drop an
    entry) is NaN too."""
    a = poisoned(arrays(8, sparse), which)
    want = expect(a)
    got = run(impl, a)
    bad = np.isnan(want["rows"])
    assert bad.any() and not bad.all() or which == "sink_nan", "the case must poison some rows but not all"
    assert_close(got, want, which)
    assert np.isnan(got["loss"])
    assert np.all(np.isfinite(got["rows"][~bad]))


@IMPL
@SPARSE
def test_nonfinite_values_outside_what_a_row_reads_do_not_leak(impl, sparse):
    """A NaN block nobody sees (the last block is visible only to the last query, masked by loss_mask), NaN / -inf
    logits outside V(t), a NaN q row that is empty (t < m - 1): all finite and equal to the oracle."""
    a = arrays(9, sparse)
    a["compressed_kv"][0, N - 1] = np.nan
    a["loss_mask"] = np.ones((B, S), bool)
    a["loss_mask"][0, S - M:] = False  # the rows that could see block N-1
    a["q"][0, 1] = np.nan  # t = 1 sees no block
    want = expect(a)
    got = run(impl, a)
    assert not np.isnan(want["rows"]).any()
    assert_close(got, want, "hidden non-finite")
    assert np.isfinite(got["loss"])


# ----------------------------------------------------------------------------------------------------------------------
# loss_mask (SPEC §1-§2)
# ----------------------------------------------------------------------------------------------------------------------


@IMPL
@SPARSE
@pytest.mark.parametrize("reduction", ["mean", "mean_all", "sum"])
def test_loss_mask(impl, sparse, reduction):
    """Masked rows are empty: KL 0, P 0, gradient exactly 0, not counted by "mean" (MaxText padding); a NaN in a
    masked row's q does not matter."""
    a = arrays(10, sparse)
    mask = np.ones((B, S), bool)
    mask[0, 36:] = False
    mask[0, 12] = False
    a["loss_mask"] = mask
    a["q"][0, 40] = np.nan
    want = expect(a, reduction=reduction)
    got = run(impl, a, reduction=reduction)
    assert_close(got, want, reduction)
    assert np.all(got["rows"][~mask] == 0) and np.all(got["grad"][~mask] == 0) and np.all(got["P"][~mask] == 0)
    if reduction == "mean":  # divided by the non-empty unmasked rows only
        unmasked = dict(a, loss_mask=np.ones((B, S), bool), q=np.where(mask[..., None, None], a["q"], 0.0))
        assert abs(got["loss"] - expect(unmasked)["loss"]) > 1e-3


# ----------------------------------------------------------------------------------------------------------------------
# Dtypes (SPEC §1, §6)
# ----------------------------------------------------------------------------------------------------------------------


@IMPL
@SPARSE
def test_float16_is_its_f32_upcast(impl, sparse):
    """float16 q / kv / window / logits compute exactly as their f32 upcast (the kernels read f32 copies)."""
    a = arrays(11, sparse)
    half = {k: (v.astype(np.float16) if k in ("q", "compressed_kv", "window_kv", "logits") else v)
            for k, v in a.items()}
    got = run(impl, half)
    want = expect({k: (v.astype(np.float32) if v.dtype == np.float16 else v) for k, v in half.items()})
    # The gradient comes back in the logits' dtype: float16, i.e. within one f16 rounding (2**-11 relative).
    assert program(impl, tuple(sorted(half)))({k: jnp.asarray(v) for k, v in half.items()})["grad"].dtype == \
        jnp.float16
    np.testing.assert_allclose(got["grad"], want["grad"], rtol=2.0 ** -11, atol=1e-7)
    assert_close(dict(got, grad=want["grad"]), want, "float16")


@IMPL
@pytest.mark.parametrize("dtype", ["int64_numpy", "uint8", "int16", "uint32"])
def test_topk_indices_of_any_integer_dtype(impl, dtype):
    """Any integer dtype; a value outside [0, N) - including 2**32 + 1, which wraps onto block 1 in int32 - is an
    empty slot."""
    a = arrays(12, True)
    topk = a["topk_indices"].astype(np.int64)
    if dtype == "int64_numpy":
        topk[0, 20, :3] = [2**32 + 1, -(2**40), 2**62]
        idx = topk
    elif dtype == "uint8":
        topk = np.where(topk < 0, 255, topk)
        topk[0, 20, :2] = [250, N]
        idx = topk.astype(np.uint8)
    elif dtype == "int16":
        topk[0, 20, :2] = [-300, 30000]
        idx = topk.astype(np.int16)
    else:
        topk = np.where(topk < 0, 2**32 - 1, topk)
        topk[0, 20, :2] = [2**31 + 1, 2**32 - 5]
        idx = jnp.asarray(topk.astype(np.uint32))  # a jax array: compared in uint32, never cast to int32 first
    want = expect(dict(a, topk_indices=topk))
    if dtype == "int64_numpy":
        # A NumPy int64 array keeps its values only where the op sees it as such: jit would convert an argument to
        # int32 at its boundary (wrapping 2**32 + 1 onto 1 before csa_pallas is called), so it is closed over.
        kw = dict(window_kv=a["window_kv"], sinks=a["sinks"], compress_ratio=M, window_size=W, topk_indices=idx,
                  implementation=impl)
        loss = lambda x: csa_pallas.indexer_distill_loss(x, a["q"], a["compressed_kv"], **kw)
        got = dict(P=np.asarray(jax.jit(lambda q: csa_pallas.teacher_distribution(q, a["compressed_kv"], **kw))(
                       a["q"]), np.float64),
                   rows=np.asarray(jax.jit(lambda x: csa_pallas.indexer_distill_loss(
                       x, a["q"], a["compressed_kv"], reduction="none", **kw))(a["logits"]), np.float64))
        got["loss"], got["grad"] = (np.asarray(v, np.float64) for v in jax.jit(jax.value_and_grad(loss))(a["logits"]))
    else:
        got = run(impl, dict(a, topk_indices=idx))
    assert_close(got, want, dtype)
    assert np.all(got["P"][0, 20, :2] == 0)


# ----------------------------------------------------------------------------------------------------------------------
# Static scale 0 (SPEC §4)
# ----------------------------------------------------------------------------------------------------------------------


@IMPL
@SPARSE
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_static_zero_scale_is_exact_and_runs_nothing(impl, sparse, reduction):
    a = {k: jnp.asarray(v) for k, v in poisoned(arrays(13, sparse), "q_nan").items()}
    kw = {k: a[k] for k in TEACHER if k in a}

    def loss(x, scale):
        return jnp.sum(csa_pallas.indexer_distill_loss(x, a["q"], a["compressed_kv"], compress_ratio=M, window_size=W,
                                                       reduction=reduction, scale=scale, implementation=impl, **kw))

    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(lambda x: loss(x, 0.0)))(a["logits"]))
    assert "pallas_call" not in jaxpr and "dot_general" not in jaxpr
    value, grad = jax.value_and_grad(lambda x: loss(x, 0))(a["logits"])
    assert float(value) == 0.0 and np.all(np.asarray(grad) == 0) and grad.shape == a["logits"].shape
    # a traced 0 is a number like any other: the computation runs (and the NaN row shows)
    traced = jax.jit(lambda x, s: loss(x, s))(a["logits"], jnp.float32(0.0))
    assert np.isnan(float(traced))
    if impl == "pallas":
        assert "pallas_call" in str(jax.make_jaxpr(lambda x, s: loss(x, s))(a["logits"], jnp.float32(0.0)))


# ----------------------------------------------------------------------------------------------------------------------
# Clear errors and empty inputs (issue 13 item 8)
# ----------------------------------------------------------------------------------------------------------------------


def test_q_in_heads_major_layout_is_named():
    a = arrays(14, False)
    q_bhsd = np.swapaxes(a["q"], 1, 2)  # [B, H, S, D]: S = 48 > H = 4
    with pytest.raises(ValueError, match=r"^q: expected shape \[B, S, H, D\].*jnp.swapaxes\(q, 1, 2\)"):
        csa_pallas.indexer_distill_loss(a["logits"], q_bhsd, a["compressed_kv"], window_kv=a["window_kv"])


@pytest.mark.parametrize("name", ["indexer_logits", "q", "compressed_kv", "window_kv", "sinks", "topk_indices",
                                  "segment_ids", "loss_mask"])
def test_python_lists_are_type_errors(name):
    a = arrays(15, name == "topk_indices")
    kw = dict(window_kv=a["window_kv"], sinks=a["sinks"])
    args = dict(indexer_logits=a["logits"], q=a["q"], compressed_kv=a["compressed_kv"])
    extra = dict(topk_indices=a.get("topk_indices"), segment_ids=np.zeros((B, S), np.int32),
                 loss_mask=np.ones((B, S), bool))
    if name in args:
        args[name] = args[name].tolist()
    elif name in kw:
        kw[name] = kw[name].tolist()
    else:
        kw[name] = extra[name].tolist()
    with pytest.raises(TypeError, match=rf"^{name}: expected an array"):
        csa_pallas.indexer_distill_loss(args["indexer_logits"], args["q"], args["compressed_kv"], **kw)


def test_loss_mask_must_be_bool():
    a = arrays(16, False)
    with pytest.raises(TypeError, match=r"^loss_mask: expected a bool array"):
        csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], window_kv=a["window_kv"],
                                        loss_mask=np.ones((B, S), np.int32))


def test_second_order_derivatives_say_what_to_use():
    a = {k: jnp.asarray(v) for k, v in arrays(17, False).items()}

    def loss(x, impl):
        return csa_pallas.indexer_distill_loss(x, a["q"], a["compressed_kv"], window_kv=a["window_kv"],
                                               sinks=a["sinks"], compress_ratio=M, window_size=W, implementation=impl)

    hvp = lambda impl: jax.grad(lambda x: jnp.sum(jax.grad(loss)(x, impl) ** 2))(a["logits"])
    with pytest.raises(NotImplementedError, match=r"second-order derivatives.*implementation='xla'"):
        hvp("pallas")
    assert np.all(np.isfinite(np.asarray(hvp("xla"))))


@IMPL
@SPARSE
def test_empty_batch_returns_the_empty_result(impl, sparse):
    a = {k: (v[:0] if k != "sinks" else v) for k, v in arrays(18, sparse).items()}
    kw = {k: a[k] for k in TEACHER if k in a}
    f = lambda x, red: csa_pallas.indexer_distill_loss(x, a["q"], a["compressed_kv"], compress_ratio=M,
                                                       window_size=W, reduction=red, implementation=impl, **kw)
    assert float(f(a["logits"], "mean")) == 0.0
    assert f(a["logits"], "none").shape == (0, S)
    assert np.asarray(jax.grad(lambda x: f(x, "sum"))(a["logits"])).shape == a["logits"].shape
    p = csa_pallas.teacher_distribution(a["q"], a["compressed_kv"], compress_ratio=M, window_size=W,
                                        implementation=impl, **kw)
    assert p.shape == (0, S, K if sparse else N)


# ----------------------------------------------------------------------------------------------------------------------
# The window kernel's layout contract (issue 13 item 9)
# ----------------------------------------------------------------------------------------------------------------------


def interleaved_ids():
    """Document 0 in two runs with document 1 between them: positions keep counting, so a window key of row 40
    (position 24) lies 20 index steps back - outside the kernel's band [t - W + 1, t] while 0 <= 24 - 17 < W."""
    seg = np.array([[0] * 24 + [1] * 16 + [0] * 8], np.int32)
    pos = np.array([list(range(24)) + list(range(16)) + list(range(24, 32))], np.int32)
    return seg, pos


def test_window_layout_contract_is_checked_when_ids_are_concrete():
    a = arrays(19, False)
    seg, pos = interleaved_ids()
    kw = dict(window_kv=a["window_kv"], sinks=a["sinks"], segment_ids=seg, positions=pos, compress_ratio=M,
              window_size=W)
    want = oracle.loss(a["logits"], a["q"], a["compressed_kv"], **kw)
    auto = float(csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], **kw))
    np.testing.assert_allclose(auto, want, rtol=1e-6)  # implementation=None chose the reference
    with pytest.raises(NotImplementedError, match="contiguous run"):
        csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], implementation="pallas", **kw)
    good_seg = np.array([[0] * 24 + [1] * 24], np.int32)
    good_pos = np.array([list(range(24)) * 2], np.int32)
    fine = csa_pallas.indexer_distill_loss(a["logits"], a["q"], a["compressed_kv"], implementation="pallas",
                                           **dict(kw, segment_ids=good_seg, positions=good_pos))
    np.testing.assert_allclose(float(fine), oracle.loss(a["logits"], a["q"], a["compressed_kv"],
                                                        **dict(kw, segment_ids=good_seg, positions=good_pos)),
                               rtol=1e-6)


def test_window_layout_check_under_checkify():
    """Traced ids cannot be checked at trace time; `check_window_layout` is the opt-in checkify check."""
    checked = checkify.checkify(jax.jit(lambda s, p: csa_pallas.check_window_layout(s, p)))
    err, _ = checked(*map(jnp.asarray, interleaved_ids()))
    with pytest.raises(checkify.JaxRuntimeError, match="contiguous run"):
        err.throw()
    err, _ = checked(jnp.zeros((1, 8), jnp.int32), jnp.arange(8, dtype=jnp.int32)[None])
    err.throw()  # a valid layout passes
