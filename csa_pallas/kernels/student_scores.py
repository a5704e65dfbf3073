"""The lightning indexer's scores and their three gradients as Pallas kernels (SPEC §8), dense mode.

    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s])        q [S, H_I, d_I], k [N, d_I], w [S, H_I]

Forward (`_scores_kernel`, grid (B x query tiles zig-zagged, kv tiles)): per tile, one [bq, d_I] x [d_I, bk]
product per indexer head, its ReLU and the head-weighted sum in VMEM; the [bq, H_I, bk] terms never leave the kernel.
Backward (`_grads_kernel`, same grid, kv tiles innermost): from the scores' cotangent g [bq, bk] the kernel
recomputes each head's products and forms G_j = g * w_j * [q_j . k > 0], then
    dq_j += G_j k,   dw_j += rowsum(g * ReLU(q_j . k)),   dk += G_j^T q_j;
dq and dw stay resident over the kv tiles; dk is written per (query tile, kv tile) and summed over the query tiles
in XLA ([B, S/bq, N, d_I] f32: the kv-side accumulation would need the query tiles innermost and a second
recomputation of the products).

Numerics ("exact", as `student.scores`): bf16 queries and keys enter the MXU as bf16 (products exact in f32,
accumulation f32); the backward splits each f32 G_j into bf16 hi + lo for two passes (~2^-17 relative), so the
gradients match float64 to ~1e-6. Any other dtype runs as f32 at HIGHEST precision.

Tiles no query of the query tile can see (every block of the kv tile ends after the tile's last position) are
skipped: their scores are written as 0 (outside V(t), never read) and contribute no gradient, which is exact
because the loss's cotangent is 0 outside V(t). With `trim_kv_tile` a computing tile is also trimmed to its
visible prefix in 128-block parts (the causal diagonal's tiles: at S = 4096 with 128 x 256 tiles, 16 of the 80
computing steps need only their first half): the products cover that prefix, the rest is written as 0. The
schedule is scalar-prefetched as [B * nq * nk] int32 visible parts (0 = skip), or for default ids read off the
grid.

Layout: index_q enters as [B, S_p, H_I * d_p] (a free reshape; d_p = d_I rounded up to 128 lanes, zero-padded
when d_I is not a multiple of 128, so each head's slice is lane-aligned).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, runtime

NT = (((1,), (1,)), ((), ()))  # a . b^T
TN = (((0,), (0,)), ((), ()))  # a^T . b
NN = (((1,), (0,)), ((), ()))  # a . b
# The skip table is scalar-prefetched whole; SMEM holds ~200K int32 (pallas-notes §2.3).
MAX_TABLE_ENTRIES = 1 << 17
# Blocks per part of a kv tile that trim_kv_tile distinguishes: one lane width of the scores tile.
PART_BLOCKS = 128


@dataclasses.dataclass(frozen=True)
class StudentKernelConfig:
    """Tiles of the student kernels. block_q: query rows per tile (multiple of 16); block_k: compressed blocks per
    kv tile (multiple of 128); trim_kv_tile: a computing tile's products cover only its visible prefix of
    128-block parts (one kernel body per prefix length; False: every computing tile is computed whole);
    vmem_limit_bytes: Mosaic's scoped-VMEM limit for both kernels."""

    block_q: int = 128
    block_k: int = 256
    trim_kv_tile: bool = True
    vmem_limit_bytes: int = 48 * common.MiB

    @property
    def parts(self) -> int:
        """Parts of a kv tile the schedule distinguishes (1: the tile is computed whole or skipped)."""
        return self.block_k // PART_BLOCKS if self.trim_kv_tile else 1

    def __post_init__(self):
        if self.block_q < 16 or self.block_q % 16:
            raise ValueError(f"block_q: expected a positive multiple of 16, got {self.block_q}")
        if self.block_k < 128 or self.block_k % 128:
            raise ValueError(f"block_k: expected a positive multiple of 128, got {self.block_k}")
        if self.vmem_limit_bytes < common.MiB:
            raise ValueError(f"vmem_limit_bytes: expected at least 1 MiB, got {self.vmem_limit_bytes}")


