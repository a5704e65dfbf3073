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
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, fused_kl, rebase, runtime, selection, slot_counts
from csa_pallas.kernels import schedule as schedule_lib
from csa_pallas.kernels.teacher_config import (TeacherConfig, resolve_row_layout, resolve_straight_pass2,
                                               resolve_walk)

MODES = rebase.MODES
EMPTY_SLOT = selection.EMPTY_SLOT  # sparse mode: the value of empty slots in P
MiB = common.MiB
LOG2E = common.LOG2E


def normalize_rows(head_sum: jax.Array) -> jax.Array:
    """The kernel's final L1 normalisation, in XLA, for head sums built from several shards: f32 [..., N]."""
    total = jnp.sum(head_sum, axis=-1, keepdims=True)
    return head_sum / jnp.maximum(total, common.F32_TINY)


def _kernel(*refs, mode, walk: schedule_lib.TeacherWalk, nh, layout, group, scale, normalize, straight_pass2,
            seq_len: int, kl: Optional[fused_kl.FusedKL] = None, sel: Optional["SlotSelection"] = None):
    schedule = walk.schedule
    cache_scores = walk.cached_pass2
    pairs = walk.paired
    refs = list(refs)
    firsts_ref, counts_ref = refs.pop(0), refs.pop(0)
    tables_ref = refs.pop(0) if sel is not None else None  # `selection.tile_tables`
    q_ref, kv_ref, qmeta_ref, kmeta_ref = refs.pop(0), refs.pop(0), refs.pop(0), refs.pop(0)
    idx_ref = idxq_ref = bits_ref = vbits_ref = vbitsq_ref = None
    if sel is not None:  # top-k indices and slot bits of the output tile and of the pass-1 tile; its block bits
        idx_ref, idxq_ref, vbits_ref, vbitsq_ref, bits_ref = [refs.pop(0) for _ in range(5)]
    lse_ref = shift_ref = None
    if mode != "per_head":
        lse_ref, shift_ref = refs.pop(0), refs.pop(0)  # (u or F) - sigma and sigma, see `rebase`
    rowmax_ref = None
    if kl is None:
        krow_ref = refs.pop(0) if normalize else None  # the whole row of key metadata: V(t) at normalisation
        out_ref = refs.pop(0)  # the head sum accumulates in the resident output block
        if not normalize:
            rowmax_ref = refs.pop(0)  # the rows' M (base 2): shards of the heads combine their sums with it
    else:
        logits_ref, krow_ref, stats_ref = refs.pop(0), refs.pop(0), refs.pop(0)
        grad_ref = refs.pop(0) if kl.emit_gradient else None
    m_ref, l_ref, f_ref, *extra = refs
    rows_ref = None if layout.token_major else extra.pop(0)
    cache_ref = extra.pop(0) if cache_scores else None
    if kl is not None:
        out_ref = extra.pop(0)  # f32 head-sum accumulator [bq, N_p] in scratch: the outputs are KL stats and dI
    seen_ref = None if (schedule.causal or sel is not None) else extra.pop(0)  # [bq, 1]: the row saw a block
    top_ref = extra.pop(0) if (nh > 1 or rowmax_ref is not None) else None  # running M [bq, 128] over chunks
    weight_ref = extra.pop(0) if sel is not None else None  # [bq, bk] exact slot weights of a duplicate tile
    idx_t_ref = extra.pop(0) if sel is not None and sel.fold else None  # transposed indices for those weights
    bq, bk, hc = layout.block_q, schedule.block_k, layout.head_chunk
    lanes = min(common.LANES, bk)
    two_pass = True  # every mode needs C (pass 1): full_lse too, for the rebased head weights

    at = schedule_lib.kernel_view(walk, firsts_ref, counts_ref)
    first_step = at.first_step
    out_qi = at.out_qi
    qi, c, step, in_pass1, k, tile, active = at.qi, at.c, at.step, at.in_pass1, at.k, at.tile, at.active
    # With pairs (one head chunk), the first tile's last step is the second tile's first pass-1 step (k == 0).
    epilogue_in_pass1 = pairs and kl is not None
    # Merged pairs: the second tile's pass 2 (and epilogue) follow its own last pass-1 work in the same step.
    # (At its pass-2 step a merged pair's first tile is at k == 0 of the second tile's walk, the second at k > 0.)
    merged = walk.kind == "merged"
    own_pass2 = jnp.logical_not(first_step) if merged else False

    def fused_epilogue():
        if sel is not None:  # V(t) = the output tile's valid slots
            fused_kl.kl_epilogue(kl, out_ref, logits_ref, stats_ref, grad_ref, mask_target=True,
                                 visible_at=picks.valid_slots)
            return
        visible_at, nonempty = _dense_visibility(kl.seq_len, qmeta_ref, krow_ref, qi=out_qi, schedule=schedule)
        fused_kl.kl_epilogue(kl, out_ref, logits_ref, stats_ref, grad_ref, visible_at=visible_at,
                             nonempty_rows=nonempty)

    if sel is not None:
        picks = selection.InKernel(sel, tables_ref, bits_ref, idx_ref, idxq_ref, vbits_ref, vbitsq_ref, weight_ref,
                                   idx_t_ref, b=at.b, qi=qi, tile=tile, nq=schedule.nq, block_q=bq, block_k=bk)

    # Pairs (one head chunk): the output block is zeroed by the step that accumulates it, right before pass 2.
    @pl.when((step == at.last_step) if pairs else ((c == 0) & (step == 0)))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)
        if top_ref is not None:  # a query tile that visits no kv tile keeps M = -inf
            top_ref[...] = jnp.full(top_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(first_step)
    def _():
        if not layout.token_major:
            common.gather_head_rows(q_ref, rows_ref, c, head_chunk=hc, group=group, block_q=bq)
        if sel is not None:
            picks.prepare()

    # Causal diagonal tiles are computed only up to the last 128-lane chunk the query tile can see: chunks past
    # it would be all -inf (at bk = 256, m = 4, bq = 64 this skips 1/10 of the matmul work).
    chunk = common.LANES if schedule.causal and bk > common.LANES else bk
    # The pass-1 tile's visible width, computed once up front (not re-derived inside each branch).
    pass1_width = schedule.visible_width(qi, tile, chunk) if chunk != bk else bk

    def scores(masked: bool, width: int, seen_first=None):
        """Scaled scores (base 2: times log2 e) of the step's rows against the first `width` blocks of the kv
        tile: f32 [*view, width]. seen_first (pass 1 with metadata masks): record which rows saw a block, starting
        afresh (True, the tile's first kv tile) or adding to the record (False)."""
        rows = q_ref[...].reshape(layout.rows, -1) if layout.token_major else rows_ref[...]
        kv = kv_ref[...] if width == bk else kv_ref[:width, :]
        z = lax.dot_general(rows, kv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        z = (z * (scale * LOG2E)).reshape(*layout.view, width)
        if sel is not None:  # the selection holds V(t): unselected blocks are -inf (their weight)
            return jnp.where(layout.expand_mask(picks.mask(width)), z, -jnp.inf)
        if not masked:
            return z
        if schedule.causal:  # default ids: query t sees block j once it is complete, (j + 1) * m - 1 <= t
            t = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, width), 0)
            j = tile * bk + lax.broadcasted_iota(jnp.int32, (bq, width), 1)
            visible = ((j + 1) * schedule.ratio - 1 <= t) & (j < schedule.num_blocks)
        else:
            visible = ((kmeta_ref[0:1, :width] == qmeta_ref[:, 0:1])
                       & (kmeta_ref[1:2, :width] <= qmeta_ref[:, 1:2]))  # [bq, width]
            if seen_first is not None:  # pass 1: which rows saw a block (a -inf C is then a poisoned row)
                seen = jnp.max(visible.astype(jnp.float32), axis=1, keepdims=True)
                seen_ref[...] = seen if seen_first else jnp.maximum(seen_ref[...], seen)
        return jnp.where(layout.expand_mask(visible), z, -jnp.inf)

    def when_active(cond, body):
        """Runs body(masked, width) under cond & active. Causal schedule: tiles every query fully sees skip the
        mask; the diagonal tile runs only its visible chunks."""
        if not schedule.causal:
            pl.when(cond & active)(functools.partial(body, True, bk))
            return
        full = schedule.full(qi, tile)
        if sel is not None:  # a selection always masks
            full = False
        else:
            pl.when(cond & active & full)(functools.partial(body, False, bk))
        partial = cond & active & jnp.logical_not(full)
        if chunk == bk:
            pl.when(partial)(functools.partial(body, True, bk))
            return
        width = pass1_width
        for w in range(chunk, bk + 1, chunk):
            pl.when(partial & (width == w))(functools.partial(body, True, w))

    def row_seen():
        """bool [bq, 1]: the pass-1 tile's rows that see some block."""
        if sel is not None:
            return picks.rows_with_slots()
        if schedule.causal:  # block 0 is complete at t = m - 1
            t = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
            return (t >= schedule.ratio - 1) & (schedule.num_blocks > 0)
        return seen_ref[...] > 0

    def finish_f(m=None, l=None):
        """The pass-2 exponent shift G (base 2, `rebase.finish`) from the pass-1 statistics (default: m_ref,
        l_ref), replicated over lanes: f32 [*view, 128], also stored in f_ref. With several head chunks, the running
        row max M of the chunks so far is updated and the sums they accumulated are rescaled to it."""
        m = m_ref[...] if m is None else m
        l = l_ref[...] if l is None else l
        seen = row_seen()
        c2 = rebase.compressed_log2_mass(m, l, layout.query_to_view(seen))  # [*view, 1]
        running = None
        if top_ref is not None:
            def rescale(factor):
                if nh > 1:
                    pl.when(c > 0)(lambda: common.scale_rows(out_ref, factor))
            previous = top_ref[...] if nh > 1 else jnp.full((bq, common.LANES), -jnp.inf, jnp.float32)
            running = (previous, rescale)
        lse_block = shift_row = None
        if mode != "per_head":
            lse_block, shift_row = lse_ref[...].astype(jnp.float32), shift_ref[0:1, :]
        g, top = rebase.finish(mode, layout, c2, lse_block=lse_block, shift_row=shift_row, seen_rows=seen,
                               running=running)
        if top_ref is not None:
            top_ref[...] = top
        f = jnp.broadcast_to(g, f_ref.shape)
        f_ref[...] = f
        return f

    def dispatch(body):
        """Runs body(masked, width) for the step's tile, whose visit the caller has checked (causal schedule:
        as when_active)."""
        if not schedule.causal:
            body(True, bk)
            return
        full = schedule.full(qi, tile)
        if sel is not None:  # a selection always masks
            full = False
        else:
            pl.when(full)(functools.partial(body, False, bk))
        if chunk == bk:
            pl.when(jnp.logical_not(full))(functools.partial(body, True, bk))
            return

        @pl.when(jnp.logical_not(full))
        def _():
            width = pass1_width
            for w in range(chunk, bk + 1, chunk):
                pl.when(width == w)(functools.partial(body, True, w))

    def probs_of(z):
        """sum over the chunk's heads of 2^(z - G): f32 [bq, width] (z: [*view, width])."""
        f = f_ref[...][..., :lanes]
        return jnp.concatenate([jnp.sum(jnp.exp2(z_lanes - f), axis=layout.head_axis)
                                for z_lanes in common.lane_chunks(z, lanes)], axis=1)

    def cached_pass2():
        """All of the query tile's cached tiles in one grid step (no per-tile step overhead); F is ready."""

        def accumulate(tile_k, z):
            if sel is not None:  # sum_h 2^(z - G) of the tile's blocks, written in slot order
                picks.when_selected(out_qi, tile_k, lambda: picks.gather_to_slots(out_ref, probs_of(z), tile_k))
                return
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

        if straight_pass2:
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
            if seen_ref is not None:
                seen_ref[...] = jnp.zeros(seen_ref.shape, jnp.float32)

        def pass1(first, last, finalize, masked, width):
            if sel is not None:  # an unselected tile only does what its walk position asks of it
                picks.when_selected(qi, tile, functools.partial(pass1_work, first, last, finalize, masked, width),
                                    otherwise=functools.partial(pass1_skipped, first, last, finalize))
                return
            pass1_work(first, last, finalize, masked, width)

        def pass1_skipped(first, last, finalize):
            if first:
                m_ref[...] = jnp.full(m_ref.shape, common.STAT_FLOOR, jnp.float32)
                l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            if last:
                finish_f()
            if finalize:
                fused_epilogue()

        def pass1_work(first, last, finalize, masked, width):
            z = scores(masked, width, seen_first=first if seen_ref is not None else None)
            # Duplicated indices weigh their block by its slot count (in the LSE only: the cached scores and
            # pass 2 give each slot its own share).
            z_lse = z if sel is None else picks.weighted(z, width, layout)
            # The last update feeds F directly: its statistics never go back to VMEM.
            stats = common.online_lse_update(m_ref, l_ref, z_lse, lanes, first=first, base2=True, store=not last)
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

        if sel is not None:  # a tile of a query tile with a duplicated index: exact slot counts first
            picks.exact_weights(in_pass1 & active)

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
        if sel is not None:
            picks.when_selected(qi, tile, functools.partial(pass2_work, first, masked, width),
                                otherwise=finish_f if first else None)
            return
        pass2_work(first, masked, width)

    def pass2_work(first, masked, width):
        z = scores(masked, width)  # (cached scores: `cached_pass2`)
        if sel is not None:
            if first:
                finish_f()
            picks.gather_to_slots(out_ref, probs_of(z), tile)
            return
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

    if not cache_scores:  # G is computed in the first pass-2 step (a query tile with no visited tile needs none)
        when_active(jnp.logical_not(in_pass1) & (k == 0), functools.partial(pass2, True))
        when_active(jnp.logical_not(in_pass1) & (k > 0), functools.partial(pass2, False))

    if kl is not None:
        # Pairs: the first tile's epilogue runs inside the second tile's first pass-1 step (see pass1).
        standalone = (step == at.last_step) & (jnp.logical_not(active) | own_pass2) if epilogue_in_pass1 else (
            (c == nh - 1) & (step == at.last_step))
        pl.when(standalone)(fused_epilogue)
    elif sel is not None:
        @pl.when((c == nh - 1) & (step == at.last_step))
        def _():
            selection.write_slots(out_ref, out_ref[...], picks.valid_slots(0, sel.width_p), normalize=normalize,
                                  rowmax_ref=rowmax_ref, top_column=None if normalize else top_ref[:, :1])
    elif normalize:
        @pl.when((c == nh - 1) & (step == at.last_step))
        def _():
            acc = out_ref[...]
            total = jnp.sum(acc, axis=1, keepdims=True)
            # 0 outside V(t), also on a NaN row (there pass 2's exp2(-inf - NaN) is NaN on every entry).
            visible_at, _ = _dense_visibility(seq_len, qmeta_ref, krow_ref, qi=out_qi,
                                              schedule=schedule)
            out_ref[...] = jnp.where(visible_at(0, acc.shape[1]), acc / jnp.maximum(total, common.F32_TINY), 0.0)
    else:  # the head sum stays unnormalised; the rows' M goes out with it
        @pl.when((c == nh - 1) & (step == at.last_step))
        def _():
            rows = common.column_to_rows(top_ref[:, :1], 1)  # [1, bq]
            rowmax_ref[...] = jnp.concatenate([rows, jnp.zeros((common.SUBLANES - 1, bq), jnp.float32)], axis=0)


