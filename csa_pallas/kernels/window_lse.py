"""Window log-sum-exp (the window part of u, SPEC §3) as a Pallas TPU kernel.

lse[t, h] = logsumexp_{j in Win(t)} tau q[t,h].window_kv[j]; the sink is folded in afterwards in XLA
(u = logaddexp(lse, sinks[h]), a [B, S, H] elementwise op).

Grid (B*nq "parallel", H/hc "arbitrary", band "arbitrary"): a query tile [q0, q0+bq) only looks at the key tiles
overlapping [q0-W+1, q0+bq-1], a static band of at most ceil((bq+W-1)/bk)+1 tiles (2 for bq = bk = W = 128), so the cost is O(S*(W+bq)*H*D) and no
[S, S_kv] anything exists. The exact window/segment rule is applied inside with iota-free metadata compares.

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

from csa_pallas.kernels import common

MiB = 1 << 20
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


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
    isz = jnp.dtype(dtype).itemsize
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    g = common.head_group(num_heads, hc, dtype)
    rows = hc * bq
    blocks = 2 * (bq * common.round_up(g, 16) * head_dim * isz + bk * head_dim * isz + bq * common.LANES * 4
                  + common.SUBLANES * max(bk, 128) * 4 + common.round_up(hc, 8) * max(bq, 128) * 4)
    scratch = rows * head_dim * isz + 2 * rows * 128 * 4
    temporaries = 4 * rows * max(bk, 128) * 4 + 2 * hc * bq * max(bq, 128) * 4
    return blocks + scratch + temporaries


def default_config(*, num_heads: int, head_dim: int, seq_len: int, dtype, head_chunk=None,
                   vmem_budget: int = 54 * MiB) -> WindowConfig:
    small = common.round_up(max(seq_len, 1), 16)
    bq = 128 if small > 128 else small
    bk = 128 if small > 128 else small
    if head_chunk is None:
        head_chunk = max(d for d in range(1, num_heads + 1) if num_heads % d == 0 and d * bq <= 4096)
    cfg = WindowConfig(bq, bk, head_chunk, 0)
    need = vmem_bytes(cfg, num_heads=num_heads, head_dim=head_dim, dtype=dtype)
    if need > vmem_budget and bq > 16:
        cfg = WindowConfig(bq // 2 if bq > 16 else bq, bk, head_chunk, 0)
        need = vmem_bytes(cfg, num_heads=num_heads, head_dim=head_dim, dtype=dtype)
    return dataclasses.replace(cfg, vmem_limit_bytes=min(max(int(need * 1.25) + 4 * MiB, 32 * MiB), 64 * MiB))


def _kernel(q_ref, kv_ref, *refs, nq, num_kv_tiles, layout, block_k, group, window_size, scale, key_offset,
            seq_len, lane_dense):
    bq, bk, hc = layout.block_q, block_k, layout.head_chunk
    iota_mask = seq_len is not None
    if iota_mask:
        qmeta_ref = kmeta_ref = None
    else:
        qmeta_ref, kmeta_ref, *refs = refs
    out_ref, m_ref, l_ref, *rows = refs
    rows_ref = rows[0] if rows else None
    p = pl.program_id(0)
    c = pl.program_id(1)
    k = pl.program_id(2)
    qi = common.zigzag(common.index_rem(p, nq), nq)
    first, last = _band(qi, bq, bk, window_size, num_kv_tiles, key_offset)
    tile = first + k

    if not layout.token_major:
        @pl.when(k == 0)
        def _():
            common.gather_head_rows(q_ref, rows_ref, c, head_chunk=hc, group=group, block_q=bq)

    def scores():
        """Masked scores in base 2 (scale * log2(e) folded into one multiply), f32 [rows, bk]."""
        rows = q_ref[...].reshape(layout.rows, -1) if layout.token_major else rows_ref[...]
        z = lax.dot_general(rows, kv_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        z = z * (scale * LOG2E)
        if iota_mask:
            # Default ids: query t sees keys (t - W, t] that exist; positions are iotas against static offsets.
            delta = (qi * bq - tile * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
                     - lax.broadcasted_iota(jnp.int32, (bq, bk), 1))
            key = tile * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            inside = (delta >= 0) & (delta < window_size) & (key < seq_len)
        else:
            delta = qmeta_ref[:, 1:2] - kmeta_ref[1:2, :]
            inside = ((kmeta_ref[0:1, :] == qmeta_ref[:, 0:1]) & (delta >= 0) & (delta < window_size)
                      & (kmeta_ref[2:3, :] != 0))
        z = jnp.where(layout.expand_mask(inside), z.reshape(*layout.view, bk), -jnp.inf)
        return z.reshape(layout.rows, bk)

    def update(first_tile):
        z = scores()
        if lane_dense:
            # Keys go to sublanes (one XLU transpose per 128x128 block): the reductions over keys become
            # elementwise across vregs, and the statistics of 128 rows fit one lane-dense vreg row.
            zt = jnp.swapaxes(z.reshape(layout.rows // 128, 128, bk), 1, 2)  # [rows/128, bk, 128]
            m_new = jnp.max(zt, axis=1)
            m_new = jnp.maximum(m_new, common.STAT_FLOOR if first_tile else m_ref[...])
            total = jnp.sum(jnp.exp2(zt - m_new[:, None, :]), axis=1)
            if not first_tile:
                total = total + l_ref[...] * jnp.exp2(m_ref[...] - m_new)
            m_ref[...] = m_new
            l_ref[...] = total
        else:
            common.online_lse_update(m_ref, l_ref, z.reshape(*layout.view, bk), min(common.LANES, bk),
                                     first=first_tile, base2=True)

    # The first tile writes the statistics; it is always visited (the band's first tile holds key t - W + 1 or 0).
    pl.when(k == 0)(functools.partial(update, True))
    pl.when((k > 0) & (tile <= last))(functools.partial(update, False))

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        if lane_dense:
            total = l_ref[...]
            lse = m_ref[...] + jnp.log2(jnp.where(total > 0, total, 1.0))
            out_ref[...] = jnp.where(total > 0, lse * LN2, -jnp.inf)
        else:
            m, l = m_ref[...], l_ref[...]
            row_max = jnp.max(m, axis=-1, keepdims=True)
            total = jnp.sum(l * jnp.exp2(m - row_max), axis=-1, keepdims=True)
            lse = row_max + jnp.log2(jnp.where(total > 0, total, 1.0))
            out_ref[...] = layout.column_to_block(jnp.where(total > 0, lse * LN2, -jnp.inf))


def _band(qi, bq, bk, window_size, num_kv_tiles, key_offset):
    first = lax.div(jnp.maximum(qi * bq + key_offset - (window_size - 1), 0), bk)
    last = jnp.minimum(lax.div(qi * bq + bq - 1 + key_offset, bk), num_kv_tiles - 1)
    return first, last


def window_lse_pallas(q, window_kv, qmeta, wmeta, *, cfg: WindowConfig, window_size: int, scale: float,
                      key_offset: int = 0, seq_len=None, interpret=False):
    """Window log-sum-exp per (query, head).

    Args:
      q: [B, S_p, H, D]; window_kv: [B, S_kv_p, D] (same dtype); S_p = `padded_len(S, cfg)`, S_kv_p a multiple
        of cfg.block_k.
      qmeta: int32 [B, S_p, 128] (lane 0 segment, lane 1 position).
      wmeta: int32 [B, 8, S_kv_p] (row 0 segment, row 1 position, row 2 = 1 for real keys, 0 for padding).
      seq_len: default ids (one document, positions 0..S-1, S_kv == S, key_offset 0): the real length S; the
        mask then comes from iota positions and qmeta/wmeta are not read (pass None for them).
      key_offset: query t's window lies in key rows [t + key_offset - W + 1, t + key_offset] (0: the key sequence
        is the query sequence; W - 1: the keys carry a W - 1 row halo before the queries, context parallelism).

    Returns:
      f32 [B, H/hc, S_p/bq, *layout.view] (the row layout's HBM stats form), -inf where the window is empty.
    """
    b, s_p, h, d = q.shape
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    nq, nkt, nh = s_p // bq, window_kv.shape[1] // bk, h // hc
    band = band_tiles(cfg, window_size, nkt, nq, key_offset)
    group = common.head_group(h, hc, q.dtype)
    layout = common.row_layout(h, hc, bq, q.dtype)

    def kv_tile(p, k):
        qi = common.zigzag(common.index_rem(p, nq), nq)
        first, last = _band(qi, bq, bk, window_size, nkt, key_offset)
        return common.index_div(p, nq), jnp.minimum(first + k, last)

    def q_map(p, c, k):
        qi = common.zigzag(common.index_rem(p, nq), nq)
        return common.index_div(p, nq), qi, common.index_div(c * hc, group), 0

    def kv_map(p, c, k):
        bb, tile = kv_tile(p, k)
        return bb, tile, 0

    def kmeta_map(p, c, k):
        bb, tile = kv_tile(p, k)
        return bb, 0, tile

    def qmeta_map(p, c, k):
        return common.index_div(p, nq), common.zigzag(common.index_rem(p, nq), nq), 0

    def out_map(p, c, k):
        return common.index_div(p, nq), c, common.zigzag(common.index_rem(p, nq), nq), 0, 0

    if seq_len is not None and key_offset:
        raise ValueError("seq_len (default ids) requires key_offset 0")
    # Statistics lane-dense over rows (keys moved to sublanes) when the rows and keys tile into 128x128 blocks.
    lane_dense = layout.rows % 128 == 0 and bk % 128 == 0
    kernel = functools.partial(_kernel, nq=nq, num_kv_tiles=nkt, layout=layout, block_k=bk, group=group,
                               window_size=window_size, scale=scale, key_offset=key_offset, seq_len=seq_len,
                               lane_dense=lane_dense)
    stats = (layout.rows // 128, 128) if lane_dense else (*layout.view, min(common.LANES, bk))
    scratch = [pltpu.VMEM(stats, jnp.float32), pltpu.VMEM(stats, jnp.float32)]
    if not layout.token_major:
        scratch.append(pltpu.VMEM((hc * bq, d), q.dtype))
    out_block = stats if lane_dense else layout.view
    in_specs = [pl.BlockSpec((None, bq, group, d), q_map), pl.BlockSpec((None, bk, d), kv_map)]
    operands = [q, window_kv]
    if seq_len is None:
        in_specs += [pl.BlockSpec((None, bq, common.LANES), qmeta_map),
                     pl.BlockSpec((None, common.SUBLANES, bk), kmeta_map)]
        operands += [qmeta, wmeta]
    out = pl.pallas_call(
        kernel,
        grid=(b * nq, nh, band),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, None, *out_block), out_map),
        out_shape=jax.ShapeDtypeStruct((b, nh, nq, *out_block), jnp.float32),
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=2 * b * s_p * h * band * bk * d, transcendentals=b * s_p * h * band * bk,
                                      bytes_accessed=q.size * q.dtype.itemsize),
        interpret=interpret,
        name=f"csa_window_lse_bq{bq}_bk{bk}_hc{hc}_{'tok' if layout.token_major else 'head'}",
    )(*operands)
    return out.reshape(b, nh, nq, *layout.view)  # row-major over the step's rows either way
