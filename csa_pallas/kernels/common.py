"""Layout helpers shared by the kernels.

Conventions (splash-attention style, adapted):
  * Query metadata travels as one lane-dense int32 array qmeta [B, S, 128]: lane 0 = segment id, lane 1 = position.
  * Key metadata travels as kmeta [B, 8, N] (or [B, 8, S_kv] for window keys): row 0 = segment, row 1 = end
    position of the block (or position of the key). Both load as natively tiled (8, 128) blocks.
  * Per-row statistics inside a kernel are columns [R, 1]; in HBM they are stored lane-dense in the layout
    [B, n_chunks, n_q_tiles, rows_per_chunk, block_q] so that every block's last two dims are full array dims
    (legal for any block_q). `column_to_rows` / `rows_to_column` convert between the two inside a kernel with an
    identity-mask reduction (O(block_q^2) VPU work, once per grid step), which lowers on Mosaic for any block_q.
  * Integer division in index maps uses lax.div / lax.rem: jnp's `//` lowers through `sign`, which asks for the
    TPU generation at trace time and fails on a CPU host.
  * Tile walks (which kv tiles a grid step visits) live in `schedule`.
"""

from __future__ import annotations

import dataclasses

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LANES = 128
SUBLANES = 8
MiB = 1 << 20


def is_optional_bool(value) -> bool:
    """None, True or False (a config's auto / forced-on / forced-off field); not 0 or 1, which compare equal."""
    return value is None or isinstance(value, (bool, np.bool_))


# Scores are kept in base 2 inside the kernels (z * log2 e, exp2): exp(x) lowers to exp2(x * log2 e) anyway.
LOG2E = math.log2(math.e)
# A finite floor for running maxima: exp(floor - floor) = 1 keeps the online rescale NaN-free on fully masked tiles.
STAT_FLOOR = -1e30
F32_TINY = float(jnp.finfo(jnp.float32).tiny)
# Padded query rows get this position: no block end and no window key is <= it, so they see nothing.
PAD_POSITION = jnp.iinfo(jnp.int32).min


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


MEGACORE = 2  # TensorCores sharing a "parallel" grid axis on v5p


def resident_fetches(batch: int, steps_per_batch: int) -> int:
    """HBM fetches of a block that changes once per batch element (a resident [R, d] operand) along one "parallel"
    grid axis of batch * steps_per_batch steps, which the MEGACORE cores walk in contiguous shares: one fetch per
    batch element each share touches (batch + 1 when a share boundary falls inside an element)."""
    total = batch * steps_per_batch
    bounds = [c * total // MEGACORE for c in range(MEGACORE + 1)]
    shares = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    return sum((hi - 1) // steps_per_batch - lo // steps_per_batch + 1 for lo, hi in shares)


def sublane_multiple(dtype) -> int:
    """Rows per native tile: 8 for 32-bit, 16 for 16-bit dtypes."""
    return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)


def index_div(x, d: int):
    """x // d for an int32 index x >= 0 and a static d > 0. A shift when d is a power of two: lax.div is a signed
    division, for which Mosaic adds sign fix-ups (a handful of scalar ops per call, in every grid step)."""
    if d & (d - 1) == 0:
        return lax.shift_right_logical(x, jnp.asarray(d.bit_length() - 1, jnp.int32))
    return lax.div(x, d)


def index_rem(x, d: int):
    """x % d for an int32 index x >= 0 and a static d > 0 (a mask when d is a power of two)."""
    if d & (d - 1) == 0:
        return lax.bitwise_and(x, jnp.asarray(d - 1, jnp.int32))
    return lax.rem(x, d)


def zigzag(i, num_tiles: int):
    """Grid index -> query tile: 0, n-1, 1, n-2, ... so both TensorCores get equal causal work."""
    half = index_div(i, 2)
    return jnp.where(index_rem(i, 2) == 0, half, num_tiles - 1 - half)


def query_meta(segment_ids, positions, padded_len: int):
    """[B, S] segment ids and positions -> qmeta int32 [B, padded_len, 128] (lane 0 segment, lane 1 position)."""
    b, s = segment_ids.shape
    pad = padded_len - s
    seg = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge") if pad else segment_ids
    pos = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=PAD_POSITION) if pad else positions
    meta = jnp.zeros((b, padded_len, LANES), jnp.int32)
    return meta.at[:, :, 0].set(seg).at[:, :, 1].set(pos)


