"""Argument checking for the public ops.

Every check runs at trace time on static shapes, dtypes and Python values, so a bad call fails with a ValueError or
TypeError naming the argument, what was expected and what came, before any kernel runs. `validate` returns a
`Problem`: the canonical inputs (defaults filled in, integer arrays as int32) and the static sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from csa_pallas.kernels import teacher_config

TARGETS = ("joint", "per_head")
REDUCTIONS = ("mean", "mean_all", "sum", "none")
IMPLEMENTATIONS = (None, "xla", "pallas")
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
INT32 = np.iinfo(np.int32)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Validated, canonical inputs of one call. Arrays keep their caller dtype except int arrays (int32)."""

    q: jax.Array  # [B, S, H, D]
    compressed_kv: jax.Array  # [B, N, D]
    segment_ids: jax.Array  # [B, S] int32
    positions: jax.Array  # [B, S] int32
    kv_segment_ids: jax.Array  # [B, S_kv] int32
    kv_positions: jax.Array  # [B, S_kv] int32
    topk_indices: Optional[jax.Array]  # [B, S, K] int32 or None (dense)
    window_kv: Optional[jax.Array]  # [B, S_kv, D]
    sinks: Optional[jax.Array]  # [H]
    noncompressed_lse: Optional[jax.Array]  # [B, S, H]
    full_lse: Optional[jax.Array]  # [B, S, H]
    loss_mask: Optional[jax.Array]  # [B, S] bool, False = the row takes no part in the loss; None = all True
    compress_ratio: int
    window_size: int
    softmax_scale: float
    target: str
    head_chunk: Optional[int]  # None: the kernel config's default
    implementation: Optional[str]
    default_ids: bool = False  # no ids/positions given: one document, positions 0..S-1, S_kv == S
    # Query rows of a default-ids problem (`fused_student`'s chunks): one document, the keys at positions
    # 0..S_kv-1, the queries at their explicit positions. V(t) is then a prefix of the blocks, as for default ids.
    default_keys: bool = False
    # compressed_kv is already the kernels' key operand (`ops.kernel_keys`: compute dtype, non-finite rows NaN, or
    # `ops.cast_keys` when the caller makes the rows that read them NaN itself): set by callers that run the teacher
    # many times on one key sequence (`fused_student`'s query chunks).
    kv_ready: bool = False
    # The same callers' q rows in place (sparse gather path): (q_all [B, S_all, H, D], first_row int32 scalar), q
    # being q_all[:, first_row:first_row + S]; the teacher kernel reads them there (`sparse_gather.RowWindow`)
    # where q_all is in the kernels' compute dtype and S a multiple of the query tile, so no per-chunk copy of q.
    q_window: Optional[tuple] = None
    # The caller's teacher kernel variant (`fused_indexer_distill_loss(config=...)`), which the layouts take when
    # given none (`ops.dense_layout`, `ops_sparse.sparse_layout`): a `TeacherConfig`, or a Mapping of overrides kept
    # as sorted (field, value) pairs (`freeze_config`: the chunked loss keeps a problem's static fields in a
    # custom_vjp's static argument, which must hash). None: the heuristics.
    teacher_config: Optional[object] = None

    @property
    def layout_config(self):
        """`teacher_config` as the layouts take it: a TeacherConfig, a dict of overrides, or None."""
        return thaw_config(self.teacher_config)

    @property
    def one_document_prefix(self) -> bool:
        """V(t) = blocks [0, (positions[t] + 1) // m): default ids, or query rows of a default-ids problem."""
        return self.default_ids or self.default_keys

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def seq_len(self) -> int:
        return self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.compressed_kv.shape[1]

    @property
    def kv_len(self) -> int:
        return self.kv_segment_ids.shape[1]

    @property
    def sparse(self) -> bool:
        return self.topk_indices is not None

    @property
    def width(self) -> int:
        """Last dim of the student / target: N (dense) or K (sparse)."""
        return self.topk_indices.shape[2] if self.sparse else self.num_blocks