def default_config(*, seq_len: int, num_blocks: int) -> StudentKernelConfig:
    """Query tiles of 128 rows (at most the query rows rounded up to 16), kv tiles of 512 blocks (at most N rounded
    up to 128), trimmed to their visible prefix. v5p at S = 4096, N = 1024, H_I = 64, d_I = 128, bf16, default ids
    (static estimates of the forward + backward kernels, us; v5p compile of both, s):

        128 x 256 whole   102.1 + 508.0   4.6 s   (the backward MXU-bound: 12.1 us per step, MXU floor 11.7)
        128 x 256 trimmed  95.9 + 483.3   7.2 s   (a trimmed step still pays its dq accumulator update whole)
        256 x 256 trimmed  91.9 + 471.4  15.5 s
        128 x 512 trimmed  89.6 + 456.8  23.2 s   <- default: -10.4%
        256 x 512 trimmed  88.4 + 448.0  47.2 s   (-12.1%; twice the compile for 2 points more)

    Trimmed, every shape computes the same 144 parts of 128 x 128 (the causal triangle at 128-block granularity);
    larger tiles pay fewer per-step accumulator updates, and compile longer (one body per prefix length). The
    backward's resident dq accumulator is [block_q, H_I * d_p] f32 (4 MiB at H_I = 64, d_I = 128)."""
    block_q = min(128, common.round_up(seq_len, 16))
    block_k = min(512, common.round_up(num_blocks, PART_BLOCKS))
    return StudentKernelConfig(block_q=block_q, block_k=block_k)


def _dot(a, b, dims):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _split(x, dtype):
    """f32 x -> the terms fed to the MXU: (x,) for f32 operands, (hi, lo) bf16 with hi + lo = x to ~2^-17."""
    if dtype == jnp.float32:
        return (x,)
    hi = x.astype(dtype)
    return hi, (x - hi.astype(jnp.float32)).astype(dtype)


def _tile(p, nq: int):
    """Grid index p over (batch, query tiles) -> (b, query tile), the tiles zig-zagged so that the two
    TensorCores, which split the leading parallel axis in halves, get equal causal work."""
    return common.index_div(p, nq), common.zigzag(common.index_rem(p, nq), nq)


def _visible_parts(table_ref, skip: "_Skip"):
    """How many leading parts of this grid step's kv tile some query of the query tile may see (0: skip the step):
    from the table, or for one document at positions 0..S-1 from the grid (a part is needed when its first block
    ends by the tile's last query)."""
    (b, i), j = _tile(pl.program_id(0), skip.nq), pl.program_id(1)
    if skip.causal_ratio is None:
        return table_ref[(b * skip.nq + i) * skip.nk + j]
    m, last = skip.causal_ratio, i * skip.block_q + (skip.block_q - 1)
    count = jnp.int32(0)
    for c in range(skip.parts):
        first_end = j * (skip.block_k * m) + (c * skip.part * m + m - 1)
        count = count + jnp.where(first_end <= last, 1, 0).astype(jnp.int32)
    return count


@dataclasses.dataclass(frozen=True)
class _Skip:
    nq: int
    nk: int
    block_q: int
    block_k: int
    causal_ratio: Optional[int]  # m: default ids, the schedule from the grid; None: the scalar-prefetched table
    parts: int = 1  # StudentKernelConfig.parts

    @property
    def part(self) -> int:
        return self.block_k // self.parts

    def causal_parts(self, i: int, j: int) -> int:
        """Visible parts of kv tile j for query tile i with default ids (what `_visible_parts` reads off the grid)."""
        m, last = self.causal_ratio, i * self.block_q + self.block_q - 1
        return sum(1 for c in range(self.parts) if (j * self.block_k + c * self.part) * m + m - 1 <= last)

    def active_steps(self) -> int:
        """(query tile, kv tile) steps that compute, per batch row: counted for the causal schedule; every step for
        the table (data-dependent: an upper bound)."""
        if self.causal_ratio is None:
            return self.nq * self.nk
        return sum(1 for i in range(self.nq) for j in range(self.nk) if self.causal_parts(i, j))

    def active_parts(self) -> int:
        """Parts computed per batch row (the MXU work, in parts of `part` blocks): as `active_steps`."""
        if self.causal_ratio is None:
            return self.nq * self.nk * self.parts
        return sum(self.causal_parts(i, j) for i in range(self.nq) for j in range(self.nk))


def _by_visible_parts(table_ref, skip: "_Skip", body):
    """Runs body(cols) for this step's visible prefix: cols = visible parts x part blocks (0: a skipped step)."""
    visible = _visible_parts(table_ref, skip)
    for count in range(skip.parts + 1):
        pl.when(visible == count)(functools.partial(body, count * skip.part))


