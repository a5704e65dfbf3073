"""Window log-sum-exp (the window part of u, SPEC §3) as a Pallas TPU kernel.

u[t, h] = logaddexp(logsumexp_{j in Win(t)} tau q[t,h].window_kv[j], sinks[h]) (without sinks: the lse alone).

Grid (B*nq "parallel", H/hc "arbitrary", band steps "arbitrary"): a query tile [q0, q0+bq) only looks at the key
tiles overlapping [q0-W+1, q0+bq-1], a static band of at most ceil((bq+W-1)/bk)+1 tiles (2 for bq = bk = W = 128),
so the cost is O(S*(W+bq)*H*D) and no [S, S_kv] anything exists; a band of up to MAX_TILES_PER_STEP tiles is one
grid step. The exact window/segment rule is applied inside, from iota positions when the ids are the defaults, else
from metadata compares. Scores are in base 2 (exp2 is the hardware exponential).

Contract of the band (checked by the wrapper where it can be): key j of Win(t) lies in [t-W+1, t], i.e. the key
sequence is the query sequence (S_kv == S) and positions strictly increase inside each document, as in MaxText
packing. Other layouts must use implementation="xla" or pass `noncompressed_lse`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, runtime

MiB = common.MiB
LOG2E = common.LOG2E
LN2 = math.log(2.0)
MAX_TILES_PER_STEP = 2
MAX_ROWS = 8192


@dataclasses.dataclass(frozen=True)
class WindowConfig:
    """block_q queries x block_k keys per step (block_k a multiple of 128, or the whole padded S when small);
    head_chunk heads per step."""

    block_q: int
    block_k: int
    head_chunk: int
    vmem_limit_bytes: int

    def __post_init__(self):
        if self.block_q < 16 or self.block_q % 16:
            raise ValueError(f"block_q: expected a positive multiple of 16, got {self.block_q}")
        if self.block_k < 16 or (self.block_k > 128 and self.block_k % 128) or self.block_k % 16:
            raise ValueError(f"block_k: expected a multiple of 128 (or of 16 when <= 128), got {self.block_k}")


def padded_len(seq_len: int, cfg: WindowConfig) -> int:
    return common.round_up(max(seq_len, 1), max(cfg.block_q, cfg.block_k))


def band_tiles(cfg: WindowConfig, window_size: int, num_tiles: int, num_q_tiles: int, key_offset: int = 0) -> int:
    """Key tiles the widest query tile overlaps (exact over the static tile positions; e.g. 2 for bq=bk=W=128)."""
    bq, bk = cfg.block_q, cfg.block_k
    widest = 0
    for qi in range(num_q_tiles):
        first = max(qi * bq + key_offset - (window_size - 1), 0) // bk
        last = min((qi * bq + bq - 1 + key_offset) // bk, num_tiles - 1)
        widest = max(widest, last - first + 1)
    return widest


def vmem_bytes(cfg: WindowConfig, *, num_heads: int, head_dim: int, dtype) -> int:
    """Upper estimate of the kernel's VMEM use (bq 128, hc 64, D 512, bf16: 44 MiB; Mosaic allocated 28 MiB)."""
    isz = jnp.dtype(dtype).itemsize
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    g = common.head_group(num_heads, hc, dtype)
    layout = common.row_layout(num_heads, hc, bq, dtype)
    rows = hc * bq
    tiles = MAX_TILES_PER_STEP  # upper bound: the band is not known here
    blocks = 2 * (bq * common.round_up(g, 16) * head_dim * isz + tiles * bk * head_dim * isz + bq * common.LANES * 4
                  + tiles * common.SUBLANES * max(bk, 128) * 4 + 2 * common.round_up(hc, 8) * max(bq, 128) * 4)
    scratch = (0 if layout.token_major else rows * head_dim * isz) + 2 * rows * 128 * 4
    # f32 score-sized temporaries (scores, masked, transposed / exponentials) plus the column conversions.
    temporaries = max(4, 2 * tiles + 1) * rows * max(bk, 128) * 4 + 2 * hc * bq * max(bq, 128) * 4
    return blocks + scratch + temporaries