def key_meta(segments, ends, padded_len: int, pad_end):
    """[B, N] segments and end positions -> kmeta int32 [B, 8, padded_len]; padding gets end `pad_end`."""
    b, n = segments.shape
    pad = padded_len - n
    if pad:
        segments = jnp.pad(segments, ((0, 0), (0, pad)), mode="edge" if n else "constant")
        ends = jnp.pad(ends, ((0, 0), (0, pad)), constant_values=pad_end)
    meta = jnp.zeros((b, SUBLANES, padded_len), jnp.int32)
    return meta.at[:, 0, :].set(segments).at[:, 1, :].set(ends)


def ids_metadata_bytes(query_rows: int, key_blocks: int, block_k: int) -> int:
    """HBM bytes of reading the ids metadata: `query_rows` rows of qmeta (int32 [.., 128] each, `query_meta`) and
    `key_blocks` fetched [8, block_k] int32 blocks of kmeta (`key_meta`); for the kernels' cost estimates."""
    return 4 * (query_rows * LANES + key_blocks * SUBLANES * block_k)


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How the hc heads x bq queries of one grid step are laid out as matmul rows.

    token_major (r = t*hc + h): the q block [bq, hc, D] is reshaped in place (free when hc is a multiple of the
    sublane tile), heads are summed over axis 1. head_major (r = h*bq + t): any head_chunk; the chunk's heads are
    first copied into a rows scratch, heads are summed over axis 0. Per-(query, head) statistics are stored in HBM
    as [B, H/hc, S_p/bq] blocks of shape `view` (lane-dense, legal for any bq).
    """

    block_q: int
    head_chunk: int
    token_major: bool

    @property
    def view(self):
        return (self.block_q, self.head_chunk) if self.token_major else (self.head_chunk, self.block_q)

    @property
    def head_axis(self) -> int:
        return 1 if self.token_major else 0

    @property
    def rows(self) -> int:
        return self.block_q * self.head_chunk

    def expand_mask(self, mask):
        """[bq, bk] query-by-key mask -> broadcastable against the [*view, bk] scores."""
        return mask[:, None, :] if self.token_major else mask[None]

    def stats_to_hbm(self, x):
        """f32 [B, S_p, H] -> [B, H/hc, S_p/bq, *view]."""
        b, s, h = x.shape
        x = x.reshape(b, s // self.block_q, self.block_q, h // self.head_chunk, self.head_chunk)
        return jnp.transpose(x, (0, 3, 1, 2, 4) if self.token_major else (0, 3, 1, 4, 2))

    def stats_from_hbm(self, x):
        """Inverse of `stats_to_hbm`: [B, nh, nq, *view] -> [B, S_p, H]."""
        b, nh, nq = x.shape[:3]
        x = jnp.transpose(x, (0, 2, 3, 1, 4) if self.token_major else (0, 2, 4, 1, 3))
        return x.reshape(b, nq * self.block_q, nh * self.head_chunk)

    def block_to_column(self, x):
        """A stats block [*view] -> column [*view, 1] aligned with the score rows."""
        return rows_to_column(x).reshape(*self.view, 1)

    def column_to_block(self, col):
        return column_to_rows(col.reshape(self.rows, 1), self.view[0])

    def per_query_max(self, col):
        """A per-(query, head) column [*view, 1] -> its max over the chunk's heads, per query: [bq, 1]."""
        return jnp.max(col, axis=self.head_axis).reshape(self.block_q, 1)

    def query_to_view(self, x):
        """A per-query array [bq, n] -> broadcastable against [*view, n]."""
        return x[:, None, :] if self.token_major else x[None]


def row_layout(num_heads: int, head_chunk: int, block_q: int, dtype) -> RowLayout:
    token_major = head_group(num_heads, head_chunk, dtype) == head_chunk and head_chunk % sublane_multiple(dtype) == 0
    return RowLayout(block_q, head_chunk, token_major)


def rows_to_column(x):
    """[G, bq] lane-dense values -> [G*bq, 1] column, row g*bq + t holding x[g, t]."""
    g, bq = x.shape
    eye = lax.broadcasted_iota(jnp.int32, (bq, bq), 0) == lax.broadcasted_iota(jnp.int32, (bq, bq), 1)
    spread = jnp.broadcast_to(x[:, None, :], (g, bq, bq))
    col = jnp.sum(jnp.where(eye[None], spread, 0.0), axis=2, keepdims=True)  # [g, bq, 1]
    return col.reshape(g * bq, 1)


