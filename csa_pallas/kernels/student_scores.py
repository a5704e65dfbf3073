"""The lightning indexer's scores and their three gradients as Pallas kernels (SPEC §8), dense mode.

    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s])        q [S, H_I, d_I], k [N, d_I], w [S, H_I]

Layout: index_q enters in its own row order, [B * S_p * H_p, d_p] (`row_queries`: a free reshape of
[B, S, H_I, d_I], so no relayout copy of index_q or of its gradient exists; the [B, S, H_I * d_I] lane layout this
replaced cost two, 48.5 us each at S = 4096, H_I = 64, d_I = 128). A query tile is a block of bq * H_p rows; one
group of heads is a sublane-strided load of 32-bit rows (`_head_group`): f32 one head per row, bf16 two heads
(2i, 2i + 1) per 32-bit word, reinterpreted in registers as [2 bq, d_p] bf16 rows (query t, head 2i + e) at row
2t + e, which the MXU takes as one product of 2 bq rows (no unpacking). Everything per query row follows that
interleaving: the weights cross in XLA as [B, pack * S_p, H_p / pack] (`_interleave`, transposed by autodiff), the
forward's two partial sums per query are added once per step (two stride-2 loads), the backward doubles the
cotangent rows once per step.

Forward (`_scores_kernel`, grid (B x query tiles zig-zagged, kv tiles)): per tile, one [pack bq, d_I] x [d_I, bk]
product per head group, its ReLU and the weighted sum in VMEM; the [bq, H_I, bk] terms never leave the kernel.
Backward (`_grads_kernel`, same grid, kv tiles innermost): from the scores' cotangent g [bq, bk] the kernel
recomputes each group's products and forms G_j = g * w_j * [q_j . k > 0], then
    dq_j += G_j k',   dw_j += rowsum([g != 0] g * ReLU(q_j . k)),   dk += G_j^T q_j'
(k', q_j', and the weights in G_j: non-finite entries as 0; q_j . k from the inputs as given: the rules with which
the XLA student agrees on non-finite inputs, `student._exact_chunk_scores`);
dq ([H_p / pack, pack bq, d_p] f32) and dw stay resident over the kv tiles; at the last kv tile dq goes back into
the row order by strided stores of 32-bit rows (bf16: rounded, then packed in pairs into a u32 buffer, which is
one bf16 block). dk is written per (query tile, kv tile) and summed over the query tiles in XLA
([B, S/bq, N, d_I] f32: the kv-side accumulation would need the query tiles innermost and a second recomputation
of the products).

Numerics ("exact", as `student.scores`): bf16 queries and keys enter the MXU as bf16 (products exact in f32,
accumulation f32); the backward splits each f32 G_j into bf16 hi + lo for two passes (~2^-17 relative), so the
gradients match float64 to ~1e-6. Any other dtype runs as f32 at HIGHEST precision (bf16 queries against f32
keys are exact f32 operands).

Tiles no query of the query tile can see (every block of the kv tile ends after the tile's last position) are
skipped: their scores are written as 0 (outside V(t), never read) and contribute no gradient, which is exact
because the loss's cotangent is 0 outside V(t). With `trim_kv_tile` a computing tile is also trimmed to its
visible prefix in 128-block parts (the causal diagonal's tiles: at S = 4096 with 128 x 256 tiles, 16 of the 80
computing steps need only their first half): the products cover that prefix, the rest is written as 0. The
schedule is scalar-prefetched as [B * nq * nk] int32 visible parts (0 = skip), or for default ids read off the
grid.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, runtime
from csa_pallas.kernels.common import NN, NT, TN
from csa_pallas.kernels.student_config import PART_BLOCKS, StudentKernelConfig, default_config  # noqa: F401
from csa_pallas.kernels.student_schedule import MAX_TABLE_ENTRIES, Skip, by_visible_parts, query_tile, skip_table


def _head_group(q_ref, i: int, pack: int, groups: int, rows: int, operand):
    """Head word-group i of the tile's queries from the row-order block [rows * H_p, d_p] (query t's heads on rows
    t H_p .. t H_p + H_p - 1): [pack * rows, d_p] in the operand dtype, row pack * t + e = (query t, head
    pack * i + e). Mosaic strides 32-bit rows only, so a bf16 block is read as u32 rows (heads 2i and 2i + 1 of one
    query share a word) and reinterpreted in registers as bf16 rows: no unpacking, the MXU takes both heads as one
    product of 2 * rows rows."""
    if pack == 1:
        return q_ref[pl.ds(i, rows, stride=groups), :].astype(operand)
    words = q_ref.bitcast(jnp.uint32)[pl.ds(i, rows, stride=groups), :]
    return pltpu.bitcast(words, q_ref.dtype).astype(operand)


def _scores_kernel(table_ref, q_ref, w_ref, k_ref, out_ref, *scratch, groups, pack, skip):
    rows = out_ref.shape[0]

    def body(cols):
        if cols:
            k = k_ref[:cols]
            w = w_ref[...]  # [pack * rows, groups], interleaved as the products' rows
            acc = jnp.zeros((pack * rows, cols), jnp.float32)
            for i in range(groups):
                q_i = _head_group(q_ref, i, pack, groups, rows, k.dtype)
                dots = common.exact_dot(q_i, k, NT)  # [pack * rows, cols]
                acc = acc + w[:, i:i + 1] * jnp.maximum(dots, 0.0)
            if pack == 1:
                out_ref[:, :cols] = acc
            else:  # query t's two partial sums are rows 2t and 2t + 1
                # one [2 * rows, 128] buffer per part: Mosaic strides the rows of whole 128-lane memrefs only
                for c in range(cols // PART_BLOCKS):
                    lanes, fold = slice(c * PART_BLOCKS, (c + 1) * PART_BLOCKS), scratch[c]
                    fold[...] = acc[:, lanes]
                    out_ref[:, lanes] = fold[pl.ds(0, rows, stride=2), :] + fold[pl.ds(1, rows, stride=2), :]
        if cols < skip.block_k:  # outside V(t) for every query of the tile: never read
            out_ref[:, cols:] = jnp.zeros((rows, skip.block_k - cols), out_ref.dtype)

    by_visible_parts(table_ref, skip, body)


def _grads_kernel(table_ref, q_ref, w_ref, k_ref, g_ref, dq_ref, dw_ref, dk_ref, dq_acc, *scratch, groups, pack,
                  skip):
    j, nk, rows = pl.program_id(1), skip.nk, g_ref.shape[0]

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros(dq_acc.shape, dq_acc.dtype)
        dw_ref[...] = jnp.zeros(dw_ref.shape, dw_ref.dtype)

    def body(cols):
        if cols:
            k = k_ref[:cols]
            w = w_ref[...]
            if pack == 1:
                g = g_ref[:, :cols]
            else:  # each query's cotangent row twice, as the products' rows (per-part buffers, as the forward)
                parts = range(cols // PART_BLOCKS)
                for c in parts:
                    for e in range(pack):
                        scratch[c][pl.ds(e, rows, stride=pack), :] = g_ref[:, c * PART_BLOCKS:(c + 1) * PART_BLOCKS]
                g = jnp.concatenate([scratch[c][...] for c in parts], axis=1) if len(parts) > 1 else scratch[0][...]
            dk = jnp.zeros((cols, dk_ref.shape[1]), jnp.float32)
            active = g != 0.0  # a term with a zero cotangent is 0, even against a non-finite score (SPEC §6)
            k_products = common.finite_or_zero(k)
            for i in range(groups):
                q_i = _head_group(q_ref, i, pack, groups, rows, k.dtype)
                dots = common.exact_dot(q_i, k, NT)  # [pack * rows, cols]
                positive = dots > 0.0  # ReLU'(0) = 0 (SPEC §8)
                dw_ref[:, i:i + 1] += jnp.sum(jnp.where(active, g * jnp.maximum(dots, 0.0), 0.0), axis=1,
                                              keepdims=True)
                terms = common.hi_lo_terms(jnp.where(positive, g * w[:, i:i + 1], 0.0), k.dtype)
                dq_acc[i] += sum(common.exact_dot(t, k_products, NN) for t in terms)
                q_products = common.finite_or_zero(q_i)
                dk = dk + sum(common.exact_dot(t, q_products, TN) for t in terms)
            dk_ref[:cols] = dk
        if cols < skip.block_k:  # the cotangent is 0 there: no gradient
            dk_ref[cols:] = jnp.zeros((skip.block_k - cols, dk_ref.shape[1]), dk_ref.dtype)

    by_visible_parts(table_ref, skip, body)

    @pl.when(j == nk - 1)
    def _():  # into q's row order: strided stores of 32-bit rows (bf16 pairs packed back into their words)
        if pack == 1:
            for i in range(groups):
                dq_ref[pl.ds(i, rows, stride=groups), :] = dq_acc[i].astype(dq_ref.dtype)
            return
        words = scratch[-1]
        for i in range(groups):
            words[pl.ds(i, rows, stride=groups), :] = pltpu.bitcast(dq_acc[i].astype(dq_ref.dtype), jnp.uint32)
        dq_ref[...] = pltpu.bitcast(words[...], dq_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg: StudentKernelConfig
    batch: int
    padded_rows: int
    padded_blocks: int
    num_heads: int  # H_p, a multiple of pack (`row_queries`)
    head_dim: int  # d_p
    query_dtype: object  # bf16 or f32 (`row_queries`)
    operand_dtype: object
    interpret: object
    causal_ratio: Optional[int] = None  # see `Skip`

    @property
    def pack(self):
        """Heads per 32-bit word of a query row: 2 for bf16, 1 for f32."""
        return 4 // jnp.dtype(self.query_dtype).itemsize

    @property
    def groups(self):
        return self.num_heads // self.pack

    @property
    def nq(self):
        return self.padded_rows // self.cfg.block_q

    @property
    def nk(self):
        return self.padded_blocks // self.cfg.block_k

    @property
    def skip(self) -> Skip:
        return Skip(self.nq, self.nk, self.cfg.block_q, self.cfg.block_k, self.causal_ratio, self.cfg.parts)


def _specs(st: _Static):
    bq, bk, rows = st.cfg.block_q, st.cfg.block_k, lambda p, j, t: (*query_tile(p, st.nq), 0)
    w = pl.BlockSpec((None, st.pack * bq, st.groups), rows)
    k = pl.BlockSpec((None, bk, st.head_dim), lambda p, j, t: (common.index_div(p, st.nq), j, 0))
    tile = pl.BlockSpec((None, bq, bk), lambda p, j, t: (*query_tile(p, st.nq), j))
    return _query_rows_spec(st), w, k, tile


def _query_rows_spec(st: _Static):
    """The query tile's rows of the row-order [B * S_p * H_p, d_p] array (index_q, or dq)."""
    def index(p, j, t):
        b, i = query_tile(p, st.nq)
        return b * st.nq + i, 0
    return pl.BlockSpec((st.cfg.block_q * st.num_heads, st.head_dim), index)


