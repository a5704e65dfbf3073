"""The teacher kernel's body (`teacher.py` launches it) as named phases over one grid step.

`TeacherStep` holds the step's refs (named once by `teacher_refs`, in the order `teacher.teacher_pallas` passes
them), the decoded walk position (`schedule.kernel_view`) and the static variant; `kernel` runs its phases in order:

  init            zero the resident output block and the running row max; gather the head-major rows and prepare
                  the selection on the first step of a query tile
  pass 2 (cached) all of an output tile's cached score tiles in one step (looped, or straight-line per tile count)
  pass 1          the online log-sum-exp over the query tile's kv tiles; the last update computes G (`finish_f`),
                  and with pairs the previous tile's fused KL epilogue shares the step
  pass 2 (walked) without the score cache: a second matmul per kv tile
  finish          the fused KL epilogue, or the L1 normalisation / slot-order write / row max of the output block

Tiles are visited through `visit_tile` (full tiles unmasked, the causal diagonal tile only up to its last visible
128-lane chunk). The op order inside a step is what the kernel fingerprints (`tests/test_fingerprints.py`) pin.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from csa_pallas.kernels import common, fused_kl, rebase, selection, teacher_refs
from csa_pallas.kernels import schedule as schedule_lib

LOG2E = common.LOG2E


class TeacherStep:
    """One grid step of the teacher kernel: refs, walk position, static variant, and the phases."""

    def __init__(self, refs, *, mode, walk: schedule_lib.TeacherWalk, nh, layout, group, scale, normalize,
                 straight_pass2, seq_len: int, kl: Optional[fused_kl.FusedKL] = None, sel=None):
        self.mode, self.walk, self.nh, self.layout, self.group, self.scale = mode, walk, nh, layout, group, scale
        self.normalize, self.straight_pass2, self.seq_len, self.kl, self.sel = (normalize, straight_pass2, seq_len,
                                                                                kl, sel)
        self.schedule = schedule = walk.schedule
        self.cache_scores = walk.cached_pass2
        self.pairs = walk.paired
        # The refs by name (`teacher_refs`: the launch's order), as attributes of the step.
        named = teacher_refs.unpack(refs, mode=mode, kl=kl, sel=sel, normalize=normalize,
                                    token_major=layout.token_major, cached=self.cache_scores,
                                    causal=schedule.causal, nh=nh)
        vars(self).update({f.name: getattr(named, f.name) for f in dataclasses.fields(named)})
        self.bq, self.bk, self.hc = layout.block_q, schedule.block_k, layout.head_chunk
        self.lanes = min(common.LANES, self.bk)

        self.at = at = schedule_lib.kernel_view(walk, self.firsts_ref, self.counts_ref)
        self.first_step, self.out_qi = at.first_step, at.out_qi
        self.qi, self.c, self.step, self.in_pass1 = at.qi, at.c, at.step, at.in_pass1
        self.k, self.tile, self.active = at.k, at.tile, at.active
        # With pairs (one head chunk), the first tile's last step is the second tile's first pass-1 step (k == 0).
        self.epilogue_in_pass1 = self.pairs and kl is not None
        # Merged pairs: the second tile's pass 2 (and epilogue) follow its own last pass-1 work in the same step.
        # (At its pass-2 step a merged pair's first tile is at k == 0 of the second tile's walk, the second at k > 0.)
        self.merged = walk.kind == "merged"
        self.own_pass2 = jnp.logical_not(self.first_step) if self.merged else False
        self.picks = None
        if sel is not None:
            self.picks = selection.InKernel(sel, self.tables_ref, self.bits_ref, self.idx_ref, self.idxq_ref,
                                            self.vbits_ref, self.vbitsq_ref, self.weight_ref, self.idx_t_ref, b=at.b,
                                            qi=self.qi, tile=self.tile, nq=schedule.nq, block_q=self.bq,
                                            block_k=self.bk)

    # ------------------------------------------------------------------------------------------ helpers

    def fused_epilogue(self):
        kl = self.kl
        if self.sel is not None:  # V(t) = the output tile's valid slots
            fused_kl.kl_epilogue(kl, self.out_ref, self.logits_ref, self.stats_ref, self.grad_ref, mask_target=True,
                                 visible_at=self.picks.valid_slots)
            return
        visible_at, nonempty = schedule_lib.dense_visibility(kl.seq_len, self.qmeta_ref, self.krow_ref,
                                                             qi=self.out_qi, schedule=self.schedule)
        fused_kl.kl_epilogue(kl, self.out_ref, self.logits_ref, self.stats_ref, self.grad_ref, visible_at=visible_at,
                             nonempty_rows=nonempty)

    def scores(self, masked: bool, width: int, seen_first=None):
        """Scaled scores (base 2: times log2 e) of the step's rows against the first `width` blocks of the kv
        tile: f32 [*view, width]. seen_first (pass 1 with metadata masks): record which rows saw a block, starting
        afresh (True, the tile's first kv tile) or adding to the record (False)."""
        layout, schedule, bq, bk = self.layout, self.schedule, self.bq, self.bk
        rows = self.q_ref[...].reshape(layout.rows, -1) if layout.token_major else self.rows_ref[...]
        kv = self.kv_ref[...] if width == bk else self.kv_ref[:width, :]
        z = lax.dot_general(rows, kv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        z = (z * (self.scale * LOG2E)).reshape(*layout.view, width)
        if self.sel is not None:  # the selection holds V(t): unselected blocks are -inf (their weight)
            return jnp.where(layout.expand_mask(self.picks.mask(width)), z, -jnp.inf)
        if not masked:
            return z
        if schedule.causal:  # default ids: query t sees block j once it is complete, (j + 1) * m - 1 <= t
            t = self.qi * bq + lax.broadcasted_iota(jnp.int32, (bq, width), 0)
            j = self.tile * bk + lax.broadcasted_iota(jnp.int32, (bq, width), 1)
            visible = ((j + 1) * schedule.ratio - 1 <= t) & (j < schedule.num_blocks)
        else:
            kmeta_ref, qmeta_ref = self.kmeta_ref, self.qmeta_ref
            visible = ((kmeta_ref[0:1, :width] == qmeta_ref[:, 0:1])
                       & (kmeta_ref[1:2, :width] <= qmeta_ref[:, 1:2]))  # [bq, width]
            if seen_first is not None:  # pass 1: which rows saw a block (a -inf C is then a poisoned row)
                seen = jnp.max(visible.astype(jnp.float32), axis=1, keepdims=True)
                self.seen_ref[...] = seen if seen_first else jnp.maximum(self.seen_ref[...], seen)
        return jnp.where(layout.expand_mask(visible), z, -jnp.inf)

    def visit_tile(self, body, cond=None):
        """Runs body(masked, width) for the step's kv tile: full tiles of the causal schedule unmasked, the
        diagonal tile only over its visible 128-lane chunks (one branch per width), everything masked otherwise.
        cond=None: the caller already checked the visit (the branches nest under "not full"); else each branch
        is guarded by cond & active."""
        schedule, bk, chunk, active = self.schedule, self.bk, self.chunk, self.active
        if not schedule.causal:
            if cond is None:
                body(True, bk)
            else:
                pl.when(cond & active)(functools.partial(body, True, bk))
            return
        full = schedule.full(self.qi, self.tile)
        if self.sel is not None:  # a selection always masks
            full = False
        else:
            pl.when(full if cond is None else cond & active & full)(functools.partial(body, False, bk))
        if cond is not None:
            partial = cond & active & jnp.logical_not(full)
            if chunk == bk:
                pl.when(partial)(functools.partial(body, True, bk))
                return
            width = self.pass1_width
            for w in range(chunk, bk + 1, chunk):
                pl.when(partial & (width == w))(functools.partial(body, True, w))
            return
        if chunk == bk:
            pl.when(jnp.logical_not(full))(functools.partial(body, True, bk))
            return

        @pl.when(jnp.logical_not(full))
        def _():
            width = self.pass1_width
            for w in range(chunk, bk + 1, chunk):
                pl.when(width == w)(functools.partial(body, True, w))

    def row_seen(self):
        """bool [bq, 1]: the pass-1 tile's rows that see some block."""
        if self.sel is not None:
            return self.picks.rows_with_slots()
        if self.schedule.causal:  # block 0 is complete at t = m - 1
            t = self.qi * self.bq + lax.broadcasted_iota(jnp.int32, (self.bq, 1), 0)
            return (t >= self.schedule.ratio - 1) & (self.schedule.num_blocks > 0)
        return self.seen_ref[...] > 0

    def finish_f(self, m=None, l=None):
        """The pass-2 exponent shift G (base 2, `rebase.finish`) from the pass-1 statistics (default: m_ref,
        l_ref), replicated over lanes: f32 [*view, 128], also stored in f_ref. With several head chunks, the running
        row max M of the chunks so far is updated and the sums they accumulated are rescaled to it."""
        layout, top_ref, nh = self.layout, self.top_ref, self.nh
        m = self.m_ref[...] if m is None else m
        l = self.l_ref[...] if l is None else l
        seen = self.row_seen()
        c2 = rebase.compressed_log2_mass(m, l, layout.query_to_view(seen))  # [*view, 1]
        running = None
        if top_ref is not None:
            def rescale(factor):
                if nh > 1:
                    pl.when(self.c > 0)(lambda: common.scale_rows(self.out_ref, factor))
            previous = top_ref[...] if nh > 1 else jnp.full((self.bq, common.LANES), -jnp.inf, jnp.float32)
            running = (previous, rescale)
        lse_block = shift_row = None
        if self.mode != "per_head":
            lse_block, shift_row = self.lse_ref[...].astype(jnp.float32), self.shift_ref[0:1, :]
        g, top = rebase.finish(self.mode, layout, c2, lse_block=lse_block, shift_row=shift_row, seen_rows=seen,
                               running=running)
        if top_ref is not None:
            top_ref[...] = top
        f = jnp.broadcast_to(g, self.f_ref.shape)
        self.f_ref[...] = f
        return f

    def probs_of(self, z):
        """sum over the chunk's heads of 2^(z - G): f32 [bq, width] (z: [*view, width])."""
        f = self.f_ref[...][..., :self.lanes]
        return jnp.concatenate([jnp.sum(jnp.exp2(z_lanes - f), axis=self.layout.head_axis)
                                for z_lanes in common.lane_chunks(z, self.lanes)], axis=1)

    def add_probs(self, z, tile_k, f):
        """out[:, tile_k's blocks] += sum over the chunk's heads of 2^(z - G), one 128-lane chunk at a time."""
        bk, lanes, out_ref = self.bk, self.lanes, self.out_ref
        for j, z_lanes in enumerate(common.lane_chunks(z, lanes)):
            probs = jnp.sum(jnp.exp2(z_lanes - f), axis=self.layout.head_axis)  # [bq, lanes], summed over the chunk
            if isinstance(tile_k, int) or bk == out_ref.shape[-1]:
                start = (tile_k if isinstance(tile_k, int) else 0) * bk + j * lanes
                out_ref[:, start:start + lanes] += probs
            else:
                start = pl.multiple_of(tile_k * bk + j * lanes, 128)
                out_ref[:, pl.ds(start, lanes)] += probs

    # ------------------------------------------------------------------------------------------ phases

    def init(self):
        """Zero the output block (pairs: right before the pass 2 that accumulates it) and the running M; the first
        step of a query tile gathers its head-major rows and prepares the selection."""
        at, top_ref = self.at, self.top_ref

        @pl.when((self.step == at.last_step) if self.pairs else ((self.c == 0) & (self.step == 0)))
        def _():
            self.out_ref[...] = jnp.zeros_like(self.out_ref)
            if top_ref is not None:  # a query tile that visits no kv tile keeps M = -inf
                top_ref[...] = jnp.full(top_ref.shape, -jnp.inf, jnp.float32)

        @pl.when(self.first_step)
        def _():
            if not self.layout.token_major:
                common.gather_head_rows(self.q_ref, self.rows_ref, self.c, head_chunk=self.hc, group=self.group,
                                        block_q=self.bq)
            if self.sel is not None:
                self.picks.prepare()

        # Causal diagonal tiles are computed only up to the last 128-lane chunk the query tile can see: chunks past
        # it would be all -inf (at bk = 256, m = 4, bq = 64 this skips 1/10 of the matmul work).
        schedule, bk = self.schedule, self.bk
        self.chunk = common.LANES if schedule.causal and bk > common.LANES else bk
        # The pass-1 tile's visible width, computed once up front (not re-derived inside each branch).
        self.pass1_width = schedule.visible_width(self.qi, self.tile, self.chunk) if self.chunk != bk else bk

    def cached_pass2(self):
        """All of the output tile's cached tiles in one grid step (no per-tile step overhead); G is ready."""
        schedule, at, bk, chunk, cache_ref = self.schedule, self.at, self.bk, self.chunk, self.cache_ref

        def accumulate(tile_k, z):
            if self.sel is not None and self.sel.block_order:  # z cached with the slot counts: c 2^(z - G)
                self.picks.when_selected(self.out_qi, tile_k,
                                         lambda: self.add_probs(z, tile_k, self.f_ref[...][..., :self.lanes]))
                return
            if self.sel is not None:  # sum_h 2^(z - G) of the tile's blocks, written in slot order
                self.picks.when_selected(self.out_qi, tile_k,
                                         lambda: self.picks.gather_to_slots(self.out_ref, self.probs_of(z), tile_k))
                return
            self.add_probs(z, tile_k, self.f_ref[...][..., :self.lanes])

        count = schedule.count(self.counts_ref, at.b, self.out_qi)
        if schedule.listed:  # the i-th cached tile is the i-th of the list
            tile_of = lambda i: schedule.tile(self.firsts_ref, self.counts_ref, at.b, self.out_qi, i)
            last_tile = tile_of(count - 1)
        else:  # a range (the causal prefix: first_tile 0)
            first_tile = schedule.first(self.firsts_ref, at.b, self.out_qi)
            tile_of = lambda i: first_tile + i
            last_tile = first_tile + count - 1
        widths = [bk] if chunk == bk else list(range(chunk, bk + 1, chunk))
        width = bk if chunk == bk else schedule.visible_width(self.out_qi, last_tile, chunk)

        if self.straight_pass2:
            # One straight-line block per (tile count, last tile's width): the scheduler overlaps one tile's
            # exponentials with the next tile's loads, which a loop iteration boundary prevents (~10% of pass 2).
            def straight(n, w):
                for i in range(n):
                    accumulate(tile_of(i), cache_ref[i] if i < n - 1 or w == bk else cache_ref[i, ..., :w])

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
            accumulate(tile_of(i), cache_ref[i])
            return carry

        lax.fori_loop(0, count - 1, body, 0)

    def pass1(self):
        """The online LSE over the query tile's kv tiles (every mode needs C, full_lse too: the rebased weights)."""
        at, sel, m_ref, l_ref, seen_ref = self.at, self.sel, self.m_ref, self.l_ref, self.seen_ref

        # The first visited tile writes the statistics (no initialisation pass over them); a query tile that
        # visits none still gets them initialised, for a well-defined (unused) F.
        @pl.when(self.first_step & jnp.logical_not(self.active))
        def _():
            m_ref[...] = jnp.full(m_ref.shape, common.STAT_FLOOR, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            if seen_ref is not None:
                seen_ref[...] = jnp.zeros(seen_ref.shape, jnp.float32)

        def tile_step(first, last, finalize, masked, width):
            if sel is not None:  # an unselected tile only does what its walk position asks of it
                self.picks.when_selected(self.qi, self.tile,
                                         functools.partial(work, first, last, finalize, masked, width),
                                         otherwise=functools.partial(skipped, first, last, finalize))
                return
            work(first, last, finalize, masked, width)

        def skipped(first, last, finalize):
            if first:
                m_ref[...] = jnp.full(m_ref.shape, common.STAT_FLOOR, jnp.float32)
                l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            if last:
                self.finish_f()
            if finalize:
                self.fused_epilogue()

        def work(first, last, finalize, masked, width):
            z = self.scores(masked, width, seen_first=first if seen_ref is not None else None)
            # Duplicated indices weigh their block by its slot count (in the LSE only: the cached scores and
            # pass 2 give each slot its own share).
            z_lse = z if sel is None else self.picks.weighted(z, width, self.layout)
            # The last update feeds F directly: its statistics never go back to VMEM.
            stats = common.online_lse_update(m_ref, l_ref, z_lse, self.lanes, first=first, base2=True,
                                             store=not last)
            if self.cache_scores:
                cached = z_lse if sel is not None and sel.block_order else z  # block order: pass 2 weighs by c
                if width == self.bk:
                    self.cache_ref[self.k] = cached
                else:
                    self.cache_ref[self.k, ..., :width] = cached
            if last:
                # F right behind the last matmul: its cross-lane reductions (XLU) and exponentials share the
                # MXU-bound step instead of opening pass 2.
                self.finish_f(*stats)
            if finalize:  # the previous tile's KL epilogue, in the same basic block as this MXU-bound matmul
                self.fused_epilogue()

        if sel is not None:  # a tile of a query tile with a duplicated index: exact slot counts first
            self.picks.exact_weights(self.in_pass1 & self.active)

        # Nested conditions: a step outside pass 1 (or past the query tile's tiles) pays one branch, not one per
        # variant (each untaken pl.when costs ~10 bundles of scalar work and delay slots).
        @pl.when(self.in_pass1 & self.active)
        def _():
            last = self.k == self.schedule.count(self.counts_ref, at.b, self.qi) - 1
            for first in (True, False):
                @pl.when((self.k == 0) if first else (self.k > 0))
                def _():
                    if not self.cache_scores:
                        self.visit_tile(functools.partial(tile_step, first, False, False))
                        return
                    for finalize in ((False, True) if first and self.epilogue_in_pass1 else (False,)):
                        finishing = self.step == at.last_step
                        cond = finishing if finalize else jnp.logical_not(finishing) if (
                            first and self.epilogue_in_pass1) else True
                        pl.when(cond & last)(lambda: self.visit_tile(functools.partial(tile_step, first, True,
                                                                                       finalize)))
                        pl.when(cond & jnp.logical_not(last))(
                            lambda: self.visit_tile(functools.partial(tile_step, first, False, finalize)))

    def walked_pass2(self):
        """Without the score cache: a second matmul per kv tile; G is computed in the first pass-2 step (a query
        tile with no visited tile needs none)."""
        sel = self.sel

        def tile_step(first, masked, width):
            if sel is not None:
                self.picks.when_selected(self.qi, self.tile, functools.partial(work, first, masked, width),
                                         otherwise=self.finish_f if first else None)
                return
            work(first, masked, width)

        def work(first, masked, width):
            z = self.scores(masked, width)
            if sel is not None and sel.block_order:  # each block weighted by its slot count
                f = self.finish_f() if first else self.f_ref[...]
                self.add_probs(self.picks.weighted(z, width, self.layout), self.tile, f[..., :self.lanes])
                return
            if sel is not None:
                if first:
                    self.finish_f()
                self.picks.gather_to_slots(self.out_ref, self.probs_of(z), self.tile)
                return
            # The first pass-2 step computes F itself: its cross-lane reductions (XLU-bound) then share a basic
            # block with the matmul, and hide.
            f = self.finish_f() if first else self.f_ref[...]
            self.add_probs(z, self.tile, f[..., :self.lanes])

        if sel is not None and sel.block_order:  # pass 2's tile needs its slot counts again (not cached)
            self.picks.exact_weights(jnp.logical_not(self.in_pass1) & self.active)
        self.visit_tile(functools.partial(tile_step, True), cond=jnp.logical_not(self.in_pass1) & (self.k == 0))
        self.visit_tile(functools.partial(tile_step, False), cond=jnp.logical_not(self.in_pass1) & (self.k > 0))

    def finish(self):
        """The output tile's last step: the fused KL epilogue, or P (normalised, slot order) or the head sum + M."""
        at, nh, c, step = self.at, self.nh, self.c, self.step
        if self.kl is not None:
            # Pairs: the first tile's epilogue runs inside the second tile's first pass-1 step (see `pass1`).
            standalone = (step == at.last_step) & (jnp.logical_not(self.active) | self.own_pass2) \
                if self.epilogue_in_pass1 else ((c == nh - 1) & (step == at.last_step))
            pl.when(standalone)(self.fused_epilogue)
        elif self.sel is not None and not self.sel.block_order:
            @pl.when((c == nh - 1) & (step == at.last_step))
            def _():
                selection.write_slots(self.out_ref, self.out_ref[...], self.picks.valid_slots(0, self.sel.width_p),
                                      normalize=self.normalize, rowmax_ref=self.rowmax_ref,
                                      top_column=None if self.normalize else self.top_ref[:, :1])
        elif self.normalize:
            @pl.when((c == nh - 1) & (step == at.last_step))
            def _():
                acc = self.out_ref[...]
                total = jnp.sum(acc, axis=1, keepdims=True)
                p = acc / jnp.maximum(total, common.F32_TINY)
                if self.sel is not None:  # block order: the caller masks by the block bits (NaN rows stay NaN)
                    self.out_ref[...] = p
                    return
                # 0 outside V(t), also on a NaN row (there pass 2's exp2(-inf - NaN) is NaN on every entry).
                visible_at, _ = schedule_lib.dense_visibility(self.seq_len, self.qmeta_ref, self.krow_ref,
                                                              qi=self.out_qi, schedule=self.schedule)
                self.out_ref[...] = jnp.where(visible_at(0, acc.shape[1]), p, 0.0)
        else:  # the head sum stays unnormalised; the rows' M goes out with it
            @pl.when((c == nh - 1) & (step == at.last_step))
            def _():
                rows = common.column_to_rows(self.top_ref[:, :1], 1)  # [1, bq]
                self.rowmax_ref[...] = jnp.concatenate(
                    [rows, jnp.zeros((common.SUBLANES - 1, self.bq), jnp.float32)], axis=0)


def kernel(*refs, **static):
    """The teacher kernel (see `teacher.teacher_pallas` for the refs and `TeacherStep` for the static fields)."""
    step = TeacherStep(refs, **static)
    step.init()
    # Cached scores are already masked; the chunks past the visible width were never written (nor are they read).
    if step.cache_scores:  # ahead of pass 1: with pairs, this step's pass-1 work belongs to the next tile
        pl.when((step.step == step.at.last_step)
                & (step.schedule.count(step.counts_ref, step.at.b, step.out_qi) > 0)
                & jnp.logical_not(step.own_pass2))(step.cached_pass2)
    step.pass1()
    if step.cache_scores and step.merged:  # after pass 1, which wrote the last tile and F
        pl.when((step.step == step.at.last_step) & step.own_pass2)(step.cached_pass2)
    if not step.cache_scores:
        step.walked_pass2()
    step.finish()