def freeze_config(config):
    """A teacher `config=` (None, a `TeacherConfig`, or a Mapping of its fields and "path") in the hashable form
    `Problem.teacher_config` keeps; the fields themselves are checked where the layout applies them."""
    if config is None or isinstance(config, teacher_config.TeacherConfig):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected None, a TeacherConfig or a dict of its fields, got "
                        f"{type(config).__name__}")
    return tuple(sorted(config.items()))


def thaw_config(config):
    """`freeze_config`'s result as the ops' config= takes it: a TeacherConfig, a dict of overrides, or None."""
    return dict(config) if isinstance(config, tuple) else config


def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def _dtype(x):
    return jnp.asarray(x).dtype if not hasattr(x, "dtype") else jnp.dtype(x.dtype)


def _check_array(name: str, x) -> None:
    """Arrays only: a Python list or scalar would otherwise fail deep inside with an AttributeError."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name}: expected an array (jax.Array or numpy.ndarray), got {type(x).__name__}")


def _concrete(x) -> Optional[np.ndarray]:
    """The values of x when they are known at trace time (a NumPy array or a non-traced jax array), else None."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            return np.asarray(x)
        except Exception:  # e.g. a non-addressable sharded array
            return None
    return None


def _check_float(name: str, x) -> None:
    _check_array(name, x)
    dt = _dtype(x)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype in (float32, bfloat16, float16), got {dt}")


def _check_int(name: str, x) -> jax.Array:
    """Integer ids -> int32. Values outside the int32 range are an error when they can be seen (concrete arrays)."""
    _check_array(name, x)
    dt = _dtype(x)
    if not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {dt}")
    values = _concrete(x)
    if values is not None and values.size and (jnp.iinfo(dt).bits > 32 or dt == jnp.uint32):
        lo, hi = int(values.min()), int(values.max())
        if lo < INT32.min or hi > INT32.max:
            raise ValueError(f"{name}: values must fit in int32, got the range [{lo}, {hi}]")
    if isinstance(x, np.ndarray):
        return jnp.asarray(x.astype(np.int32))
    return jnp.asarray(x).astype(jnp.int32)


def canonical_topk(name: str, x, num_blocks: int) -> jax.Array:
    """Top-k indices of any integer dtype -> int32 (SPEC §2: a value outside [0, N) is an empty slot, never wrapped
    or truncated onto a valid block, also beyond the int32 range). Dtypes that fit in int32 are cast (their values
    are kept; out-of-range ones are empty downstream); wider ones (uint32, int64, uint64) have every value outside
    [0, N) replaced by -1 before the cast."""
    _check_array(name, x)
    dt = _dtype(x)
    if not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {dt}")
    info = jnp.iinfo(dt)
    if info.min >= INT32.min and info.max <= INT32.max:
        # int32 itself, or narrower: every value survives the cast, and the kernels and the reference treat any
        # value outside [0, N) as an empty slot. No second [B, S, K] array (256 MiB at S = 128K) is made.
        return x if dt == jnp.int32 and isinstance(x, jax.Array) else jnp.asarray(x).astype(jnp.int32)
    if isinstance(x, np.ndarray):  # exact in NumPy (an int64 array would be truncated by jnp.asarray without x64)
        valid = (x >= 0) & (x < num_blocks)
        return jnp.asarray(np.where(valid, x, -1).astype(np.int32))
    x = jnp.asarray(x)
    valid = (x >= 0) if info.min < 0 else jnp.ones(x.shape, bool)
    if num_blocks <= info.max:
        valid = valid & (x < num_blocks)
    return jnp.where(valid, jnp.where(valid, x, 0).astype(jnp.int32), -1)


def _check_shape(name: str, x, expected: tuple, meaning: str) -> None:
    if _shape(x) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({meaning}), got {_shape(x)}")