def _pairs_bytes(st: _Static):
    """(MXU flops of one product over the tile parts that compute, HBM bytes of the inputs read by the grid)."""
    b, s, n, h, d = st.batch, st.padded_rows, st.padded_blocks, st.num_heads, st.head_dim
    flops = 2 * b * st.skip.active_parts() * st.cfg.block_q * st.skip.part * h * d
    read = b * (s * h * (d * jnp.dtype(st.query_dtype).itemsize + 4)
                + st.nq * n * d * jnp.dtype(st.operand_dtype).itemsize)
    return flops, read


def _interleave(w, st: _Static):
    """f32 [B, S_p, H_p] -> [B, pack * S_p, groups]: row pack * t + e, column i = head pack * i + e of query t
    (the rows of the kernels' products). Done once, before the custom_vjp: autodiff transposes it for dw."""
    b, s, _ = w.shape
    return jnp.swapaxes(w.reshape(b, s, st.groups, st.pack), 2, 3).reshape(b, st.pack * s, st.groups)


def _row_pair_buffers(st: _Static):
    """f32 [2 * block_q, 128] per 128-block part of a kv tile (bf16 queries): the forward's two partial sums per
    query, the backward's cotangent rows doubled."""
    if st.pack == 1:
        return []
    return [pltpu.VMEM((st.pack * st.cfg.block_q, PART_BLOCKS), jnp.float32)] * (st.cfg.block_k // PART_BLOCKS)


def _forward(st: _Static, table, q, w, k):
    qs, ws, ks, tile = _specs(st)
    kernel = functools.partial(_scores_kernel, groups=st.groups, pack=st.pack, skip=st.skip)
    flops, read = _pairs_bytes(st)
    bq, bk = st.cfg.block_q, st.cfg.block_k
    return runtime.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((st.batch, st.padded_rows, st.padded_blocks), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(st.batch * st.nq, st.nk), in_specs=[qs, ws, ks], out_specs=tile,
            scratch_shapes=_row_pair_buffers(st)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=st.cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0,
                                      bytes_accessed=read + 4 * st.batch * st.padded_rows * st.padded_blocks),
        interpret=st.interpret,
        name=f"csa_student_scores_bq{bq}_bk{bk}",
    )(table, q, w, k)