def _scores_kernel(table_ref, q_ref, w_ref, k_ref, out_ref, *, num_heads, head_dim, skip):
    def body(cols):
        if cols:
            k = k_ref[:cols]
            w = w_ref[...]
            acc = jnp.zeros((out_ref.shape[0], cols), jnp.float32)
            for h in range(num_heads):
                dots = _dot(q_ref[:, h * head_dim:(h + 1) * head_dim], k, NT)  # [bq, cols]
                acc = acc + w[:, h:h + 1] * jnp.maximum(dots, 0.0)
            out_ref[:, :cols] = acc
        if cols < skip.block_k:  # outside V(t) for every query of the tile: never read
            out_ref[:, cols:] = jnp.zeros((out_ref.shape[0], skip.block_k - cols), out_ref.dtype)

    _by_visible_parts(table_ref, skip, body)


def _grads_kernel(table_ref, q_ref, w_ref, k_ref, g_ref, dq_ref, dw_ref, dk_ref, dq_acc, *, num_heads, head_dim,
                  skip):
    j, nk = pl.program_id(1), skip.nk

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros(dq_acc.shape, dq_acc.dtype)
        dw_ref[...] = jnp.zeros(dw_ref.shape, dw_ref.dtype)

    def body(cols):
        if cols:
            k = k_ref[:cols]
            w = w_ref[...]
            g = g_ref[:, :cols]
            dk = jnp.zeros((cols, dk_ref.shape[1]), jnp.float32)
            for h in range(num_heads):
                lanes = slice(h * head_dim, (h + 1) * head_dim)
                q_h = q_ref[:, lanes]
                dots = _dot(q_h, k, NT)  # [bq, cols]
                positive = dots > 0.0  # ReLU'(0) = 0 (SPEC §8)
                dw_ref[:, h:h + 1] += jnp.sum(jnp.where(positive, g * dots, 0.0), axis=1, keepdims=True)
                terms = _split(jnp.where(positive, g * w[:, h:h + 1], 0.0), k.dtype)
                dq_acc[:, lanes] += sum(_dot(t, k, NN) for t in terms)
                dk = dk + sum(_dot(t, q_h, TN) for t in terms)
            dk_ref[:cols] = dk
        if cols < skip.block_k:  # the cotangent is 0 there: no gradient
            dk_ref[cols:] = jnp.zeros((skip.block_k - cols, dk_ref.shape[1]), dk_ref.dtype)

    _by_visible_parts(table_ref, skip, body)

    @pl.when(j == nk - 1)
    def _():
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg: StudentKernelConfig
    batch: int
    padded_rows: int
    padded_blocks: int
    num_heads: int
    head_dim: int  # d_p
    operand_dtype: object
    interpret: object
    causal_ratio: Optional[int] = None  # see `_Skip`

    @property
    def nq(self):
        return self.padded_rows // self.cfg.block_q

    @property
    def nk(self):
        return self.padded_blocks // self.cfg.block_k

    @property
    def skip(self) -> _Skip:
        return _Skip(self.nq, self.nk, self.cfg.block_q, self.cfg.block_k, self.causal_ratio, self.cfg.parts)


def _specs(st: _Static):
    bq, bk, hd = st.cfg.block_q, st.cfg.block_k, st.num_heads * st.head_dim
    rows = lambda p, j, t: (*_tile(p, st.nq), 0)
    q = pl.BlockSpec((None, bq, hd), rows)
    w = pl.BlockSpec((None, bq, st.num_heads), rows)
    k = pl.BlockSpec((None, bk, st.head_dim), lambda p, j, t: (common.index_div(p, st.nq), j, 0))
    tile = pl.BlockSpec((None, bq, bk), lambda p, j, t: (*_tile(p, st.nq), j))
    return q, w, k, tile


def _pairs_bytes(st: _Static, itemsize: int):
    """(MXU flops of one product over the tile parts that compute, HBM bytes of the inputs read by the grid)."""
    b, s, n, h, d = st.batch, st.padded_rows, st.padded_blocks, st.num_heads, st.head_dim
    flops = 2 * b * st.skip.active_parts() * st.cfg.block_q * st.skip.part * h * d
    read = b * (s * h * d + s * h * 4 + st.nq * n * d) * itemsize
    return flops, read


def _forward(st: _Static, table, q, w, k):
    qs, ws, ks, tile = _specs(st)
    kernel = functools.partial(_scores_kernel, num_heads=st.num_heads, head_dim=st.head_dim, skip=st.skip)
    flops, read = _pairs_bytes(st, jnp.dtype(st.operand_dtype).itemsize)
    return runtime.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((st.batch, st.padded_rows, st.padded_blocks), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(st.batch * st.nq, st.nk),
                                               in_specs=[qs, ws, ks], out_specs=tile),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=st.cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0,
                                      bytes_accessed=read + 4 * st.batch * st.padded_rows * st.padded_blocks),
        interpret=st.interpret,
        name=f"csa_student_scores_bq{st.cfg.block_q}_bk{st.cfg.block_k}",
    )(table, q, w, k)