def _check_rank(name: str, x, rank: int, meaning: str) -> None:
    if len(_shape(x)) != rank:
        raise ValueError(f"{name}: expected rank {rank} ({meaning}), got shape {_shape(x)}")


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a Python int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return int(value)


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def check_reduction_args(reduction, scale) -> None:
    check_choice("reduction", reduction, REDUCTIONS)
    if isinstance(scale, (bool, str, list, tuple)) or not (np.ndim(scale) == 0):
        raise TypeError(f"scale: expected a scalar number, got {scale!r}")


def static_scale(scale) -> Optional[float]:
    """`scale` as a Python float when it is known at trace time (a Python or NumPy number), else None (traced)."""
    if isinstance(scale, (int, float, np.number)) and not isinstance(scale, (bool, np.bool_)):
        return float(scale)
    if isinstance(scale, np.ndarray) and scale.ndim == 0:
        return float(scale)
    return None


def switched_off(scale) -> bool:
    """A static scale of exactly 0 (SPEC §4): the loss is an exact 0 and nothing is computed."""
    value = static_scale(scale)
    return value is not None and value == 0.0


def resolve_head_chunk(head_chunk, num_heads: int) -> int:
    """None -> all heads; otherwise any divisor of H."""
    if head_chunk is None:
        return num_heads
    head_chunk = _check_positive_int("head_chunk", head_chunk)
    if num_heads % head_chunk:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(f"head_chunk: expected a divisor of the number of heads H={num_heads} (one of {divisors}), "
                         f"got {head_chunk}")
    return head_chunk


def _check_q_layout(q_shape, compressed_kv_shape, compress_ratio: int, others: dict) -> None:
    """q must be [B, S, H, D] (MaxText layout). A q passed as [B, H, S, D] would otherwise surface as an unrelated
    mismatch (N vs S_kv // m, or missing kv ids); say what it most likely is."""
    b, s, h, d = q_shape
    if h <= s:  # a sequence shorter than the head count: nothing points at a swapped layout
        return
    lengths = {name: _shape(x)[1] for name, x in others.items() if x is not None and len(_shape(x)) >= 2}
    n = compressed_kv_shape[1] if len(compressed_kv_shape) == 3 else None
    seq_like = [name for name, length in lengths.items() if length == h]
    if n is not None and n != s // compress_ratio and n == h // compress_ratio:
        seq_like.append("compressed_kv (N = S // compress_ratio)")
    if seq_like:
        raise ValueError(f"q: expected shape [B, S, H, D] (MaxText layout: sequence before heads), got {q_shape}; "
                         f"its dim 2 ({h}) matches the sequence length of {', '.join(seq_like)}: if q is "
                         f"[B, H, S, D], pass jnp.swapaxes(q, 1, 2)")