def _dense_visibility(seq_len: int, qmeta_ref, krow_ref, *, qi, schedule: schedule_lib.TileSchedule):
    """(visible_at(start, width) -> bool [bq, width], non-empty rows [bq, 1] or None) for the dense support V(t);
    seq_len: the real query rows (later rows are padding and see nothing)."""
    bq = schedule.block_q
    if schedule.causal:  # row t sees blocks j < limit[t] (complete blocks, real rows only)
        t = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        limit = jnp.minimum(common.index_div(t + 1, schedule.ratio), schedule.num_blocks)
        limit = jnp.where(t < seq_len, limit, 0)
        return (lambda start, width: start + lax.broadcasted_iota(jnp.int32, (bq, width), 1) < limit), limit > 0

    def visible_at(start, width):
        segment = krow_ref[0:1, pl.ds(start, width)]
        end = krow_ref[1:2, pl.ds(start, width)]
        return (segment == qmeta_ref[:, 0:1]) & (end <= qmeta_ref[:, 1:2])

    return visible_at, None


def teacher_pallas(q, kv, qmeta, kmeta, firsts, counts, lse_in, *, mode: str, cfg: TeacherConfig, scale: float,
                   schedule: schedule_lib.TileSchedule, normalize: bool = True,
                   kl: Optional[fused_kl.FusedKL] = None, logits=None, seq_len: Optional[int] = None,
                   picks=None, interpret=False):
    """Runs the dense teacher kernel on padded, prepared inputs.

    Args:
      q: [B, S_p, H, D] (bf16/f32), S_p a multiple of cfg.block_q.
      kv: [B, N_p, D] same dtype as q, N_p a multiple of cfg.block_k.
      qmeta: int32 [B, S_p, 128]; kmeta: int32 [B, 8, N_p] (see `common`).
      firsts, counts: per-query-tile kv-tile ranges from `common.tile_ranges` (ignored when schedule.causal).
      lse_in: None (per_head), or (u - sigma, sigma) (joint) / (F - sigma, sigma) (full_lse), each f32 in the row
        layout's HBM form (`common.row_layout(...).stats_to_hbm`); sigma is a per-row shift (`rebase`).
      mode: "per_head" | "joint" | "full_lse".
      normalize: False returns the head sum unnormalised and the rows' max head weight M (heads sharded over
        devices: the caller rescales the shards' sums to a common M, adds them and normalises once).
      kl, logits: the fused KL (the loss path): logits I [B, S_p, N_p] (any float dtype, padding anything).
      seq_len: the real query rows S (default S_p; rows past it are padding, 0 in P).
      picks: sparse mode, (idx, vbits, bits, tables) from `selection`: the top-k indices int32 [B, S_p, K_p] (any
        values), the slot bits int32 [B, S_p, K_p / 32] (V(t)), the block bits int32 [B, S_p, W_p], the
        per-query-tile flags; cfg.block_k a multiple of 128 dividing 4096. The kernel then reads V(t) from them
        (qmeta/kmeta are not read) and P is in slot order.

    Returns:
      P, f32 [B, S_p, N_p] (sparse: [B, S_p, K_p], EMPTY_SLOT on empty slots), rows L1-normalised (0 outside
      V(t) and on empty rows, NaN on rows that read a non-finite input). normalize=False: (head sum f32 [B, S_p, N_p], M f32 [B, nq, 8, bq] in row 0, base 2).
      With `kl`: the KL statistics f32 [B, nq, 8, bq] (row 0 KL, row 1 student lse, row 2 sum P, row 3
      non-empty; 0 on empty and padding rows) and, with kl.emit_gradient, G = softmax_V(I) * sum P - P in the
      logits' dtype [B, S_p, N_p] (0 outside V).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    b, s_p, h, d = q.shape
    n_p = kv.shape[1]
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    nq, nk, nh = s_p // bq, n_p // bk, h // hc
    group = common.head_group(h, hc, q.dtype)
    layout = resolve_row_layout(cfg, h, q.dtype)
    if not layout.token_major and group != hc and hc % common.sublane_multiple(q.dtype) == 0:
        group = hc  # a forced head-major copy of a legal chunk reads the chunk itself
    cached = cfg.cache_scores
    seq_len = s_p if seq_len is None else seq_len
    if kl is not None:
        seq_len = kl.seq_len
    # Causal cached single-chunk runs walk query tiles in pairs (qi, nq-1-qi), each pair with the same number of
    # steps, instead of nk + 1 steps per tile of which the early tiles leave most idle (~200 bundles each).
    kind = resolve_walk(cfg, schedule, cached=cached, num_chunks=nh, normalize=normalize or kl is not None,
                        sparse=picks is not None)
    walk = schedule_lib.TeacherWalk(schedule, kind=kind, cached_pass2=cached or kind != "plain")
    straight_pass2 = resolve_straight_pass2(cfg, schedule, cached)
    maps = walk.index_maps(head_chunk=hc, group=group)
    sel = None
    width_p = n_p
    if picks is not None:
        idx, vbits, bits, tables = picks
        width_p = idx.shape[2]
        if bk % common.LANES or 4096 % bk:
            raise ValueError(f"block_k: sparse mode needs a multiple of {common.LANES} dividing 4096, got {bk}")
        can_fold = slot_counts.slot_fold_width(bq) if bk % (slot_counts.COUNTER_FIELDS * common.SUBLANES) == 0 else 0
        if cfg.slot_fold and not can_fold:
            raise ValueError(f"slot_fold: the transposed counts need block_q ({bq}) to divide or be a multiple of "
                             f"128 and block_k ({bk}) a multiple of {slot_counts.COUNTER_FIELDS * common.SUBLANES}")
        sel = selection.SlotSelection(width_p=width_p, table_words=1 + common.cdiv(nk, selection.WORD_BITS),
                                      fold=can_fold if cfg.slot_fold is None or cfg.slot_fold else 0)
        # a third scalar prefetch (the tables): the walk's maps take the first two
        maps = {name: (lambda m: lambda p, c, step, firsts_ref, counts_ref, tables_ref: m(
            p, c, step, firsts_ref, counts_ref))(m) for name, m in maps.items()}

    in_specs = [
        pl.BlockSpec((None, bq, group, d), maps["q"]),
        pl.BlockSpec((None, bk, d), maps["kv"]),
        pl.BlockSpec((None, bq, common.LANES), maps["row"]),
        pl.BlockSpec((None, common.SUBLANES, bk), maps["kmeta"]),
    ]
    if schedule.causal or sel is not None:  # masks from iota positions or the selection: no metadata blocks
        in_specs[2:4] = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    if sel is not None:  # never read: a placeholder left in HBM
        qmeta = kmeta = jnp.zeros((1, common.SUBLANES, common.LANES), jnp.int32)
    operands = [q, kv, qmeta, kmeta]
    if sel is not None:
        nw = vbits.shape[2]
        in_specs += [pl.BlockSpec((None, bq, width_p), maps["row"]), pl.BlockSpec((None, bq, width_p), maps["qrow"]),
                     pl.BlockSpec((None, bq, nw), maps["row"]), pl.BlockSpec((None, bq, nw), maps["qrow"]),
                     pl.BlockSpec((None, bq, bits.shape[2]), maps["qrow"])]
        operands += [idx, idx, vbits, vbits, bits]
    if mode != "per_head":
        in_specs += [pl.BlockSpec((None, None, None, *layout.view), maps["lse"]),
                     pl.BlockSpec((None, None, common.SUBLANES, bq), maps["qstats"])]
        operands += list(lse_in)
    out_specs = pl.BlockSpec((None, bq, width_p), maps["row"])
    out_shape = jax.ShapeDtypeStruct((b, s_p, width_p), jnp.float32)
    batch_of = lambda p, *_: common.index_div(p, walk.rows)
    krow = (pl.BlockSpec(memory_space=pl.ANY) if schedule.causal
            else pl.BlockSpec((None, common.SUBLANES, n_p), lambda *ids: (batch_of(*ids), 0, 0)))
    if kl is None and not normalize:
        out_specs = [out_specs, pl.BlockSpec((None, None, common.SUBLANES, bq), maps["stats"])]
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, nq, common.SUBLANES, bq), jnp.float32)]
    elif kl is None:
        in_specs.append(krow if sel is None else pl.BlockSpec(memory_space=pl.ANY))
        operands.append(kmeta)
    if kl is not None:
        logits_spec, out_specs, out_shape = fused_kl.fused_kl_blocks(kl, logits, maps["row"], block_q=bq)
        in_specs += [logits_spec, krow if sel is None else pl.BlockSpec(memory_space=pl.ANY)]
        operands += [logits, kmeta]
    lanes = min(common.LANES, bk)
    scratch = [
        pltpu.VMEM((*layout.view, lanes), jnp.float32),
        pltpu.VMEM((*layout.view, lanes), jnp.float32),
        pltpu.VMEM((*layout.view, common.LANES), jnp.float32),  # G, replicated over lanes: no per-step broadcast
    ]
    if not layout.token_major:
        scratch.append(pltpu.VMEM((hc * bq, d), q.dtype))
    if cached:
        scratch.append(pltpu.VMEM((nk, *layout.view, bk), jnp.float32))
    if kl is not None:
        scratch.append(pltpu.VMEM((bq, width_p), jnp.float32))
    if not schedule.causal and sel is None:
        scratch.append(pltpu.VMEM((bq, 1), jnp.float32))  # rows that saw a block
    if nh > 1 or (kl is None and not normalize):
        scratch.append(pltpu.VMEM((bq, common.LANES), jnp.float32))  # running M over head chunks
    if sel is not None:
        scratch.append(pltpu.VMEM((bq, bk), jnp.float32))  # exact slot weights of a tile with duplicates
        if sel.fold:
            scratch.append(pltpu.VMEM((width_p // sel.fold, sel.fold * bq), jnp.int32))
    kernel = functools.partial(_kernel, mode=mode, walk=walk, nh=nh, layout=layout, group=group, scale=scale,
                               normalize=normalize, straight_pass2=straight_pass2, kl=kl, seq_len=seq_len, sel=sel)
    order = "tok" if layout.token_major else "head"
    return runtime.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2 if sel is None else 3,
            grid=(b * walk.rows, nh, walk.steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=cost_estimate(q, kv, schedule, batch=b, head_chunk=hc, matmuls=1 if cached else 2,
                                    lse_inputs=0 if mode == "per_head" else 1, kl=kl, logits=logits,
                                    output_bytes=0 if kl is not None else b * s_p * width_p * 4,
                                    extra_bytes=0 if sel is None else 2 * (idx.size + vbits.size) * 4
                                    + bits.size * 4),
        interpret=interpret,
        name=f"csa_{'sparse_' if sel else ''}teacher_{mode}_bq{bq}_bk{bk}_hc{hc}_{order}_{kind}"
             f"{'_cached' if cached else ''}{'_kl' if kl else ''}",
    )(firsts, counts, *([] if sel is None else [tables]), *operands)


def visited_tiles(schedule: schedule_lib.TileSchedule, batch: int) -> int:
    """kv tiles the walk visits per (head chunk, pass) over the whole batch: exact for the causal schedule, all
    nq * nk tiles (an upper bound) when the ranges come from the ids at run time."""
    if schedule.causal:
        return batch * sum(schedule.static_count(i) for i in range(schedule.nq))
    return batch * schedule.nq * schedule.nk


def cost_estimate(q, kv, schedule: schedule_lib.TileSchedule, *, batch: int, head_chunk: int, matmuls: int,
                  lse_inputs: int, kl, logits, output_bytes: int, extra_bytes: int = 0) -> pl.CostEstimate:
    """HBM bytes and flops of a teacher launch: q once per query tile, each visited kv tile once per (head chunk,
    walked pass), the statistics inputs, logits in and G out (fused KL) or P out, plus extra_bytes (e.g. top-k
    indices). Causal schedules are exact; table schedules count every tile (an upper bound)."""
    _, s_p, h, d = q.shape
    nh = h // head_chunk
    tiles = visited_tiles(schedule, batch)
    rows = schedule.block_q * h  # all chunks of a query tile
    flops = 2 * rows * schedule.block_k * d * tiles * matmuls
    kv_bytes = tiles * nh * matmuls * schedule.block_k * d * kv.dtype.itemsize
    stats_bytes = lse_inputs * batch * s_p * h * 4
    kl_bytes = 0
    if kl is not None:
        kl_bytes = logits.size * logits.dtype.itemsize * (2 if kl.emit_gradient else 1) + batch * s_p * 8 * 4
    return pl.CostEstimate(flops=flops, transcendentals=rows * schedule.block_k * tiles * 2,
                           bytes_accessed=q.size * q.dtype.itemsize + kv_bytes + stats_bytes + kl_bytes
                           + output_bytes + extra_bytes)