def _backward(st: _Static, table, q, w, k, g, dq_dtype):
    qs, ws, ks, tile = _specs(st)
    bq, bk, hd = st.cfg.block_q, st.cfg.block_k, st.num_heads * st.head_dim
    kernel = functools.partial(_grads_kernel, num_heads=st.num_heads, head_dim=st.head_dim, skip=st.skip)
    flops, read = _pairs_bytes(st, jnp.dtype(st.operand_dtype).itemsize)
    passes = 1 if st.operand_dtype == jnp.float32 else 2
    b, s, n = st.batch, st.padded_rows, st.padded_blocks
    written = b * (s * hd * jnp.dtype(dq_dtype).itemsize + 4 * s * st.num_heads + 4 * st.nq * n * st.head_dim)
    return runtime.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, s, hd), dq_dtype),
                   jax.ShapeDtypeStruct((b, s, st.num_heads), jnp.float32),
                   jax.ShapeDtypeStruct((b, st.nq, n, st.head_dim), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b * st.nq, st.nk), in_specs=[qs, ws, ks, tile],
            out_specs=(pl.BlockSpec((None, bq, hd), lambda p, j, t: (*_tile(p, st.nq), 0)),
                       pl.BlockSpec((None, bq, st.num_heads), lambda p, j, t: (*_tile(p, st.nq), 0)),
                       pl.BlockSpec((None, None, bk, st.head_dim), lambda p, j, t: (*_tile(p, st.nq), j, 0))),
            scratch_shapes=[pltpu.VMEM((bq, hd), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=st.cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=(1 + 2 * passes) * flops, transcendentals=0,
                                      bytes_accessed=read + 4 * b * s * n + written),
        interpret=st.interpret,
        name=f"csa_student_grads_bq{bq}_bk{bk}",
    )(table, q, w, k, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scores(st: _Static, table, q, w, k, k_operand):
    """k: f32 [B, N_p, d_p], the differentiable keys (only their cotangent is used here); k_operand: the same values
    in the operand dtype (`Keys`: cast once by the caller, outside any scan over query chunks)."""
    del k
    return _forward(st, table, q.astype(st.operand_dtype), w, k_operand)


def _scores_fwd(st, table, q, w, k, k_operand):
    return _scores(st, table, q, w, k, k_operand), (table, q, w, k_operand)


def _scores_bwd(st, residuals, g):
    table, q, w, k_operand = residuals
    dq, dw, dk_parts = _backward(st, table, q.astype(st.operand_dtype), w, k_operand, g, q.dtype)
    dk = dk_parts[:, 0] if st.nq == 1 else jnp.sum(dk_parts, axis=1)
    return None, dq, dw, dk, None


_scores.defvjp(_scores_fwd, _scores_bwd)


def operand_dtype(q_dtype, k_dtype):
    """bf16 when the indexer's queries and keys both are (exact products), else f32."""
    return jnp.bfloat16 if q_dtype == jnp.bfloat16 and k_dtype == jnp.bfloat16 else jnp.float32


def skip_table(positions, block_end, padded_rows: int, padded_blocks: int, cfg: StudentKernelConfig):
    """int32 [B * nq * nk]: per (query tile, kv tile) the number of leading parts of the kv tile (cfg.parts of them)
    up to the last one some query of the tile may see (a part's earliest block end <= the tile's latest position;
    segments are not consulted, so the table is a superset); 0: the step is skipped.
    positions int32 [B, S]; block_end int32 [B, N] (masks.block_keys)."""
    b, s = positions.shape
    n = block_end.shape[1]
    low, high = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, padded_rows - s)), constant_values=low)
    end = jnp.pad(block_end.astype(jnp.int32), ((0, 0), (0, padded_blocks - n)), constant_values=high)
    latest = jnp.max(pos.reshape(b, -1, cfg.block_q), axis=2)  # [B, nq]
    earliest = jnp.min(end.reshape(b, -1, cfg.block_k // cfg.parts), axis=2)  # [B, nk * parts]
    seen = (earliest[:, None, :] <= latest[:, :, None]).reshape(b, latest.shape[1], -1, cfg.parts)
    ordinal = jnp.arange(1, cfg.parts + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(seen, ordinal, 0), axis=3).astype(jnp.int32).reshape(-1)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["padded", "operand"],
                   meta_fields=["num_blocks", "head_dim"])
@dataclasses.dataclass(frozen=True)
class Keys:
    """index_k prepared for the kernels: `padded` f32 [B, N_p, d_p] (the differentiable side: an exact upcast, so
    its cotangent sums over query tiles and chunks in f32) and `operand` (the same values in the MXU operand
    dtype). A caller that scores many query chunks against one index_k prepares them once (`prepare_keys`)."""

    padded: jax.Array
    operand: jax.Array
    num_blocks: int  # N
    head_dim: int  # d_I


def prepare_keys(index_k, cfg: StudentKernelConfig, operands) -> Keys:
    """index_k float [B, N, d_I] -> `Keys` for kv tiles of cfg.block_k blocks; operands: `operand_dtype`."""
    _, n, d = index_k.shape
    padded = jnp.pad(index_k.astype(jnp.float32),
                     ((0, 0), (0, common.round_up(n, cfg.block_k) - n), (0, common.round_up(d, 128) - d)))
    return Keys(padded, padded.astype(operands), n, d)


def flat_queries(index_q, cfg: StudentKernelConfig):
    """index_q float [B, S, H_I, d_I] -> [B, S_p, H_I * d_p], the kernels' layout (rows padded to block_q, d_I
    zero-padded to 128 lanes, index_q's dtype). From a [B, S, H_I, d_I] parameter this is a relayout copy in HBM
    (the tiles of the last two dims change); a projection that produces index_q can be laid out for it."""
    b, s, h, d = index_q.shape
    s_p, d_p = common.round_up(s, cfg.block_q), common.round_up(d, 128)
    q = index_q
    if s_p != s or d_p != d:
        q = jnp.pad(q, ((0, 0), (0, s_p - s), (0, 0), (0, d_p - d)))
    return q.reshape(b, s_p, h * d_p)


def scores(index_q, index_k, index_weights, positions, block_end, cfg: StudentKernelConfig | None = None,
           causal_ratio: Optional[int] = None):
    """I, f32 [B, S, N], every entry a query may see computed (others 0 or the exact score); differentiable wrt
    the three indexer tensors (exact zeros where the cotangent of I is 0).

    index_q float [B, S, H_I, d_I]; index_k float [B, N, d_I], or `Keys` prepared with this cfg (then its padded f32 keys get the cotangent); index_weights float [B, S, H_I]; positions int [B, S] (the queries' positions);
    block_end int32 [B, N] (`masks.block_keys`: a block's last position, or INVALID_BLOCK_END). causal_ratio: m
    when the ids are the default (one document, positions 0..S-1, block s ending at s m + m - 1): the tiles to
    skip then come from the grid (no table; the static estimator sees the trip counts)."""
    b, s, h, d = index_q.shape
    n = index_k.num_blocks if isinstance(index_k, Keys) else index_k.shape[1]
    if cfg is None:
        cfg = default_config(seq_len=s, num_blocks=n)
    keys = index_k if isinstance(index_k, Keys) else prepare_keys(
        index_k, cfg, operand_dtype(index_q.dtype, index_k.dtype))
    s_p, (n_p, d_p) = common.round_up(s, cfg.block_q), keys.padded.shape[1:]
    if n_p % cfg.block_k or keys.head_dim != d:
        raise ValueError(f"index_k: Keys of shape {keys.padded.shape} (d_I={keys.head_dim}) were prepared for "
                         f"other tiles or widths; expected kv tiles of block_k={cfg.block_k}, d_I={d}")
    if b * (s_p // cfg.block_q) * (n_p // cfg.block_k) > MAX_TABLE_ENTRIES:
        raise ValueError(f"index_q: the student kernels' skip table for S={s}, N={n} exceeds SMEM; take the "
                         f"loss over query chunks (fused_student) or raise block_q / block_k")
    st = _Static(cfg, b, s_p, n_p, h, d_p, keys.operand.dtype, runtime.interpret_mode(), causal_ratio)
    # index_q keeps its dtype (its cotangent is final: each query row's dq is produced once, rounded once from
    # the kernel's f32 accumulator); index_weights enters as f32 (an exact upcast of a small array).
    q = flat_queries(index_q, cfg)
    w = jnp.pad(index_weights.astype(jnp.float32), ((0, 0), (0, s_p - s), (0, 0)))
    table = skip_table(positions, block_end, s_p, n_p, cfg)
    return _scores(st, table, q, w, keys.padded, keys.operand)[:, :s, :n]