def validate(
    q,
    compressed_kv,
    *,
    topk_indices=None,
    window_kv=None,
    sinks=None,
    noncompressed_lse=None,
    full_lse=None,
    segment_ids=None,
    positions=None,
    kv_segment_ids=None,
    kv_positions=None,
    loss_mask=None,
    compress_ratio: int = 4,
    window_size: int = 128,
    softmax_scale: Optional[float] = None,
    target: str = "joint",
    head_chunk: Optional[int] = None,
    implementation: Optional[str] = None,
) -> Problem:
    """Checks the teacher-side arguments (SPEC §1) and returns the canonical `Problem`."""
    check_choice("target", target, TARGETS)
    check_choice("implementation", implementation, IMPLEMENTATIONS)
    compress_ratio = _check_positive_int("compress_ratio", compress_ratio)
    window_size = _check_positive_int("window_size", window_size)

    _check_array("q", q)
    _check_rank("q", q, 4, "[B, S, H, D]")
    _check_float("q", q)
    b, s, h, d = _shape(q)
    _check_array("compressed_kv", compressed_kv)
    _check_rank("compressed_kv", compressed_kv, 3, "[B, N, D]")
    _check_float("compressed_kv", compressed_kv)
    row_arrays = dict(window_kv=window_kv, segment_ids=segment_ids, positions=positions, loss_mask=loss_mask,
                      topk_indices=topk_indices, noncompressed_lse=noncompressed_lse, full_lse=full_lse,
                      kv_segment_ids=kv_segment_ids, kv_positions=kv_positions)
    for name, x in row_arrays.items():
        if x is not None:
            _check_array(name, x)
    _check_q_layout((b, s, h, d), _shape(compressed_kv), compress_ratio, row_arrays)
    if _shape(compressed_kv)[0] != b or _shape(compressed_kv)[2] != d:
        raise ValueError(f"compressed_kv: expected shape [B={b}, N, D={d}] (batch and head dim of q), "
                         f"got {_shape(compressed_kv)}")
    n = _shape(compressed_kv)[1]

    if softmax_scale is None:
        softmax_scale = float(d) ** -0.5
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating)):
        raise TypeError(f"softmax_scale: expected a Python float or None, got {type(softmax_scale).__name__}")
    softmax_scale = float(softmax_scale)
    if head_chunk is not None:
        head_chunk = resolve_head_chunk(head_chunk, h)

    default_ids = all(x is None for x in (segment_ids, positions, kv_segment_ids, kv_positions))
    # Query-side packing arrays.
    if segment_ids is not None:
        _check_shape("segment_ids", segment_ids, (b, s), "[B, S] from q")
        segment_ids = _check_int("segment_ids", segment_ids)
    else:
        segment_ids = jnp.zeros((b, s), jnp.int32)
    if positions is not None:
        _check_shape("positions", positions, (b, s), "[B, S] from q")
        positions = _check_int("positions", positions)
    else:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if loss_mask is not None:
        _check_shape("loss_mask", loss_mask, (b, s), "[B, S] from q")
        if _dtype(loss_mask) != jnp.dtype(bool):
            raise TypeError(f"loss_mask: expected a bool array (True = the row takes part in the loss), got "
                            f"{_dtype(loss_mask)}")
        loss_mask = jnp.asarray(loss_mask)

    # Key side: S_kv comes from whichever key-side array is given, else equals S.
    kv_len = None
    for name, x in (("window_kv", window_kv), ("kv_segment_ids", kv_segment_ids), ("kv_positions", kv_positions)):
        if x is not None:
            _check_rank(name, x, 3 if name == "window_kv" else 2,
                        "[B, S_kv, D]" if name == "window_kv" else "[B, S_kv]")
            if kv_len is None:
                kv_len = _shape(x)[1]
    if kv_len is None:
        kv_len = s
    if kv_segment_ids is None and kv_positions is None and kv_len != s:
        raise ValueError(f"kv_segment_ids/kv_positions: required when the key length S_kv={kv_len} (from window_kv) "
                         f"differs from the query length S={s}")
    if kv_segment_ids is not None:
        _check_shape("kv_segment_ids", kv_segment_ids, (b, kv_len), "[B, S_kv]")
        kv_segment_ids = _check_int("kv_segment_ids", kv_segment_ids)
    else:
        if kv_len != s:
            raise ValueError(f"kv_segment_ids: required when S_kv={kv_len} differs from S={s}")
        kv_segment_ids = segment_ids
    if kv_positions is not None:
        _check_shape("kv_positions", kv_positions, (b, kv_len), "[B, S_kv]")
        kv_positions = _check_int("kv_positions", kv_positions)
    else:
        if kv_len != s:
            raise ValueError(f"kv_positions: required when S_kv={kv_len} differs from S={s}")
        kv_positions = positions
    if n != kv_len // compress_ratio:
        raise ValueError(f"compressed_kv: expected N = S_kv // compress_ratio = {kv_len} // {compress_ratio} = "
                         f"{kv_len // compress_ratio} blocks, got N={n}")

    if topk_indices is not None:
        _check_rank("topk_indices", topk_indices, 3, "[B, S, K]")
        if _shape(topk_indices)[:2] != (b, s) or _shape(topk_indices)[2] < 1:
            raise ValueError(f"topk_indices: expected shape [B={b}, S={s}, K>=1], got {_shape(topk_indices)}")
        topk_indices = canonical_topk("topk_indices", topk_indices, n)

    # Teacher denominators: which of window_kv / sinks / noncompressed_lse / full_lse may come together.
    if target == "per_head":
        for name, x in (("full_lse", full_lse), ("noncompressed_lse", noncompressed_lse)):
            if x is not None:
                raise ValueError(f"{name}: given with target='per_head', which normalises each head over the "
                                 f"compressed blocks alone; drop {name} or ask for target='joint'")
        window_kv = sinks = None  # irrelevant to the per-head target
    else:
        given = [name for name, x in (("window_kv", window_kv), ("noncompressed_lse", noncompressed_lse),
                                      ("full_lse", full_lse)) if x is not None]
        if not given:
            raise ValueError("window_kv: target='joint' needs the layer's non-compressed keys: pass window_kv "
                             "(and sinks), or noncompressed_lse, or full_lse; or ask for target='per_head'")
        if len(given) > 1:
            raise ValueError(f"{given[1]}: pass only one of window_kv, noncompressed_lse, full_lse for "
                             f"target='joint', got {given}")
        if sinks is not None and window_kv is None:
            raise ValueError(f"sinks: only used with window_kv; {given[0]} already includes the sink term")
    if window_kv is not None:
        _check_shape("window_kv", window_kv, (b, kv_len, d), "[B, S_kv, D]")
        _check_float("window_kv", window_kv)
    if sinks is not None:
        _check_array("sinks", sinks)
        _check_shape("sinks", sinks, (h,), "[H], one sink logit per head")
        _check_float("sinks", sinks)
    for name, x in (("noncompressed_lse", noncompressed_lse), ("full_lse", full_lse)):
        if x is not None:
            _check_shape(name, x, (b, s, h), "[B, S, H]")
            _check_float(name, x)

    return Problem(q=q, compressed_kv=compressed_kv, segment_ids=segment_ids, positions=positions,
                   kv_segment_ids=kv_segment_ids, kv_positions=kv_positions, topk_indices=topk_indices,
                   window_kv=window_kv, sinks=sinks, noncompressed_lse=noncompressed_lse, full_lse=full_lse,
                   loss_mask=loss_mask, compress_ratio=compress_ratio, window_size=window_size,
                   softmax_scale=softmax_scale, target=target, head_chunk=head_chunk, implementation=implementation,
                   default_ids=default_ids and kv_len == s)