def column_to_rows(col, groups: int):
    """[G*bq, 1] column -> [G, bq] lane-dense (inverse of `rows_to_column`)."""
    bq = col.shape[0] // groups
    eye = lax.broadcasted_iota(jnp.int32, (bq, bq), 0) == lax.broadcasted_iota(jnp.int32, (bq, bq), 1)
    spread = jnp.broadcast_to(col.reshape(groups, bq, 1), (groups, bq, bq))
    return jnp.sum(jnp.where(eye[None], spread, 0.0), axis=1)  # [g, bq]


def lane_chunks(x, lanes: int):
    """Split the last dim of x into static chunks of `lanes` lanes (one vreg column each)."""
    width = x.shape[-1]
    return [x[..., j:j + lanes] for j in range(0, width, lanes)]


def online_lse_update(m_ref, l_ref, z, lanes: int, *, first: bool = False, base2: bool = False,
                      store: bool = True):
    """Per-lane running max/sum update with the scores z [..., bk] (masked entries -inf).

    m_ref, l_ref: f32 [..., lanes]. Keeping the statistics per lane defers the cross-lane reduction to the end of
    the pass (`finish_lse`, `rebase.compressed_log2_mass`) instead of paying it on every tile. first: the pass's
    first tile; the statistics are written, not updated, so they need no initialisation (their old contents are
    ignored). base2: z holds scores times log2(e) and the sums use exp2 (the hardware exponential: no multiply per
    element). Returns the new (max, sum); store=False leaves them out of m_ref, l_ref (a last update consumed at
    once). A NaN score makes its lane's statistics NaN.
    """
    exp = jnp.exp2 if base2 else jnp.exp
    chunks = lane_chunks(z, lanes)
    if first:
        m_new = jnp.full(chunks[0].shape, STAT_FLOOR, jnp.float32)
        for c in chunks:
            m_new = jnp.maximum(m_new, c)
        acc = None
    else:
        m_old, l_old = m_ref[...], l_ref[...]
        m_new = m_old
        for c in chunks:
            m_new = jnp.maximum(m_new, c)
        acc = l_old * exp(m_old - m_new)
    for c in chunks:
        e = exp(c - m_new)
        acc = e if acc is None else acc + e
    if store:
        m_ref[...] = m_new
        l_ref[...] = acc
    return m_new, acc


def finish_lse(m, l):
    """Reduce per-lane (max, sum) [..., lanes] to a log-sum-exp column [..., 1]; -inf where nothing was seen, NaN
    where a NaN was."""
    row_max = jnp.max(m, axis=-1, keepdims=True)
    total = jnp.sum(l * jnp.exp(m - row_max), axis=-1, keepdims=True)
    return jnp.where(total == 0, -jnp.inf, row_max + jnp.log(jnp.where(total == 0, 1.0, total)))


def tile_ranges(need):
    """bool [B, nq, nk] -> (firsts, counts), int32 [B*nq] each: query tile i visits kv tiles
    [firsts[i], firsts[i] + counts[i]), the smallest range holding every needed tile (counts 0: none).

    A range rather than a list keeps the scalar-prefetch tables at 2 words per query tile (a per-tile list needs
    nq*nk words: 2 MiB at S=128K, over the 1 MiB of SMEM). Packed documents are contiguous, so the range is
    exact for them; the kernels' exact mask covers any tile inside the range that is not needed.
    """
    nk = need.shape[-1]
    k = jnp.arange(nk, dtype=jnp.int32)
    any_needed = jnp.any(need, axis=-1)
    first = jnp.min(jnp.where(need, k, nk), axis=-1)
    last = jnp.max(jnp.where(need, k, -1), axis=-1)
    counts = jnp.where(any_needed, last - first + 1, 0).astype(jnp.int32)
    firsts = jnp.where(any_needed, first, 0).astype(jnp.int32)
    return firsts.reshape(-1), counts.reshape(-1)