def _backward(st: _Static, table, q, w, k, g):
    """(dq in q's row order and dtype, dw f32 interleaved as w, dk per query tile f32 [B, nq, N_p, d_p])."""
    qs, ws, ks, tile = _specs(st)
    bq, bk, h, d = st.cfg.block_q, st.cfg.block_k, st.num_heads, st.head_dim
    kernel = functools.partial(_grads_kernel, groups=st.groups, pack=st.pack, skip=st.skip)
    flops, read = _pairs_bytes(st)
    passes = 1 if st.operand_dtype == jnp.float32 else 2
    b, s, n = st.batch, st.padded_rows, st.padded_blocks
    written = b * (s * h * d * q.dtype.itemsize + 4 * s * h + 4 * st.nq * n * d)
    scratch = [pltpu.VMEM((st.groups, st.pack * bq, d), jnp.float32)]
    if st.pack > 1:  # the interleaved cotangent rows; dq's packed words
        scratch += _row_pair_buffers(st) + [pltpu.VMEM((bq * st.groups, d), jnp.uint32)]
    dq, dw, dk = runtime.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, st.pack * s, st.groups), jnp.float32),
                   jax.ShapeDtypeStruct((b, st.nq, n, d), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b * st.nq, st.nk), in_specs=[qs, ws, ks, tile],
            out_specs=(qs, ws, pl.BlockSpec((None, None, bk, d), lambda p, j, t: (*query_tile(p, st.nq), j, 0))),
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=st.cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=(1 + 2 * passes) * flops, transcendentals=0,
                                      bytes_accessed=read + 4 * b * s * n + written),
        interpret=st.interpret,
        name=f"csa_student_grads_bq{bq}_bk{bk}",
    )(table, q, w, k, g)
    return dq, dw, dk


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scores(st: _Static, table, q, w, k, k_operand):
    """q: `row_queries`; w: f32 [B, pack * S_p, H_p / pack] (`_interleave`); k: f32 [B, N_p, d_p], the
    differentiable keys (only their cotangent is used here); k_operand: the same values in the operand dtype
    (`Keys`: cast once by the caller, outside any scan over query chunks)."""
    del k
    return _forward(st, table, q, w, k_operand)


