"""Dense block-compressed teacher P (SPEC §3) as one Pallas TPU kernel.

Grid (B*nq "parallel", H/hc "arbitrary", passes*nk "arbitrary"):
  * axis 0 walks (batch, query tile) pairs; query tiles are visited in zig-zag order so the two TensorCores of a
    v5p chip get the same causal work;
  * axis 1 walks head chunks of `head_chunk` heads (MaxText's `mla_qk_head_chunk_size` as a VMEM tile);
  * axis 2 walks the kv tiles a query tile needs (per-query-tile kv ranges via scalar prefetch, splash style: tiles
    no query of the tile can see are neither fetched nor computed), once for the log-sum-exp (pass 1) and once for
    the probabilities (pass 2). With `full_lse` given there is only pass 2; with `cache_scores` pass 2 re-reads the
    masked scores pass 1 left in VMEM instead of a second matmul, all of them in one step after pass 1, whose last
    step already computed F. Causal cached runs with one head chunk walk query tiles in pairs (qi, nq-1-qi) on
    axis 0 instead, the pair's steps back to back: every pair has the same number of steps, so none idles.

Per step the hc heads of bq queries form R = hc*bq rows [R, D] (head-major) against one kv tile [bk, D]: one MXU
call, f32 accumulation (with the causal schedule, a diagonal kv tile only up to its last visible 128-lane chunk).
Scores are kept in base 2 (times log2 e, exp2). Running max/sum are kept per lane ([hc, bq, 128]); the first
pass-2 step reduces them across lanes into F, held replicated over lanes ([*view, 128]) for the later steps.
The head-summed probabilities accumulate in the resident output block [bq, N_p] (f32); after the last head chunk
the block is L1-normalised in place. No [B, H, S, N] tensor ever exists, in HBM or VMEM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, fused_kl

MODES = ("per_head", "joint", "full_lse")
MiB = 1 << 20
# Scores are kept in base 2 inside the kernel (z * log2 e, exp2): exp(x) lowers to exp2(x * log2 e) anyway.
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """Tiling of the dense teacher kernel.

    block_q: queries per tile (multiple of 16). block_k: compressed blocks per kv tile (multiple of 128, or the
    whole padded N when N <= 128). head_chunk: heads per step (divisor of H). cache_scores: keep pass-1 scores in
    VMEM (one matmul instead of two) - only when they fit. vmem_limit_bytes: Mosaic scoped-VMEM limit.
    """

    block_q: int
    block_k: int
    head_chunk: int
    cache_scores: bool
    vmem_limit_bytes: int

    def __post_init__(self):
        if self.block_q < 16 or self.block_q % 16:
            raise ValueError(f"block_q: expected a positive multiple of 16, got {self.block_q}")
        if self.block_k < 1 or (self.block_k > 128 and self.block_k % 128):
            raise ValueError(f"block_k: expected a multiple of 128 (or <= 128), got {self.block_k}")
        if self.head_chunk < 1:
            raise ValueError(f"head_chunk: expected >= 1, got {self.head_chunk}")


@dataclasses.dataclass(frozen=True)
class ChipBudget:
    """Per-generation VMEM budget used by the config heuristics."""

    name: str
    vmem_bytes: int
    target_rows: int  # R = hc * bq rows per MXU call that the v5p estimate liked best


CHIPS = {
    "v5p": ChipBudget("v5p", vmem_bytes=64 * MiB, target_rows=4096),
    "v5e": ChipBudget("v5e", vmem_bytes=128 * MiB, target_rows=4096),
    "v6e": ChipBudget("v6e", vmem_bytes=128 * MiB, target_rows=4096),
}
DEFAULT_CHIP = "v5p"
# The calculator is an upper estimate (bq64 x hc64 cached: 55 MiB estimated, compiles under a 60 MiB limit).
USABLE_VMEM_FRACTION = 0.94
VMEM_HEADROOM = 4 * MiB  # left to Mosaic's internal scratch above the scoped limit


def padded_blocks(num_blocks: int, block_k: int) -> int:
    return common.round_up(max(num_blocks, 1), block_k)


def vmem_bytes(cfg: TeacherConfig, *, num_heads: int, head_dim: int, num_blocks: int, dtype, mode: str,
               kl_logits_dtype=None) -> int:
    """Upper estimate of the kernel's VMEM use: double-buffered blocks, scratch and f32 temporaries.
    kl_logits_dtype: the fused-KL variant (`fused_kl.FusedKL`) with logits of that dtype."""
    isz = jnp.dtype(dtype).itemsize
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    g = common.head_group(num_heads, hc, dtype)
    n_p = padded_blocks(num_blocks, bk)
    rows = hc * bq
    lanes = min(common.LANES, bk)
    blocks = 2 * (bq * common.round_up(g, 16) * head_dim * isz + bk * head_dim * isz + bq * common.LANES * 4
                  + common.SUBLANES * max(bk, 128) * 4 + bq * n_p * 4)
    if mode != "per_head":
        blocks += 2 * common.round_up(hc, 8) * max(bq, 128) * 4
    # rows copy (head-major scratch, or the token-major reshape's materialised copy), per-lane max/sum, F (all lanes).
    scratch = rows * head_dim * isz + 2 * rows * max(lanes, 128) * 4 + rows * 128 * 4
    if cfg.cache_scores:
        scratch += rows * n_p * 4
    # f32 score-sized temporaries live at once in Mosaic's allocation: scores, masked scores, exp, chunks (~5),
    # plus the identity-mask conversion of the stats block.
    temporaries = 5 * rows * max(bk, 128) * 4 + 2 * hc * bq * max(bq, 128) * 4
    if kl_logits_dtype is not None:
        # f32 accumulator in scratch instead of the output block; logits in, G out (double-buffered), the key
        # metadata row, and ~8 f32 [bq, chunk] epilogue temporaries.
        lsz = jnp.dtype(kl_logits_dtype).itemsize
        blocks += -2 * bq * n_p * 4 + 4 * bq * n_p * lsz + 2 * common.SUBLANES * n_p * 4
        scratch += bq * n_p * 4
        temporaries = max(temporaries, 8 * bq * fused_kl.kl_chunk(n_p, fused_kl.FusedKL.chunk) * 4)
    return blocks + scratch + temporaries


def default_config(*, num_heads: int, head_dim: int, seq_len: int, num_blocks: int, dtype, mode: str,
                   head_chunk: Optional[int] = None, chip: str = DEFAULT_CHIP, kl_logits_dtype=None) -> TeacherConfig:
    """Tiles for one problem: R = hc*bq near the chip's target, kv tiles of 256, cached scores when they fit."""
    budget = CHIPS[chip]
    usable = int(budget.vmem_bytes * USABLE_VMEM_FRACTION)
    bq = min(64, common.round_up(max(seq_len, 1), 16))
    n16 = common.round_up(max(num_blocks, 1), 16)
    bk = n16 if n16 <= 128 else 256
    if head_chunk is None:
        head_chunk = max(d for d in range(1, num_heads + 1)
                         if num_heads % d == 0 and d * bq <= budget.target_rows)
    # One matmul (cached scores) beats a larger query tile: try every tile with the cache first.
    for cache in (True, False):
        for block_q in (bq, bq // 2, bq // 4):
            if block_q < 16:
                continue
            cfg = TeacherConfig(block_q, bk, head_chunk, cache, 0)
            need = vmem_bytes(cfg, num_heads=num_heads, head_dim=head_dim, num_blocks=num_blocks, dtype=dtype,
                              mode=mode, kl_logits_dtype=kl_logits_dtype)
            if need <= usable:
                limit = min(max(int(need * 1.25) + 4 * MiB, 32 * MiB), budget.vmem_bytes - VMEM_HEADROOM)
                return dataclasses.replace(cfg, vmem_limit_bytes=limit)
    return TeacherConfig(16, bk, head_chunk, False, budget.vmem_bytes - VMEM_HEADROOM)


# Causal schedules with at most this many kv tiles run the cached pass 2 as straight-line code, one variant per
# tile count and last width (code size grows with the square of the tile count; longer walks use a loop).
STRAIGHT_PASS2_MAX_TILES = 4


def normalize_rows(head_sum: jax.Array) -> jax.Array:
    """The kernel's final L1 normalisation, in XLA, for head sums built from several shards: f32 [..., N]."""
    total = jnp.sum(head_sum, axis=-1, keepdims=True)
    return head_sum / jnp.maximum(total, common.F32_TINY)


def _static_count(schedule: common.TileSchedule, qi: int) -> int:
    """`TileSchedule.count` of the causal schedule for a Python int query tile."""
    last_block = min((qi * schedule.block_q + schedule.block_q) // schedule.ratio - 1, schedule.num_blocks - 1)
    return last_block // schedule.block_k + 1 if last_block >= 0 else 0


def _pairs_fit(schedule: common.TileSchedule) -> bool:
    """The pair walk needs every second tile (nq-1-i) to visit a kv tile: its pass 2 gets a step of its own."""
    nq = schedule.nq
    return nq % 2 == 0 and all(_static_count(schedule, nq - 1 - i) >= 1 for i in range(nq // 2))


def _pair_merged(schedule: common.TileSchedule) -> bool:
    """Every second tile visits >= 2 kv tiles: its pass 2 can follow its last pass-1 step in the same grid step
    (with one tile, that step is also the first tile's pass 2, which needs the first tile's output blocks)."""
    nq = schedule.nq
    return all(_static_count(schedule, nq - 1 - i) >= 2 for i in range(nq // 2))


def _pair_steps(schedule: common.TileSchedule) -> int:
    """Grid steps per pair of query tiles (qi, nq-1-qi): both tiles' pass-1 steps, plus one for the second tile's
    pass 2 unless `_pair_merged` (the first tile's pass 2 shares the second tile's first step). The causal counts
    of such a pair add up to nearly the same number for every pair: no idle steps."""
    nq = schedule.nq
    most = max(_static_count(schedule, i) + _static_count(schedule, nq - 1 - i) for i in range(nq // 2))
    return most if _pair_merged(schedule) else most + 1


@dataclasses.dataclass(frozen=True)
class _PairStep:
    b: jax.Array
    qi: jax.Array  # the tile of this step's pass-1 work (q, kv and lse blocks)
    k: jax.Array  # its kv-walk position (>= count: no pass-1 work)
    count: jax.Array
    out_qi: jax.Array  # the tile whose output block is resident
    pass2: jax.Array  # the step of out_qi's pass 2


def _pair_decode(schedule: common.TileSchedule, p, step) -> _PairStep:
    """Pair walk of grid row p, tiles qa = pair and qb = nq-1-pair (counts ca, cb): steps 0..ca-1 are qa's pass 1,
    steps ca..ca+cb-1 qb's pass 1, step ca also qa's pass 2 (before qb's work: pass 1 overwrites the cache and F),
    qb's pass 2 in step ca+cb-1 after its last pass-1 work (`_pair_merged`) or else in step ca+cb. Both tiles'
    output blocks stay resident until their pass 2: pass 1 never touches them."""
    npairs = schedule.nq // 2
    b = common.index_div(p, npairs)
    qa = common.index_rem(p, npairs)
    qb = schedule.nq - 1 - qa
    ca = schedule.count(None, b, qa)
    cb = schedule.count(None, b, qb)
    second = step >= ca
    out_second = step > ca
    return _PairStep(b=b, qi=jnp.where(second, qb, qa), k=jnp.where(second, step - ca, step),
                     count=jnp.where(second, cb, ca), out_qi=jnp.where(out_second, qb, qa),
                     pass2=jnp.where(out_second, ca + cb - (1 if _pair_merged(schedule) else 0), ca))


def _pair_tile(schedule: common.TileSchedule, ps: _PairStep):
    return schedule.tile(None, None, ps.b, ps.qi, jnp.clip(ps.k, 0, jnp.maximum(ps.count - 1, 0)))


def _pair_index_maps(*, head_chunk: int, group: int, schedule: common.TileSchedule):
    def q_map(p, c, step, firsts_ref, counts_ref):
        ps = _pair_decode(schedule, p, step)
        return ps.b, ps.qi, common.index_div(c * head_chunk, group), 0

    def kv_map(p, c, step, firsts_ref, counts_ref):
        ps = _pair_decode(schedule, p, step)
        return ps.b, _pair_tile(schedule, ps), 0

    def kmeta_map(p, c, step, firsts_ref, counts_ref):
        ps = _pair_decode(schedule, p, step)
        return ps.b, 0, _pair_tile(schedule, ps)

    def row_map(p, c, step, firsts_ref, counts_ref):
        ps = _pair_decode(schedule, p, step)
        return ps.b, ps.out_qi, 0

    def lse_map(p, c, step, firsts_ref, counts_ref):
        ps = _pair_decode(schedule, p, step)
        return ps.b, c, ps.qi, 0, 0

    return dict(q=q_map, kv=kv_map, kmeta=kmeta_map, row=row_map, lse=lse_map)


def _kernel(firsts_ref, counts_ref, q_ref, kv_ref, qmeta_ref, kmeta_ref, *refs, mode, cache_scores, schedule, nh,
            layout, group, scale, normalize, pairs, kl: Optional[fused_kl.FusedKL] = None):
    refs = list(refs)
    lse_ref = None if mode == "per_head" else refs.pop(0)
    if kl is None:
        out_ref = refs.pop(0)  # the head sum accumulates in the resident output block
    else:
        logits_ref, krow_ref, stats_ref = refs.pop(0), refs.pop(0), refs.pop(0)
        grad_ref = refs.pop(0) if kl.emit_gradient else None
    m_ref, l_ref, f_ref, *extra = refs
    rows_ref = None if layout.token_major else extra.pop(0)
    cache_ref = extra.pop(0) if cache_scores else None
    if kl is not None:
        out_ref = extra.pop(0)  # f32 head-sum accumulator [bq, N_p] in scratch: the outputs are KL stats and dI
    bq, bk, hc = layout.block_q, schedule.block_k, layout.head_chunk
    lanes = min(common.LANES, bk)
    two_pass = mode != "full_lse"

    if pairs:
        ps = _pair_decode(schedule, pl.program_id(0), pl.program_id(2))
        active = ps.k < ps.count
        at = common.TeacherStep(b=ps.b, qi=ps.qi, c=pl.program_id(1), step=pl.program_id(2), in_pass1=active,
                                k=jnp.clip(ps.k, 0, jnp.maximum(ps.count - 1, 0)), tile=_pair_tile(schedule, ps),
                                active=active, last_step=ps.pass2)
        first_step = ps.k == 0  # of the pass-1 tile
        out_qi = ps.out_qi
    else:
        at = common.teacher_step(schedule, firsts_ref, counts_ref, two_pass=two_pass, single_pass2=cache_scores)
        first_step = at.step == 0
        out_qi = at.qi
    qi, c, step, in_pass1, k, tile, active = at.qi, at.c, at.step, at.in_pass1, at.k, at.tile, at.active
    # With pairs (one head chunk), the first tile's last step is the second tile's first pass-1 step (k == 0).
    epilogue_in_pass1 = pairs and kl is not None
    # Merged pairs: the second tile's pass 2 (and epilogue) follow its own last pass-1 work in the same step.
    # (At its pass-2 step a merged pair's first tile is at k == 0 of the second tile's walk, the second at k > 0.)
    merged = pairs and _pair_merged(schedule)
    own_pass2 = jnp.logical_not(first_step) if merged else False

    def fused_epilogue():
        visible_at, nonempty = _dense_visibility(kl, qmeta_ref, krow_ref, qi=out_qi, schedule=schedule)
        fused_kl.kl_epilogue(kl, out_ref, logits_ref, stats_ref, grad_ref, visible_at=visible_at,
                             nonempty_rows=nonempty)

    # Pairs (one head chunk): the output block is zeroed by the step that accumulates it, right before pass 2.
    @pl.when((step == at.last_step) if pairs else ((c == 0) & (step == 0)))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(first_step)
    def _():
        if not layout.token_major:
            common.gather_head_rows(q_ref, rows_ref, c, head_chunk=hc, group=group, block_q=bq)
        if not two_pass:
            f = layout.block_to_column(lse_ref[...].astype(jnp.float32)) * LOG2E
            f_ref[...] = jnp.broadcast_to(jnp.where(jnp.isfinite(f), f, 0.0), f_ref.shape)

    # Causal diagonal tiles are computed only up to the last 128-lane chunk the query tile can see: chunks past
    # it would be all -inf (at bk = 256, m = 4, bq = 64 this skips 1/10 of the matmul work).
    chunk = common.LANES if schedule.causal and bk > common.LANES else bk
    # The pass-1 tile's visible width, computed once up front (not re-derived inside each branch).
    pass1_width = schedule.visible_width(qi, tile, chunk) if chunk != bk else bk

    def scores(masked: bool, width: int):
        """Scaled scores (base 2: times log2 e) of the step's rows against the first `width` blocks of the kv
        tile: f32 [*view, width]."""
        rows = q_ref[...].reshape(layout.rows, -1) if layout.token_major else rows_ref[...]
        kv = kv_ref[...] if width == bk else kv_ref[:width, :]
        z = lax.dot_general(rows, kv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        z = (z * (scale * LOG2E)).reshape(*layout.view, width)
        if not masked:
            return z
        if schedule.causal:  # default ids: query t sees block j once it is complete, (j + 1) * m - 1 <= t
            t = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, width), 0)
            j = tile * bk + lax.broadcasted_iota(jnp.int32, (bq, width), 1)
            visible = ((j + 1) * schedule.ratio - 1 <= t) & (j < schedule.num_blocks)
        else:
            visible = ((kmeta_ref[0:1, :width] == qmeta_ref[:, 0:1])
                       & (kmeta_ref[1:2, :width] <= qmeta_ref[:, 1:2]))  # [bq, width]
        return jnp.where(layout.expand_mask(visible), z, -jnp.inf)

    def when_active(cond, body):
        """Runs body(masked, width) under cond & active. Causal schedule: tiles every query fully sees skip the
        mask; the diagonal tile runs only its visible chunks."""
        if not schedule.causal:
            pl.when(cond & active)(functools.partial(body, True, bk))
            return
        full = schedule.full(qi, tile)
        pl.when(cond & active & full)(functools.partial(body, False, bk))
        partial = cond & active & jnp.logical_not(full)
        if chunk == bk:
            pl.when(partial)(functools.partial(body, True, bk))
            return
        width = pass1_width
        for w in range(chunk, bk + 1, chunk):
            pl.when(partial & (width == w))(functools.partial(body, True, w))

    def finish_f(m=None, l=None):
        """F (base 2) from the pass-1 statistics (default: m_ref, l_ref), replicated over lanes: f32 [*view, 128],
        also stored in f_ref."""
        m = m_ref[...] if m is None else m
        l = l_ref[...] if l is None else l
        lse = common.finish_lse_finite(m, l, base2=True)  # [*view, 1], finite (joint: u included)
        f = jnp.broadcast_to(lse, f_ref.shape)
        f_ref[...] = f
        return f

    def dispatch(body):
        """Runs body(masked, width) for the step's tile, whose visit the caller has checked (causal schedule:
        as when_active)."""
        if not schedule.causal:
            body(True, bk)
            return
        full = schedule.full(qi, tile)
        pl.when(full)(functools.partial(body, False, bk))
        if chunk == bk:
            pl.when(jnp.logical_not(full))(functools.partial(body, True, bk))
            return

        @pl.when(jnp.logical_not(full))
        def _():
            width = pass1_width
            for w in range(chunk, bk + 1, chunk):
                pl.when(width == w)(functools.partial(body, True, w))

    def cached_pass2():
        """All of the query tile's cached tiles in one grid step (no per-tile step overhead); F is ready."""

        def accumulate(tile_k, z):
            f = f_ref[...][..., :lanes]
            for j, z_lanes in enumerate(common.lane_chunks(z, lanes)):
                probs = jnp.sum(jnp.exp2(z_lanes - f), axis=layout.head_axis)  # [bq, lanes]
                if isinstance(tile_k, int) or bk == out_ref.shape[-1]:
                    start = (tile_k if isinstance(tile_k, int) else 0) * bk + j * lanes
                    out_ref[:, start:start + lanes] += probs
                else:
                    start = pl.multiple_of(tile_k * bk + j * lanes, 128)
                    out_ref[:, pl.ds(start, lanes)] += probs

        count = schedule.count(counts_ref, at.b, out_qi)
        first_tile = schedule.first(firsts_ref, at.b, out_qi)
        last_tile = first_tile + count - 1
        widths = [bk] if chunk == bk else list(range(chunk, bk + 1, chunk))
        width = bk if chunk == bk else schedule.visible_width(out_qi, last_tile, chunk)

        if schedule.causal and schedule.nk <= STRAIGHT_PASS2_MAX_TILES:
            # One straight-line block per (tile count, last tile's width): the scheduler overlaps one tile's
            # exponentials with the next tile's loads, which a loop iteration boundary prevents (~10% of pass 2).
            def straight(n, w):
                for i in range(n):
                    accumulate(i, cache_ref[i] if i < n - 1 or w == bk else cache_ref[i, ..., :w])

            for n in range(1, schedule.nk + 1):
                for w in widths:
                    pl.when((count == n) if chunk == bk else (count == n) & (width == w))(
                        functools.partial(straight, n, w))
            return

        def last_width(w):
            accumulate(last_tile, cache_ref[count - 1] if w == bk else cache_ref[count - 1, ..., :w])

        if chunk == bk:
            last_width(bk)
        else:
            for w in widths:
                pl.when(width == w)(functools.partial(last_width, w))

        def body(i, carry):
            accumulate(first_tile + i, cache_ref[i])
            return carry

        lax.fori_loop(0, count - 1, body, 0)

    # Cached scores are already masked; the chunks past the visible width were never written (nor are they read).
    if cache_scores:  # ahead of pass 1: with pairs, this step's pass-1 work belongs to the next tile
        pl.when((step == at.last_step) & (schedule.count(counts_ref, at.b, out_qi) > 0)
                & jnp.logical_not(own_pass2))(cached_pass2)

    if two_pass:
        # The first visited tile writes the statistics (no initialisation pass over them); a query tile that
        # visits none still gets them initialised, for a well-defined (unused) F.
        @pl.when(first_step & jnp.logical_not(active))
        def _():
            m_ref[...] = jnp.full(m_ref.shape, common.STAT_FLOOR, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

        def joint_seed():
            """Joint mode: the window LSE u enters lane 0 of the statistics as one more term, so F = LSE(u, C)
            needs no logaddexp after the pass (and this work shares the MXU-bound first step)."""
            u = layout.block_to_column(lse_ref[...].astype(jnp.float32)) * LOG2E  # [*view, 1], base 2
            lane0 = lax.broadcasted_iota(jnp.int32, (*layout.view, lanes), 2) == 0
            seen = lane0 & (u > common.STAT_FLOOR)
            return (jnp.where(seen, u, common.STAT_FLOOR), jnp.where(seen, 1.0, 0.0))

        def pass1(first, last, finalize, masked, width):
            z = scores(masked, width)
            seed = joint_seed() if first and mode == "joint" else None
            # The last update feeds F directly: its statistics never go back to VMEM.
            stats = common.online_lse_update(m_ref, l_ref, z, lanes, first=first, seed=seed, base2=True,
                                             store=not last)
            if cache_scores:
                if width == bk:
                    cache_ref[k] = z
                else:
                    cache_ref[k, ..., :width] = z
            if last:
                # F right behind the last matmul: its cross-lane reductions (XLU) and exponentials share the
                # MXU-bound step instead of opening pass 2.
                finish_f(*stats)
            if finalize:  # the previous tile's KL epilogue, in the same basic block as this MXU-bound matmul
                fused_epilogue()

        # Nested conditions: a step outside pass 1 (or past the query tile's tiles) pays one branch, not one per
        # variant (each untaken pl.when costs ~10 bundles of scalar work and delay slots).
        @pl.when(in_pass1 & active)
        def _():
            last = k == schedule.count(counts_ref, at.b, qi) - 1
            for first in (True, False):
                @pl.when((k == 0) if first else (k > 0))
                def _():
                    if not cache_scores:
                        dispatch(functools.partial(pass1, first, False, False))
                        return
                    for finalize in ((False, True) if first and epilogue_in_pass1 else (False,)):
                        finishing = step == at.last_step
                        cond = finishing if finalize else jnp.logical_not(finishing) if first and epilogue_in_pass1 \
                            else True
                        pl.when(cond & last)(lambda: dispatch(functools.partial(pass1, first, True, finalize)))
                        pl.when(cond & jnp.logical_not(last))(
                            lambda: dispatch(functools.partial(pass1, first, False, finalize)))

    if cache_scores and merged:  # after pass 1, which wrote the last tile and F
        pl.when((step == at.last_step) & own_pass2)(cached_pass2)

    def pass2(first, masked, width):
        z = scores(masked, width)  # (cached scores: `cached_pass2`)
        # The first pass-2 step computes F itself: its cross-lane reductions (XLU-bound) then share a basic block
        # with the matmul, and hide.
        f = finish_f() if first else f_ref[...]
        f = f[..., :lanes]
        for j, z_lanes in enumerate(common.lane_chunks(z, lanes)):
            probs = jnp.sum(jnp.exp2(z_lanes - f), axis=layout.head_axis)  # [bq, lanes], summed over the chunk
            if bk == out_ref.shape[-1]:
                out_ref[:, j * lanes:(j + 1) * lanes] += probs
            else:
                start = pl.multiple_of(tile * bk + j * lanes, 128)
                out_ref[:, pl.ds(start, lanes)] += probs

    if not two_pass:
        when_active(jnp.logical_not(in_pass1), functools.partial(pass2, False))
    elif not cache_scores:  # F is computed in the first pass-2 step (a query tile with no visited tile needs none)
        when_active(jnp.logical_not(in_pass1) & (k == 0), functools.partial(pass2, True))
        when_active(jnp.logical_not(in_pass1) & (k > 0), functools.partial(pass2, False))

    if kl is not None:
        # Pairs: the first tile's epilogue runs inside the second tile's first pass-1 step (see pass1).
        standalone = (step == at.last_step) & (jnp.logical_not(active) | own_pass2) if epilogue_in_pass1 else (
            (c == nh - 1) & (step == at.last_step))
        pl.when(standalone)(fused_epilogue)
    elif normalize:
        @pl.when((c == nh - 1) & (step == at.last_step))
        def _():
            acc = out_ref[...]
            total = jnp.sum(acc, axis=1, keepdims=True)
            out_ref[...] = acc / jnp.maximum(total, common.F32_TINY)


def _dense_visibility(kl: fused_kl.FusedKL, qmeta_ref, krow_ref, *, qi, schedule: common.TileSchedule):
    """(visible_at(start, width) -> bool [bq, width], non-empty rows [bq, 1] or None) for the dense support V(t)."""
    bq = schedule.block_q
    if schedule.causal:  # row t sees blocks j < limit[t] (complete blocks, real rows only)
        t = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        limit = jnp.minimum(common.index_div(t + 1, schedule.ratio), schedule.num_blocks)
        limit = jnp.where(t < kl.seq_len, limit, 0)
        return (lambda start, width: start + lax.broadcasted_iota(jnp.int32, (bq, width), 1) < limit), limit > 0

    def visible_at(start, width):
        segment = krow_ref[0:1, pl.ds(start, width)]
        end = krow_ref[1:2, pl.ds(start, width)]
        return (segment == qmeta_ref[:, 0:1]) & (end <= qmeta_ref[:, 1:2])

    return visible_at, None


def teacher_pallas(q, kv, qmeta, kmeta, firsts, counts, lse_in, *, mode: str, cfg: TeacherConfig, scale: float,
                   schedule: common.TileSchedule, normalize: bool = True, kl: Optional[fused_kl.FusedKL] = None,
                   logits=None, interpret=False):
    """Runs the dense teacher kernel on padded, prepared inputs.

    Args:
      q: [B, S_p, H, D] (bf16/f32), S_p a multiple of cfg.block_q.
      kv: [B, N_p, D] same dtype as q, N_p a multiple of cfg.block_k.
      qmeta: int32 [B, S_p, 128]; kmeta: int32 [B, 8, N_p] (see `common`).
      firsts, counts: per-query-tile kv-tile ranges from `common.tile_ranges` (ignored when schedule.causal).
      lse_in: None (per_head), u (joint) or F (full_lse), f32 in the row layout's HBM form
        (`common.row_layout(...).stats_to_hbm`).
      mode: "per_head" | "joint" | "full_lse".
      normalize: False returns the head sum sum_h pi_h unnormalised (heads sharded over devices: the caller sums
        the shards' partial sums, then normalises once with `normalize_rows`).
      kl, logits: the fused KL (the loss path): logits I [B, S_p, N_p] (any float dtype, padding anything).

    Returns:
      P, f32 [B, S_p, N_p], rows L1-normalised (0 outside V(t) and on empty rows). With `kl`: the KL statistics
      f32 [B, nq, 8, bq] (row 0 KL, row 1 student lse, row 2 sum P, row 3 non-empty; 0 on empty and padding rows)
      and, with kl.emit_gradient, G = softmax_V(I) * sum P - P in the logits' dtype [B, S_p, N_p] (0 outside V).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    b, s_p, h, d = q.shape
    n_p = kv.shape[1]
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    nq, nk, nh = s_p // bq, n_p // bk, h // hc
    group = common.head_group(h, hc, q.dtype)
    layout = common.row_layout(h, hc, bq, q.dtype)
    cached = cfg.cache_scores and mode != "full_lse"
    steps = nk if mode == "full_lse" else (nk + 1 if cached else 2 * nk)  # cached: pass 2 is one step
    # Causal cached single-chunk runs walk query tiles in pairs (qi, nq-1-qi), each pair with the same number of
    # steps, instead of nk + 1 steps per tile of which the early tiles leave most idle (~200 bundles each).
    # Head chunks (nh > 1) would revisit an output block after the other tile of the pair: not paired.
    pairs = cached and schedule.causal and nh == 1 and _pairs_fit(schedule)
    if pairs:
        steps = _pair_steps(schedule)

    if mode == "full_lse":
        step_to_k = lambda step: step
    elif cached:  # pass 2 reads VMEM: keep the last block resident
        step_to_k = lambda step: jnp.minimum(step, nk - 1)
    else:
        step_to_k = lambda step: jnp.where(step < nk, step, step - nk)
    maps = common.teacher_index_maps(nq=nq, head_chunk=hc, group=group, schedule=schedule, step_to_k=step_to_k)
    if pairs:
        maps = _pair_index_maps(head_chunk=hc, group=group, schedule=schedule)

    in_specs = [
        pl.BlockSpec((None, bq, group, d), maps["q"]),
        pl.BlockSpec((None, bk, d), maps["kv"]),
        pl.BlockSpec((None, bq, common.LANES), maps["row"]),
        pl.BlockSpec((None, common.SUBLANES, bk), maps["kmeta"]),
    ]
    if schedule.causal:  # the kernel masks from iota positions: no metadata blocks to copy in every step
        in_specs[2:4] = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    operands = [q, kv, qmeta, kmeta]
    if mode != "per_head":
        in_specs.append(pl.BlockSpec((None, None, None, *layout.view), maps["lse"]))
        operands.append(lse_in)
    out_specs = pl.BlockSpec((None, bq, n_p), maps["row"])
    out_shape = jax.ShapeDtypeStruct((b, s_p, n_p), jnp.float32)
    if kl is not None:
        batch_of = lambda p, c, step, firsts_ref, counts_ref: common.index_div(p, nq)
        krow = (pl.BlockSpec(memory_space=pl.ANY) if schedule.causal
                else pl.BlockSpec((None, common.SUBLANES, n_p), lambda *ids: (batch_of(*ids), 0, 0)))
        logits_spec, out_specs, out_shape = fused_kl.fused_kl_blocks(kl, logits, maps["row"], block_q=bq)
        in_specs += [logits_spec, krow]
        operands += [logits, kmeta]
    lanes = min(common.LANES, bk)
    scratch = [
        pltpu.VMEM((*layout.view, lanes), jnp.float32),
        pltpu.VMEM((*layout.view, lanes), jnp.float32),
        pltpu.VMEM((*layout.view, common.LANES), jnp.float32),  # F, replicated over lanes: no per-step broadcast
    ]
    if not layout.token_major:
        scratch.append(pltpu.VMEM((hc * bq, d), q.dtype))
    if cached:
        scratch.append(pltpu.VMEM((nk, *layout.view, bk), jnp.float32))
    if kl is not None:
        scratch.append(pltpu.VMEM((bq, n_p), jnp.float32))
    kernel = functools.partial(_kernel, mode=mode, cache_scores=cached, schedule=schedule, nh=nh, layout=layout,
                               group=group, scale=scale, normalize=normalize, pairs=pairs, kl=kl)
    flops = 2 * b * s_p * h * n_p * d * (1 if cached or mode == "full_lse" else 2)
    order = "tok" if layout.token_major else "head"
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b * (nq // 2 if pairs else nq), nh, steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=flops // 2, transcendentals=b * s_p * h * n_p,
                                      bytes_accessed=q.size * q.dtype.itemsize + b * s_p * n_p * 4),
        interpret=interpret,
        name=f"csa_teacher_{mode}_bq{bq}_bk{bk}_hc{hc}_{order}{'_cached' if cached else ''}{'_kl' if kl else ''}",
    )(firsts, counts, *operands)