def tile_need(qmeta, kmeta, block_q: int, block_k: int):
    """Conservative per-(query tile, key tile) visibility for dense mode: bool [B, nq, nk].

    A key tile is needed by a query tile when some valid block in it could be visible to some query of the tile:
    its smallest end position <= the tile's largest query position and the two segment ranges overlap. The
    kernels apply the exact mask inside; this only decides which tiles are fetched and computed.
    """
    b, s_p, _ = qmeta.shape
    n_p = kmeta.shape[2]
    qseg = qmeta[:, :, 0].reshape(b, s_p // block_q, block_q)
    qpos = qmeta[:, :, 1].reshape(b, s_p // block_q, block_q)
    kseg = kmeta[:, 0, :].reshape(b, n_p // block_k, block_k)
    kend = kmeta[:, 1, :].reshape(b, n_p // block_k, block_k)
    big = jnp.iinfo(jnp.int32).max
    valid = kend != big
    k_min_end = jnp.min(kend, axis=-1)
    k_min_seg = jnp.min(jnp.where(valid, kseg, big), axis=-1)
    k_max_seg = jnp.max(jnp.where(valid, kseg, -big - 1), axis=-1)
    q_max_pos = jnp.max(qpos, axis=-1)
    q_min_seg = jnp.min(qseg, axis=-1)
    q_max_seg = jnp.max(qseg, axis=-1)
    return ((k_min_end[:, None, :] <= q_max_pos[:, :, None])
            & (k_min_seg[:, None, :] <= q_max_seg[:, :, None])
            & (k_max_seg[:, None, :] >= q_min_seg[:, :, None]))


def gather_head_rows(q_ref, rows_ref, chunk, *, head_chunk: int, group: int, block_q: int):
    """Copies the chunk's heads from a q block [bq, group, D] into head-major rows [hc*bq, D].

    When the fetched group holds several chunks, the chunk's offset inside it is dynamic; Mosaic only indexes the
    head (sublane) dim statically, so each possible offset gets its own `pl.when` branch.
    """
    from jax.experimental import pallas as pl  # local: keeps this module importable without pallas users

    options = group // head_chunk
    sub = lax.rem(chunk * head_chunk, group) if options > 1 else 0
    for o in range(options):
        @pl.when(sub == o * head_chunk)
        def _():
            for h in range(head_chunk):
                rows_ref[h * block_q:(h + 1) * block_q, :] = q_ref[:, o * head_chunk + h, :]


def head_group(num_heads: int, head_chunk: int, dtype) -> int:
    """Heads per fetched q block: the chunk itself when it is a legal block dim (a multiple of the sublane tile,
    or all heads), else the smallest legal multiple of it that divides H."""
    sub = sublane_multiple(dtype)
    if head_chunk == num_heads or head_chunk % sub == 0:
        return head_chunk
    for g in range(head_chunk, num_heads + 1, head_chunk):
        if num_heads % g == 0 and (g % sub == 0 or g == num_heads):
            return g
    return num_heads


def scale_rows(ref, factor):
    """ref[...] *= factor, a per-row factor replicated over 128 lanes (f32 [rows, 128]), for a ref [rows, W]
    (W a multiple of 128, or at most 128), one 128-lane chunk at a time."""
    from jax.experimental import pallas as pl  # local: keeps this module importable without pallas users

    width = ref.shape[-1]
    if width <= LANES:
        ref[...] = ref[...] * factor[:, :width]
        return

    def body(j, carry):
        lanes = pl.ds(pl.multiple_of(j * LANES, LANES), LANES)
        ref[:, lanes] = ref[:, lanes] * factor
        return carry

    lax.fori_loop(0, width // LANES, body, 0)


def nan_filled_rows(x):
    """x [R, D] with every row holding a NaN or +-inf replaced by NaN (same dtype), inside a kernel: a -inf score
    would otherwise silently drop a key (SPEC §3: a non-finite input makes the rows that read it NaN). Plain
    arithmetic (x * 0 is 0 only for finite x), computed in f32."""
    wide = x.astype(jnp.float32)
    bad = jnp.max(jnp.where(wide * 0.0 == 0.0, 0.0, 1.0), axis=-1, keepdims=True)
    return jnp.where(bad > 0.0, jnp.nan, wide).astype(x.dtype)


# dot_general dimension numbers of the student kernels' products
NT = (((1,), (1,)), ((), ()))  # a . b^T
TN = (((0,), (0,)), ((), ()))  # a^T . b
NN = (((1,), (0,)), ((), ()))  # a . b


def exact_dot(a, b, dims):
    """An MXU product accumulated in f32: bf16 operands in one pass (exact products), f32 ones at HIGHEST."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def finite_or_zero(x):
    """x with its NaN and +-inf entries replaced by 0, in x's dtype (compared in f32: v5p has no bf16 VPU). The
    student's backward products take their operands through this, so a term whose coefficient is 0 stays 0 against
    a non-finite operand (SPEC §6: the Pallas and XLA students then agree on non-finite inputs)."""
    wide = x.astype(jnp.float32)
    return jnp.where(jnp.abs(wide) < jnp.inf, wide, 0.0).astype(x.dtype)


def hi_lo_terms(x, dtype):
    """f32 x -> the terms fed to the MXU: (x,) for f32 operands, (hi, lo) bf16 with hi + lo = x to ~2^-17."""
    if dtype == jnp.float32:
        return (x,)
    hi = x.astype(dtype)
    return hi, (x - hi.astype(jnp.float32)).astype(dtype)