def default_config(*, num_heads: int, head_dim: int, seq_len: int, dtype, head_chunk=None,
                   vmem_budget: int = 54 * MiB) -> WindowConfig:
    small = common.round_up(max(seq_len, 1), 16)
    bq = 128 if small > 128 else small
    bk = 128 if small > 128 else small
    # The most heads per step that fit: fewer grid steps, each with its fixed pipeline cost (MAX_ROWS rows: every
    # head of the V4-Flash shape, 64 x 128 queries, at the MXU bound in the v5p estimate).
    chunks = [head_chunk] if head_chunk is not None else [
        d for d in range(num_heads, 0, -1) if num_heads % d == 0 and d * bq <= MAX_ROWS]
    for head_chunk in chunks:
        cfg = WindowConfig(bq, bk, head_chunk, 0)
        need = vmem_bytes(cfg, num_heads=num_heads, head_dim=head_dim, dtype=dtype)
        if need <= vmem_budget:
            break
    if need > vmem_budget and bq > 16:
        cfg = WindowConfig(bq // 2 if bq > 16 else bq, bk, head_chunk, 0)
        need = vmem_bytes(cfg, num_heads=num_heads, head_dim=head_dim, dtype=dtype)
    return dataclasses.replace(cfg, vmem_limit_bytes=min(max(int(need * 1.25) + 4 * MiB, 32 * MiB), 64 * MiB))


def _kernel(q_ref, *refs, nq, num_kv_tiles, tiles, layout, block_k, group, window_size, scale, key_offset, seq_len,
            lane_dense, with_sinks):
    bq, bk, hc = layout.block_q, block_k, layout.head_chunk
    iota_mask = seq_len is not None
    kv_refs, refs = refs[:tiles], refs[tiles:]
    if not iota_mask:
        qmeta_ref, kmeta_refs, refs = refs[0], refs[1:tiles + 1], refs[tiles + 1:]
    sink_ref, *refs = refs if with_sinks else (None, *refs)
    out_ref, m_ref, l_ref, *rows = refs
    rows_ref = rows[0] if rows else None
    p = pl.program_id(0)
    c = pl.program_id(1)
    k = pl.program_id(2)
    qi = common.zigzag(common.index_rem(p, nq), nq)
    first, last = _band(qi, bq, bk, window_size, num_kv_tiles, key_offset)

    if not layout.token_major:
        @pl.when(k == 0)
        def _():
            common.gather_head_rows(q_ref, rows_ref, c, head_chunk=hc, group=group, block_q=bq)

    def scores(i):
        """Masked scores of the step's i-th tile in base 2 (scale * log2(e) in one multiply), f32 [rows, bk]."""
        tile = first + k * tiles + i  # unclamped: a tile past `last` repeats `last` and must be masked out whole
        rows = q_ref[...].reshape(layout.rows, -1) if layout.token_major else rows_ref[...]
        kv = common.nan_filled_rows(kv_refs[i][...])  # a key holding a non-finite value makes its scores NaN
        z = lax.dot_general(rows, kv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        z = z * (scale * LOG2E)
        if iota_mask:
            # Default ids: query t sees keys (t - W, t] that exist; positions are iotas against static offsets.
            delta = (qi * bq - tile * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
                     - lax.broadcasted_iota(jnp.int32, (bq, bk), 1))
            key = tile * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            inside = (delta >= 0) & (delta < window_size) & (key < seq_len)
        else:
            kmeta_ref = kmeta_refs[i]
            delta = qmeta_ref[:, 1:2] - kmeta_ref[1:2, :]
            inside = ((kmeta_ref[0:1, :] == qmeta_ref[:, 0:1]) & (delta >= 0) & (delta < window_size)
                      & (kmeta_ref[2:3, :] != 0) & (tile <= last))
        z = jnp.where(layout.expand_mask(inside), z.reshape(*layout.view, bk), -jnp.inf)
        return z.reshape(layout.rows, bk)

    def update(first_step):
        if lane_dense:
            # Keys go to sublanes (XLU transposes of 128x128 blocks): the reductions over keys become elementwise
            # across vregs, and the statistics of 128 rows fill one lane-dense vreg row.
            zt = [jnp.swapaxes(scores(i).reshape(layout.rows // 128, 128, bk), 1, 2) for i in range(tiles)]
            m_new = m_ref[...] if not first_step else common.STAT_FLOOR
            for z in zt:
                m_new = jnp.maximum(m_new, jnp.max(z, axis=1))
            total = None if first_step else l_ref[...] * jnp.exp2(m_ref[...] - m_new)
            for z in zt:
                part = jnp.sum(jnp.exp2(z - m_new[:, None, :]), axis=1)
                total = part if total is None else total + part
            m_ref[...] = m_new
            l_ref[...] = total
        else:
            for i in range(tiles):
                common.online_lse_update(m_ref, l_ref, scores(i).reshape(*layout.view, bk), min(common.LANES, bk),
                                         first=first_step and i == 0, base2=True)

    # The first step writes the statistics; it is always active (the band's first tile holds key t - W + 1 or 0).
    pl.when(k == 0)(functools.partial(update, True))
    pl.when((k > 0) & (first + k * tiles <= last))(functools.partial(update, False))

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        m, total = m_ref[...], l_ref[...]
        if not lane_dense:  # per-lane statistics [*view, lanes] -> columns -> the stats block
            row_max = jnp.max(m, axis=-1, keepdims=True)
            total = layout.column_to_block(jnp.sum(total * jnp.exp2(m - row_max), axis=-1, keepdims=True))
            m = layout.column_to_block(row_max)
        # An empty window is -inf; a NaN score stays NaN.
        lse = m + jnp.log2(jnp.where(total == 0, 1.0, total))
        out = jnp.where(total == 0, -jnp.inf, lse * LN2)
        if with_sinks:  # u = logaddexp(lse, sink) in nats: a dominant sink comes out exactly (base 2 and back would
            # cost ~1e-7 of its size); a +-inf sink is a limit, a NaN sink a NaN.
            sink = sink_ref[...]
            top = jnp.maximum(out, sink)
            low = jnp.minimum(out, sink)
            finite_top = jnp.where(jnp.abs(top) == jnp.inf, 0.0, top)
            out = jnp.where(top == -jnp.inf, -jnp.inf, jnp.where(top == jnp.inf, jnp.inf,
                                                                   top + jnp.log(1.0 + jnp.exp(low - finite_top))))
        if lane_dense:  # rows -> the [hc, bq] block of [B, H, S_p]
            out = out.reshape(bq, hc).T if layout.token_major else out.reshape(hc, bq)
        out_ref[...] = out


def _band(qi, bq, bk, window_size, num_kv_tiles, key_offset):
    first = common.index_div(jnp.maximum(qi * bq + key_offset - (window_size - 1), 0), bk)
    last = jnp.minimum(common.index_div(qi * bq + bq - 1 + key_offset, bk), num_kv_tiles - 1)
    return first, last


def _hbm_bytes(q, window_kv, *, bk: int, nq: int, nh: int, band: int, tiles: int, ids: bool, sinks: bool) -> int:
    """HBM bytes a launch moves: q once; per (query tile, head chunk) its band's kv tiles (steps x tiles per step,
    an upper bound: the band is shorter near the start) with their int32 [8, bk] metadata when the masks read
    the ids, plus qmeta once per query tile; the sinks' rows per (query tile, head chunk); the f32 [B, S_p, H]
    result."""
    b, s_p, h, d = q.shape
    fetches = b * nq * nh * common.cdiv(band, tiles) * tiles
    moved = q.size * q.dtype.itemsize + fetches * bk * d * window_kv.dtype.itemsize + b * s_p * h * 4
    if ids:
        moved += common.ids_metadata_bytes(b * s_p, fetches, bk)
    if sinks:
        moved += b * s_p * h * 4
    return moved


def tiles_per_step(band: int) -> int:
    """Key tiles one grid step computes: the whole band when it is short (fewer grid steps, each with its fixed
    pipeline cost), else one (the step's scores stay small in VMEM)."""
    return band if band <= MAX_TILES_PER_STEP else 1


def window_lse_pallas(q, window_kv, qmeta, wmeta, sinks=None, *, cfg: WindowConfig, window_size: int, scale: float,
                      key_offset: int = 0, seq_len=None, interpret=False):
    """Window log-sum-exp per (query, head), with the sinks folded in when given.

    Args:
      q: [B, S_p, H, D]; window_kv: [B, S_kv_p, D] (same dtype); S_p = `padded_len(S, cfg)`, S_kv_p a multiple
        of cfg.block_k.
      qmeta: int32 [B, S_p, 128] (lane 0 segment, lane 1 position).
      wmeta: int32 [B, 8, S_kv_p] (row 0 segment, row 1 position, row 2 = 1 for real keys, 0 for padding).
      sinks: optional f32 [H]; the result is then logaddexp(lse, sinks[h]).
      seq_len: default ids (one document, positions 0..S-1, S_kv == S, key_offset 0): the real length S; the
        mask then comes from iota positions and qmeta/wmeta are not read (pass None for them).
      key_offset: query t's window lies in key rows [t + key_offset - W + 1, t + key_offset] (0: the key sequence
        is the query sequence; W - 1: the keys carry a W - 1 row halo before the queries, context parallelism).

    Returns:
      f32 [B, S_p, H], -inf where the window is empty (and there is no sink).
    """
    b, s_p, h, d = q.shape
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    nq, nkt, nh = s_p // bq, window_kv.shape[1] // bk, h // hc
    band = band_tiles(cfg, window_size, nkt, nq, key_offset)
    tiles = tiles_per_step(band)
    group = common.head_group(h, hc, q.dtype)
    layout = common.row_layout(h, hc, bq, q.dtype)
    if seq_len is not None and key_offset:
        raise ValueError("seq_len (default ids) requires key_offset 0")

    def kv_tile(p, k, i):
        qi = common.zigzag(common.index_rem(p, nq), nq)
        first, last = _band(qi, bq, bk, window_size, nkt, key_offset)
        return common.index_div(p, nq), jnp.minimum(first + k * tiles + i, last)

    def q_map(p, c, k):
        qi = common.zigzag(common.index_rem(p, nq), nq)
        return common.index_div(p, nq), qi, common.index_div(c * hc, group), 0

    def kv_map(i, p, c, k):
        bb, tile = kv_tile(p, k, i)
        return bb, tile, 0

    def kmeta_map(i, p, c, k):
        bb, tile = kv_tile(p, k, i)
        return bb, 0, tile

    def qmeta_map(p, c, k):
        return common.index_div(p, nq), common.zigzag(common.index_rem(p, nq), nq), 0

    def out_map(p, c, k):
        return common.index_div(p, nq), c, common.zigzag(common.index_rem(p, nq), nq), 0, 0

    # Lane-dense statistics: rows and keys tile into 128x128 blocks and the output block [hc, bq] is legal.
    lane_dense = bq == 128 and bk % 128 == 0 and (hc % common.SUBLANES == 0 or hc == h)
    kernel = functools.partial(_kernel, nq=nq, num_kv_tiles=nkt, tiles=tiles, layout=layout, block_k=bk,
                               group=group, window_size=window_size, scale=scale, key_offset=key_offset,
                               seq_len=seq_len, lane_dense=lane_dense, with_sinks=sinks is not None)
    stats = (layout.rows // 128, 128) if lane_dense else (*layout.view, min(common.LANES, bk))
    out_block = (hc, bq) if lane_dense else layout.view
    in_specs = [pl.BlockSpec((None, bq, group, d), q_map)]
    in_specs += [pl.BlockSpec((None, bk, d), functools.partial(kv_map, i)) for i in range(tiles)]
    operands = [q] + [window_kv] * tiles
    if seq_len is None:
        in_specs.append(pl.BlockSpec((None, bq, common.LANES), qmeta_map))
        in_specs += [pl.BlockSpec((None, common.SUBLANES, bk), functools.partial(kmeta_map, i))
                     for i in range(tiles)]
        operands += [qmeta] + [wmeta] * tiles
    if sinks is not None:  # per head chunk, in the statistics' row order
        sink_rows = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(nh, hc)[:, None, :], (nh, bq, hc))
        if not layout.token_major:
            sink_rows = jnp.swapaxes(sink_rows, 1, 2)
        in_specs.append(pl.BlockSpec((None, *stats[:2]), lambda p, c, k: (c, 0, 0)))
        operands.append(sink_rows.reshape(nh, *stats[:2]))
    scratch = [pltpu.VMEM(stats, jnp.float32), pltpu.VMEM(stats, jnp.float32)]
    if not layout.token_major:
        scratch.append(pltpu.VMEM((hc * bq, d), q.dtype))
    out = runtime.pallas_call(
        kernel,
        grid=(b * nq, nh, common.cdiv(band, tiles)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, *out_block), lambda p, c, k: out_map(p, c, k)[:3]) if lane_dense else
        pl.BlockSpec((None, None, None, *out_block), out_map),
        out_shape=jax.ShapeDtypeStruct((b, h, s_p) if lane_dense else (b, nh, nq, *out_block), jnp.float32),
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=2 * b * s_p * h * band * bk * d, transcendentals=b * s_p * h * band * bk,
                                      bytes_accessed=_hbm_bytes(q, window_kv, bk=bk, nq=nq, nh=nh, band=band,
                                                                tiles=tiles, ids=seq_len is None,
                                                                sinks=sinks is not None)),
        interpret=interpret,
        name=f"csa_window_lse_bq{bq}_bk{bk}_hc{hc}_{'tok' if layout.token_major else 'head'}",
    )(*operands)
    # Lane-dense: [B, H, S_p], whose transpose XLA can fold into the result's layout.
    return jnp.swapaxes(out, 1, 2) if lane_dense else layout.stats_from_hbm(out)