def validate_logits(indexer_logits, problem: Problem) -> None:
    """The student logits: [B, S, N] in dense mode, [B, S, K] in sparse mode, floating."""
    expected = (problem.batch, problem.seq_len, problem.width)
    meaning = "[B, S, K] like topk_indices" if problem.sparse else "[B, S, N] with N from compressed_kv"
    _check_array("indexer_logits", indexer_logits)
    _check_rank("indexer_logits", indexer_logits, 3, meaning)
    _check_shape("indexer_logits", indexer_logits, expected, meaning)
    _check_float("indexer_logits", indexer_logits)


def validate_window_args(q, window_kv, *, sinks, segment_ids, positions, kv_segment_ids, kv_positions, window_size,
                         softmax_scale, head_chunk, implementation) -> Problem:
    """Arguments of `noncompressed_lse`: same checks, with a placeholder compressed_kv of the right N."""
    _check_array("q", q)
    _check_array("window_kv", window_kv)
    _check_rank("q", q, 4, "[B, S, H, D]")
    _check_rank("window_kv", window_kv, 3, "[B, S_kv, D]")
    b, _, _, d = _shape(q)
    kv_len = _shape(window_kv)[1]
    placeholder = jax.ShapeDtypeStruct((b, kv_len, d), jnp.float32)
    problem = validate(q, placeholder, window_kv=window_kv, sinks=sinks, segment_ids=segment_ids,
                       positions=positions, kv_segment_ids=kv_segment_ids, kv_positions=kv_positions,
                       compress_ratio=1, window_size=window_size, softmax_scale=softmax_scale, target="joint",
                       head_chunk=head_chunk, implementation=implementation)
    return problem