def _scores_fwd(st, table, q, w, k, k_operand):
    return _scores(st, table, q, w, k, k_operand), (table, q, w, k_operand)


def _scores_bwd(st, residuals, g):
    table, q, w, k_operand = residuals
    # The weights enter the backward's products only, so their non-finite entries become 0 here (one small pass);
    # index_q's and the keys' do in the kernel, where the recomputed scores still see the originals.
    dq, dw, dk_parts = _backward(st, table, q, common.finite_or_zero(w), k_operand, g)
    dk = dk_parts[:, 0] if st.nq == 1 else jnp.sum(dk_parts, axis=1)
    return None, dq, dw, dk, None


_scores.defvjp(_scores_fwd, _scores_bwd)


def operand_dtype(q_dtype, k_dtype):
    """bf16 when the indexer's queries and keys both are (exact products), else f32."""
    return jnp.bfloat16 if q_dtype == jnp.bfloat16 and k_dtype == jnp.bfloat16 else jnp.float32


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


def row_queries(index_q, cfg: StudentKernelConfig):
    """index_q float [B, S, H_I, d_I] -> [B * S_p * H_p, d_p], the kernels' row order: each query's heads on
    consecutive rows, as index_q lies in HBM, so the reshape is free (no relayout copy) unless something is padded
    (rows to block_q, d_I to 128 lanes, H_I to even for bf16, whose heads are read in 32-bit pairs; zeros). bf16
    stays bf16; any other dtype enters as f32."""
    b, s, h, d = index_q.shape
    dtype = jnp.bfloat16 if index_q.dtype == jnp.bfloat16 else jnp.float32
    s_p, h_p, d_p = common.round_up(s, cfg.block_q), padded_heads(h, dtype), common.round_up(d, 128)
    q = index_q.astype(dtype)
    if (s_p, h_p, d_p) != (s, h, d):
        q = jnp.pad(q, ((0, 0), (0, s_p - s), (0, h_p - h), (0, d_p - d)))
    return q.reshape(b * s_p * h_p, d_p)


def padded_heads(num_heads: int, dtype) -> int:
    """H_p: the indexer heads the kernels walk, a whole number of 32-bit words per query row."""
    return common.round_up(num_heads, 4 // jnp.dtype(dtype).itemsize)


def scores(index_q, index_k, index_weights, positions, block_end, cfg: StudentKernelConfig | None = None,
           causal_ratio: Optional[int] = None):
    """I, f32 [B, S, N], every entry a query may see computed (others 0 or the exact score); differentiable wrt
    the three indexer tensors (exact zeros where the cotangent of I is 0).

    index_q float [B, S, H_I, d_I]; index_k float [B, N, d_I], or `Keys` prepared with this cfg (then its padded
    f32 keys get the cotangent); index_weights float [B, S, H_I]; positions int [B, S] (the queries' positions);
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
    # bf16 index_q stays bf16 (its cotangent is final: each query row's dq is produced once, rounded once from the
    # kernel's f32 accumulator); index_weights enters as f32 (an exact upcast of a small array).
    q = row_queries(index_q, cfg)
    h_p = padded_heads(h, q.dtype)
    st = _Static(cfg, b, s_p, n_p, h_p, d_p, q.dtype, keys.operand.dtype, runtime.interpret_mode(), causal_ratio)
    w = jnp.pad(index_weights.astype(jnp.float32), ((0, 0), (0, s_p - s), (0, h_p - h)))
    table = skip_table(positions, block_end, s_p, n_p, cfg)
    return _scores(st, table, q, _interleave(w, st), keys.padded, keys.operand)[:, :s, :n]
