"""Every argument check of `csa_pallas.validation`, through the public API.

Each bad call must raise the documented exception type with a message that starts with the offending argument's
name. Calls run under `jax.eval_shape`: validation happens at trace time, so nothing is compiled.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import csa_pallas

B, S, H, D, M = 1, 8, 4, 4, 4
N = S // M
DROP = object()  # override value meaning "do not pass this argument"


def f32(*shape):
    return np.zeros(shape, np.float32)


def i32(*shape):
    return np.zeros(shape, np.int32)


def base_args():
    return dict(indexer_logits=f32(B, S, N), q=f32(B, S, H, D), compressed_kv=f32(B, N, D), window_kv=f32(B, S, D),
                compress_ratio=M, window_size=4, implementation="xla")


def call(fn=csa_pallas.indexer_distill_loss, **overrides):
    kw = base_args()
    for k, v in overrides.items():
        if v is DROP:
            kw.pop(k, None)
        else:
            kw[k] = v
    if fn is not csa_pallas.indexer_distill_loss:
        kw.pop("indexer_logits")
    return jax.eval_shape(functools.partial(fn, **kw))


def test_valid_calls_pass():
    """Positive controls: the base arguments (and their sparse / per-head / lse variants) validate."""
    assert call().shape == () and call(reduction="none").shape == (B, S)
    assert call(fn=csa_pallas.teacher_distribution).shape == (B, S, N)
    assert call(topk_indices=i32(B, S, 3), indexer_logits=f32(B, S, 3)).shape == ()
    assert call(target="per_head", window_kv=DROP).shape == ()
    assert call(window_kv=DROP, noncompressed_lse=f32(B, S, H)).shape == ()
    assert call(window_kv=DROP, full_lse=f32(B, S, H)).shape == ()
    assert call(sinks=f32(H), head_chunk=2, softmax_scale=0.5, scale=np.float32(2.0)).shape == ()
    ids = dict(segment_ids=i32(B, S), positions=i32(B, S), kv_segment_ids=i32(B, S), kv_positions=i32(B, S))
    assert call(**ids).shape == ()
    assert call(window_kv=f32(B, 2 * S, D), compressed_kv=f32(B, 2 * N, D), kv_segment_ids=i32(B, 2 * S),
                kv_positions=i32(B, 2 * S), indexer_logits=f32(B, S, 2 * N)).shape == ()
    u = jax.eval_shape(functools.partial(csa_pallas.noncompressed_lse, f32(B, S, H, D), f32(B, S, D), sinks=f32(H),
                                         window_size=4, implementation="xla"))
    assert u.shape == (B, S, H)


SHAPE_ERRORS = [  # (overrides, regex)
    (dict(q=f32(B, S, H)), r"^q: expected rank 4 \(\[B, S, H, D\]\), got shape \(1, 8, 4\)"),
    (dict(compressed_kv=f32(N, D)), r"^compressed_kv: expected rank 3"),
    (dict(compressed_kv=f32(2, N, D)), r"^compressed_kv: expected shape \[B=1, N, D=4\] .*got \(2, 2, 4\)"),
    (dict(compressed_kv=f32(B, N, D + 1)), r"^compressed_kv: expected shape \[B=1, N, D=4\]"),
    (dict(compressed_kv=f32(B, N + 1, D), indexer_logits=f32(B, S, N + 1)),
     r"^compressed_kv: expected N = S_kv // compress_ratio = 8 // 4 = 2 blocks, got N=3"),
    (dict(compress_ratio=2), r"^compressed_kv: expected N = S_kv // compress_ratio = 8 // 2 = 4 blocks, got N=2"),
    (dict(indexer_logits=f32(B, S)), r"^indexer_logits: expected rank 3"),
    (dict(indexer_logits=f32(B, S, N + 1)),
     r"^indexer_logits: expected shape \(1, 8, 2\) \(\[B, S, N\] with N from compressed_kv\), got \(1, 8, 3\)"),
    (dict(topk_indices=i32(B, S, 3)), r"^indexer_logits: expected shape \(1, 8, 3\) \(\[B, S, K\] like topk_indices\)"),
    (dict(topk_indices=i32(S, 3)), r"^topk_indices: expected rank 3"),
    (dict(topk_indices=i32(B, S - 1, 3)), r"^topk_indices: expected shape \[B=1, S=8, K>=1\], got \(1, 7, 3\)"),
    (dict(topk_indices=i32(B, S, 0)), r"^topk_indices: expected shape \[B=1, S=8, K>=1\], got \(1, 8, 0\)"),
    (dict(window_kv=f32(B, S, D + 1)), r"^window_kv: expected shape \(1, 8, 4\) \(\[B, S_kv, D\]\)"),
    (dict(window_kv=f32(S, D)), r"^window_kv: expected rank 3"),
    (dict(sinks=f32(H - 1)), r"^sinks: expected shape \(4,\) \(\[H\], one sink logit per head\)"),
    (dict(segment_ids=i32(B, S - 1)), r"^segment_ids: expected shape \(1, 8\)"),
    (dict(positions=i32(S)), r"^positions: expected shape \(1, 8\)"),
    (dict(kv_segment_ids=i32(B, S - 1)), r"^kv_segment_ids: expected shape \(1, 8\)"),
    (dict(kv_positions=i32(B, S, 1)), r"^kv_positions: expected rank 2"),
    (dict(window_kv=DROP, noncompressed_lse=f32(B, S, H - 1)), r"^noncompressed_lse: expected shape \(1, 8, 4\)"),
    (dict(window_kv=DROP, full_lse=f32(B, S + 1, H)), r"^full_lse: expected shape \(1, 8, 4\)"),
]


@pytest.mark.parametrize("overrides,regex", SHAPE_ERRORS, ids=[r.split(":")[0][1:] + str(i)
                                                                for i, (_, r) in enumerate(SHAPE_ERRORS)])
def test_shape_errors(overrides, regex):
    with pytest.raises(ValueError, match=regex):
        call(**overrides)


DTYPE_ERRORS = [
    (dict(q=np.zeros((B, S, H, D), np.int32)), r"^q: expected a floating dtype in \(float32, bfloat16, float16\), "
                                                r"got int32"),
    (dict(q=np.zeros((B, S, H, D), np.float64)), r"^q: expected a floating dtype .*got float64"),
    (dict(compressed_kv=np.zeros((B, N, D), np.float64)), r"^compressed_kv: expected a floating dtype .*got float64"),
    (dict(window_kv=np.zeros((B, S, D), np.int8)), r"^window_kv: expected a floating dtype .*got int8"),
    (dict(sinks=np.zeros((H,), np.int32)), r"^sinks: expected a floating dtype"),
    (dict(window_kv=DROP, noncompressed_lse=np.zeros((B, S, H), np.float64)),
     r"^noncompressed_lse: expected a floating"),
    (dict(window_kv=DROP, full_lse=np.zeros((B, S, H), np.int32)), r"^full_lse: expected a floating dtype"),
    (dict(indexer_logits=np.zeros((B, S, N), np.int32)), r"^indexer_logits: expected a floating dtype .*got int32"),
    (dict(indexer_logits=np.zeros((B, S, N), np.float64)), r"^indexer_logits: expected a floating dtype .*got float64"),
    (dict(topk_indices=np.zeros((B, S, 3), np.float32), indexer_logits=f32(B, S, 3)),
     r"^topk_indices: expected an integer dtype, got float32"),
    (dict(segment_ids=np.zeros((B, S), np.float32)), r"^segment_ids: expected an integer dtype, got float32"),
    (dict(positions=np.zeros((B, S), np.float32)), r"^positions: expected an integer dtype"),
    (dict(kv_segment_ids=np.zeros((B, S), np.float32)), r"^kv_segment_ids: expected an integer dtype"),
    (dict(kv_positions=np.zeros((B, S), np.float64)), r"^kv_positions: expected an integer dtype"),
]


@pytest.mark.parametrize("overrides,regex", DTYPE_ERRORS, ids=[r.split(":")[0][1:] + str(i)
                                                                for i, (_, r) in enumerate(DTYPE_ERRORS)])
def test_dtype_errors(overrides, regex):
    with pytest.raises(TypeError, match=regex):
        call(**overrides)


ARG_ERRORS = [  # (overrides, exception, regex)
    (dict(compress_ratio=0), ValueError, r"^compress_ratio: expected an int >= 1, got 0"),
    (dict(compress_ratio=-4), ValueError, r"^compress_ratio: expected an int >= 1, got -4"),
    (dict(compress_ratio=4.0), TypeError, r"^compress_ratio: expected a Python int >= 1, got float 4.0"),
    (dict(compress_ratio=True), TypeError, r"^compress_ratio: expected a Python int >= 1, got bool True"),
    (dict(window_size=0), ValueError, r"^window_size: expected an int >= 1, got 0"),
    (dict(window_size=1.5), TypeError, r"^window_size: expected a Python int >= 1, got float 1.5"),
    (dict(window_size=None), TypeError, r"^window_size: expected a Python int >= 1, got NoneType None"),
    (dict(head_chunk=3), ValueError,
     r"^head_chunk: expected a divisor of the number of heads H=4 \(one of \[1, 2, 4\]\), got 3"),
    (dict(head_chunk=8), ValueError, r"^head_chunk: expected a divisor .*\(one of \[1, 2, 4\]\), got 8"),
    (dict(head_chunk=0), ValueError, r"^head_chunk: expected an int >= 1, got 0"),
    (dict(head_chunk=2.0), TypeError, r"^head_chunk: expected a Python int >= 1, got float 2.0"),
    (dict(softmax_scale="0.5"), TypeError, r"^softmax_scale: expected a Python float or None, got str"),
    (dict(softmax_scale=True), TypeError, r"^softmax_scale: expected a Python float or None, got bool"),
    (dict(target="both"), ValueError, r"^target: expected one of \('joint', 'per_head'\), got 'both'"),
    (dict(reduction="avg"), ValueError,
     r"^reduction: expected one of \('mean', 'mean_all', 'sum', 'none'\), got 'avg'"),
    (dict(implementation="cuda"), ValueError,
     r"^implementation: expected one of \(None, 'xla', 'pallas'\), got 'cuda'"),
    (dict(scale="1.0"), TypeError, r"^scale: expected a scalar number, got '1.0'"),
    (dict(scale=True), TypeError, r"^scale: expected a scalar number, got True"),
    (dict(scale=np.ones(2, np.float32)), TypeError, r"^scale: expected a scalar number"),
]


@pytest.mark.parametrize("overrides,exc,regex", ARG_ERRORS, ids=[r.split(":")[0][1:] + str(i)
                                                                  for i, (_, _, r) in enumerate(ARG_ERRORS)])
def test_argument_errors(overrides, exc, regex):
    with pytest.raises(exc, match=regex):
        call(**overrides)


DENOMINATOR_ERRORS = [
    (dict(window_kv=DROP),
     r"^window_kv: target='joint' needs the layer's non-compressed keys: pass window_kv \(and sinks\), or "
     r"noncompressed_lse, or full_lse; or ask for target='per_head'"),
    (dict(window_kv=DROP, sinks=f32(H)), r"^window_kv: target='joint' needs"),
    (dict(target="per_head", window_kv=DROP, full_lse=f32(B, S, H)),
     r"^full_lse: given with target='per_head'.*drop full_lse or ask for target='joint'"),
    (dict(target="per_head", noncompressed_lse=f32(B, S, H)),
     r"^noncompressed_lse: given with target='per_head'.*drop noncompressed_lse or ask for target='joint'"),
    (dict(noncompressed_lse=f32(B, S, H)),
     r"^noncompressed_lse: pass only one of window_kv, noncompressed_lse, full_lse for target='joint', "
     r"got \['window_kv', 'noncompressed_lse'\]"),
    (dict(full_lse=f32(B, S, H)), r"^full_lse: pass only one of .*got \['window_kv', 'full_lse'\]"),
    (dict(window_kv=DROP, noncompressed_lse=f32(B, S, H), full_lse=f32(B, S, H)),
     r"^full_lse: pass only one of .*got \['noncompressed_lse', 'full_lse'\]"),
    (dict(window_kv=DROP, noncompressed_lse=f32(B, S, H), sinks=f32(H)),
     r"^sinks: only used with window_kv; noncompressed_lse already includes the sink term"),
    (dict(window_kv=DROP, full_lse=f32(B, S, H), sinks=f32(H)),
     r"^sinks: only used with window_kv; full_lse already includes the sink term"),
    # query length S != key length S_kv (context parallelism) needs the key-side ids
    (dict(window_kv=f32(B, 2 * S, D), compressed_kv=f32(B, 2 * N, D)),
     r"^kv_segment_ids/kv_positions: required when the key length S_kv=16 \(from window_kv\) differs from the "
     r"query length S=8"),
    (dict(window_kv=f32(B, 2 * S, D), compressed_kv=f32(B, 2 * N, D), kv_segment_ids=i32(B, 2 * S)),
     r"^kv_positions: required when S_kv=16 differs from S=8"),
    (dict(window_kv=f32(B, 2 * S, D), compressed_kv=f32(B, 2 * N, D), kv_positions=i32(B, 2 * S)),
     r"^kv_segment_ids: required when S_kv=16 differs from S=8"),
]


@pytest.mark.parametrize("overrides,regex", DENOMINATOR_ERRORS, ids=[r.split(":")[0][1:] + str(i)
                                                                      for i, (_, r) in enumerate(DENOMINATOR_ERRORS)])
@pytest.mark.parametrize("fn", ["loss", "teacher"])
def test_denominator_and_key_side_errors(fn, overrides, regex):
    """Also through `teacher_distribution`, which shares the teacher-side checks."""
    fn = csa_pallas.indexer_distill_loss if fn == "loss" else csa_pallas.teacher_distribution
    with pytest.raises(ValueError, match=regex):
        call(fn=fn, **overrides)


@pytest.mark.parametrize("fn", ["loss", "teacher"])
def test_pallas_window_kernel_needs_the_key_sequence_to_be_the_query_sequence(fn):
    # Context-parallel shapes (S_kv != S) have no window-LSE kernel yet: a clear NotImplementedError, no fallback.
    fn = csa_pallas.indexer_distill_loss if fn == "loss" else csa_pallas.teacher_distribution
    kv_len = 2 * S
    with pytest.raises(NotImplementedError, match=r"implementation='pallas': the window-LSE kernel needs the key "
                                                  r"sequence to be the query sequence \(S_kv == S\)"):
        call(fn=fn, window_kv=f32(B, kv_len, D), kv_segment_ids=i32(B, kv_len), kv_positions=i32(B, kv_len),
             compressed_kv=f32(B, kv_len // M, D), indexer_logits=f32(B, S, kv_len // M), implementation="pallas")


def test_teacher_distribution_rejects_bad_target():
    with pytest.raises(ValueError, match=r"^target: expected one of"):
        call(fn=csa_pallas.teacher_distribution, target="joint_v2")


NONCOMPRESSED_ERRORS = [
    (dict(q=f32(B, S, H)), ValueError, r"^q: expected rank 4"),
    (dict(window_kv=f32(S, D)), ValueError, r"^window_kv: expected rank 3"),
    (dict(window_kv=f32(B, S, D + 1)), ValueError, r"^window_kv: expected shape \(1, 8, 4\)"),
    (dict(sinks=f32(H + 1)), ValueError, r"^sinks: expected shape \(4,\)"),
    (dict(q=np.zeros((B, S, H, D), np.int32)), TypeError, r"^q: expected a floating dtype"),
    (dict(window_size=0), ValueError, r"^window_size: expected an int >= 1"),
    (dict(head_chunk=3), ValueError, r"^head_chunk: expected a divisor .*\(one of \[1, 2, 4\]\)"),
    (dict(window_kv=f32(B, 2 * S, D)), ValueError, r"^kv_segment_ids/kv_positions: required"),
    (dict(segment_ids=np.zeros((B, S), np.float32)), TypeError, r"^segment_ids: expected an integer dtype"),
    (dict(implementation="tpu"), ValueError, r"^implementation: expected one of"),
]


@pytest.mark.parametrize("overrides,exc,regex", NONCOMPRESSED_ERRORS,
                         ids=[r.split(":")[0][1:] + str(i) for i, (_, _, r) in enumerate(NONCOMPRESSED_ERRORS)])
def test_noncompressed_lse_errors(overrides, exc, regex):
    kw = dict(q=f32(B, S, H, D), window_kv=f32(B, S, D), sinks=f32(H), window_size=4, implementation="xla")
    kw.update(overrides)
    q, window_kv = kw.pop("q"), kw.pop("window_kv")
    with pytest.raises(exc, match=regex):
        jax.eval_shape(functools.partial(csa_pallas.noncompressed_lse, q, window_kv, **kw))
