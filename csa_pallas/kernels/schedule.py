"""Tile walks of the teacher kernels: which tiles every grid step holds and computes, from one definition.

A walk's `decode(p, c, step, ...)` says, for grid step (p, c, step), which query tile and kv tile the kernel
computes, which output tile is resident, which kv / metadata tile is resident, whether the step is in pass 1 and
when the output tile's pass 2 runs. The BlockSpec index maps (`index_maps`) are built from the same `decode`, so a
kernel can only read the tile it names: `tests/test_schedule.py` enumerates every grid step of every walk in pure
Python and checks that (each needed kv tile once per pass, pass 2 after all of pass 1 for its output tile, the
resident tile equal to the computed one wherever the kernel reads it).

Walks (grid (rows, H/hc, steps)):
  * plain: grid row p = (batch, zig-zag query tile); pass 1 walks the query tile's kv tiles, then pass 2 either
    walks them again (`cached_pass2=False`) or is one step reading the scores pass 1 left in VMEM.
  * pairs / merged (causal schedule, cached, one head chunk): grid row p = a pair of query tiles (i, nq-1-i) whose
    causal tile counts add up to nearly the same number, walked back to back, so no step idles; merged: the
    second tile's pass 2 runs in its own last pass-1 step.

`dense_visibility` is the dense support V(t) of one query tile inside a kernel step, from the same schedule.

Integer division in maps uses `index_div` / `index_rem` (see `common`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from csa_pallas.kernels.common import index_div, index_rem, zigzag

WALKS = ("plain", "pairs", "merged")

# Benchmark switch for static estimates (`benchmarks.sparse`), never changed by the library: a static estimator
# cannot follow a listed schedule's dynamic grid, its loops over a list or the causal masks' branches of a tile
# read from SMEM, so with default ids a benchmark compiles the walk with this fixed pass-1 extent (the longest
# list of the selection it estimates, counted outside) and every query tile's list its min(extent, visible)
# most recent causally visible kv tiles (a banded selection's lists), all from the grid ids.
ESTIMATE_LIST_STEPS = None


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """Which kv tiles query tile qi visits, and in which order.

    causal: default ids (one document, positions 0..S-1, S_kv == S): the visible blocks of tile qi are a static
    prefix computed from the grid indices, so the compiler (and static estimators) see the loop bounds. Otherwise
    per-query-tile ranges (`common.tile_ranges`) passed by scalar prefetch decide, splash style.
    listed (sparse mode, `TeacherConfig.tile_list`): tile qi visits the kv tiles of its own list, the scalar
    prefetches being the lists (firsts_ref, flat [B * nq * nk]: row b * nq + qi holds the selected tiles in
    increasing order, then its last one repeated) and the counts (counts_ref [B * nq + 1]; the last word is the
    longest list, at least 1: the walk's pass-1 extent, `pass1_steps`), tokamax-splash style (a grid
    as long as the longest list, not a padded kv axis). `causal` still says how the kernel masks V(t).
    """

    causal: bool
    nq: int
    nk: int
    block_q: int
    block_k: int
    ratio: int
    num_blocks: int
    listed: bool = False

    def last_block(self, qi):
        """Causal schedule: the last block the last query of tile qi sees (-1: none)."""
        return jnp.minimum(index_div(qi * self.block_q + self.block_q, self.ratio) - 1, self.num_blocks - 1)

    def _estimating(self) -> bool:
        return self.listed and self.causal and ESTIMATE_LIST_STEPS is not None

    def count(self, counts_ref, b, qi):
        if self._estimating():  # the benchmark switch: every list the most recent visible tiles, that many
            return jnp.minimum(ESTIMATE_LIST_STEPS, self._causal_count(qi))
        if self.listed or not self.causal:
            return counts_ref[b * self.nq + qi]
        return self._causal_count(qi)

    def _causal_count(self, qi):
        last_block = self.last_block(qi)
        return jnp.where(last_block >= 0, index_div(jnp.maximum(last_block, 0), self.block_k) + 1, 0)

    def static_count(self, qi: int) -> int:
        """`count` of the causal schedule for a Python int query tile."""
        last_block = min((qi * self.block_q + self.block_q) // self.ratio - 1, self.num_blocks - 1)
        return last_block // self.block_k + 1 if last_block >= 0 else 0

    def visited_tiles(self, batch: int) -> int:
        """kv tiles a walk of this schedule visits per (head chunk, pass) over the whole batch, for cost
        estimates: exact for the causal schedule, all nq * nk tiles (an upper bound) when the ranges come from
        the ids at run time; with tile lists the causally visible tiles (an upper bound; a benchmark's fixed
        lists, `ESTIMATE_LIST_STEPS`, exactly)."""
        if self.causal:
            most = ESTIMATE_LIST_STEPS if self.listed else None  # a benchmark's fixed lists
            return batch * sum(min(self.static_count(i), most or self.nk) for i in range(self.nq))
        return batch * self.nq * self.nk

    def full(self, qi, tile):
        """True when every query of tile qi sees every block of kv tile `tile` (causal schedule only): the mask
        can be skipped. Tiles holding padding blocks are never full."""
        if not self.causal:
            return False
        last_block = tile * self.block_k + self.block_k - 1
        return ((last_block + 1) * self.ratio - 1 <= qi * self.block_q) & (last_block < self.num_blocks)

    def visible_width(self, qi, tile, chunk: int):
        """Causal schedule: lanes of kv tile `tile` holding a block some query of tile qi sees, rounded up to
        `chunk` (a divisor of block_k). Chunks past it are invisible to the whole query tile (and padding)."""
        seen = jnp.clip(self.last_block(qi) + 1 - tile * self.block_k, 1, self.block_k)
        return index_div(seen + chunk - 1, chunk) * chunk

    def first(self, firsts_ref, b, qi):
        if self._estimating():
            return self.tile(firsts_ref, None, b, qi, 0)
        if self.listed:
            return firsts_ref[(b * self.nq + qi) * self.nk]
        return 0 if self.causal else firsts_ref[b * self.nq + qi]

    def tile(self, firsts_ref, counts_ref, b, qi, k):
        """The k-th visited tile (padding steps repeat the last one, so nothing is re-fetched)."""
        last = jnp.maximum(self.count(counts_ref, b, qi) - 1, 0)
        if self._estimating():  # computable from the grid ids, as the causal walk's: the estimator resolves the
            # causal masks' branches as there instead of counting every one
            return jnp.maximum(self._causal_count(qi) - self.count(counts_ref, b, qi), 0) + jnp.minimum(k, last)
        if self.listed:
            return firsts_ref[(b * self.nq + qi) * self.nk + jnp.minimum(k, last)]
        return self.first(firsts_ref, b, qi) + jnp.minimum(k, last)

    def pass1_steps(self, counts_ref):
        """Listed: the longest list (the last word of the counts, >= 1; with default ids a benchmark may fix it:
        `ESTIMATE_LIST_STEPS`). Otherwise nk."""
        if not self.listed:
            return self.nk
        if self._estimating():
            return ESTIMATE_LIST_STEPS
        return counts_ref[counts_ref.shape[0] - 1]

    def natural(self, firsts_ref, counts_ref, b, qi, k):
        """For a walk over every kv tile k: (tile to keep resident, whether tile k is in the visited range)."""
        if self.listed:
            raise ValueError("natural: a walk over every kv tile has no list schedule")
        first = self.first(firsts_ref, b, qi)
        count = self.count(counts_ref, b, qi)
        needed = (k >= first) & (k < first + count)
        return jnp.clip(k, first, first + jnp.maximum(count - 1, 0)), needed

    # Pair walks -------------------------------------------------------------------------------------------------

    def pairs_fit(self) -> bool:
        """The pair walk needs every second tile (nq-1-i) to visit a kv tile: its pass 2 gets a step of its own."""
        nq = self.nq
        return (self.causal and not self.listed and nq % 2 == 0
                and all(self.static_count(nq - 1 - i) >= 1 for i in range(nq // 2)))

    def pairs_merge(self) -> bool:
        """Every second tile visits >= 2 kv tiles: its pass 2 can follow its last pass-1 step in the same grid step
        (with one tile, that step is also the first tile's pass 2, which needs the first tile's output blocks)."""
        nq = self.nq
        return self.pairs_fit() and all(self.static_count(nq - 1 - i) >= 2 for i in range(nq // 2))


@dataclasses.dataclass(frozen=True)
class StepView:
    """One grid step as the kernel sees it (all int32 scalars, or Python values where static).

    b: batch. qi: the query tile of this step's pass-1 work (q, statistics blocks). c: head chunk. step: position
    on the last grid axis. in_pass1: pass-1 step. k: position in qi's kv walk; tile: the kv tile computed (pass 1,
    or a walked pass 2). active: k < qi's count (a real visit). first_step: the first step of qi's walk.
    out_qi: the query tile whose output block is resident. last_step: the step of out_qi's pass 2 (and finish).
    kv_tile, meta_tile: the kv-block and key-metadata tiles resident in this step (what the index maps fetched).
    """

    b: object
    qi: object
    c: object
    step: object
    in_pass1: object
    k: object
    tile: object
    active: object
    first_step: object
    out_qi: object
    last_step: object
    kv_tile: object
    meta_tile: object


@dataclasses.dataclass(frozen=True)
class TeacherWalk:
    """The grid walk of a teacher kernel (see the module docstring).

    kind: "plain", "pairs" or "merged". cached_pass2: pass 2 is one step after pass 1 (plain walk; pairs always).
    pass2_kv, pass2_meta ("walk" | "resident"): in a walked pass 2 (plain, not cached_pass2), whether the kv block
    / key metadata follow the walk (the kernel reads them) or stay on the last pass-1 tile (it does not: nothing
    is re-fetched).
    """

    schedule: TileSchedule
    kind: str = "plain"
    cached_pass2: bool = False
    pass2_kv: str = "walk"
    pass2_meta: str = "walk"

    def __post_init__(self):
        if self.schedule.listed and self.kind != "plain":
            raise ValueError(f"walk: a listed schedule (tile_list) needs the plain walk, got {self.kind!r}")
        if self.kind not in WALKS:
            raise ValueError(f"walk: expected one of {WALKS}, got {self.kind!r}")
        if self.kind != "plain" and not self.schedule.pairs_fit():
            raise ValueError("walk: the pair walks need the causal schedule with an even number of query tiles, "
                             "each second tile visiting a kv tile")
        if self.kind == "merged" and not self.schedule.pairs_merge():
            raise ValueError("walk: 'merged' needs every second tile of a pair to visit >= 2 kv tiles")

    @property
    def paired(self) -> bool:
        return self.kind != "plain"

    @property
    def rows(self) -> int:
        """Grid rows per batch element."""
        return self.schedule.nq // 2 if self.paired else self.schedule.nq

    @property
    def steps(self) -> int:
        """Grid steps per (row, head chunk)."""
        s = self.schedule
        if self.paired:
            most = max(s.static_count(i) + s.static_count(s.nq - 1 - i) for i in range(s.nq // 2))
            return most if self.kind == "merged" else most + 1
        return s.nk + 1 if self.cached_pass2 else 2 * s.nk

    def grid_steps(self, counts):
        """The grid's step extent: `steps`, or for a listed schedule the longest list's (a traced int32 scalar,
        from the counts array [B * nq + 1] the kernel also takes; a dynamic grid)."""
        if not self.schedule.listed:
            return self.steps
        nk = self.schedule.pass1_steps(counts)
        return nk + 1 if self.cached_pass2 else 2 * nk

    def decode(self, p, c, step, firsts_ref=None, counts_ref=None) -> StepView:
        s = self.schedule
        if self.paired:
            return self._decode_pair(p, c, step)
        nk = s.pass1_steps(counts_ref)  # listed: the longest list; its shorter lists' later steps are inactive
        b = index_div(p, s.nq)
        qi = zigzag(index_rem(p, s.nq), s.nq)
        in_pass1 = step < nk
        if self.cached_pass2:
            k = jnp.minimum(step, nk - 1)
            last_step = nk
        else:
            k = jnp.where(in_pass1, step, step - nk)
            last_step = 2 * nk - 1
        count = s.count(counts_ref, b, qi)
        tile = s.tile(firsts_ref, counts_ref, b, qi, k)
        last_tile = s.tile(firsts_ref, counts_ref, b, qi, nk - 1)
        kv_tile = tile if self.pass2_kv == "walk" else jnp.where(in_pass1, tile, last_tile)
        meta_tile = tile if self.pass2_meta == "walk" else jnp.where(in_pass1, tile, last_tile)
        return StepView(b=b, qi=qi, c=c, step=step, in_pass1=in_pass1, k=k, tile=tile, active=k < count,
                        first_step=step == 0, out_qi=qi, last_step=last_step, kv_tile=kv_tile, meta_tile=meta_tile)

    def _decode_pair(self, p, c, step) -> StepView:
        """Grid row p holds tiles qa = pair and qb = nq-1-pair (counts ca, cb): steps 0..ca-1 are qa's pass 1,
        steps ca..ca+cb-1 qb's pass 1, step ca also qa's pass 2 (before qb's work: pass 1 overwrites the cache and
        F), qb's pass 2 in step ca+cb-1 after its last pass-1 work (merged) or else in step ca+cb. Both tiles'
        output blocks stay resident until their pass 2: pass 1 never touches them."""
        s = self.schedule
        npairs = s.nq // 2
        b = index_div(p, npairs)
        qa = index_rem(p, npairs)
        qb = s.nq - 1 - qa
        ca = s.count(None, b, qa)
        cb = s.count(None, b, qb)
        second = step >= ca
        out_second = step > ca
        qi = jnp.where(second, qb, qa)
        k_raw = jnp.where(second, step - ca, step)
        count = jnp.where(second, cb, ca)
        active = k_raw < count
        k = jnp.clip(k_raw, 0, jnp.maximum(count - 1, 0))
        tile = s.tile(None, None, b, qi, k)
        return StepView(b=b, qi=qi, c=c, step=step, in_pass1=active, k=k, tile=tile, active=active,
                        first_step=k_raw == 0, out_qi=jnp.where(out_second, qb, qa),
                        last_step=jnp.where(out_second, ca + cb - (1 if self.kind == "merged" else 0), ca),
                        kv_tile=tile, meta_tile=tile)

    def index_maps(self, *, head_chunk: int, group: int):
        """BlockSpec index maps named q ([B, S_p, H, D] blocks [bq, group, D]), kv, kmeta, row / qrow
        (per-query-tile blocks of the resident output tile: qmeta, top-k indices, the output / logits / G; of the
        pass-1 tile), lse (per (head chunk, query tile) statistics of the pass-1 tile), stats / qstats (per-row
        statistics [B, nq, 8, bq] of the output tile / of the pass-1 tile). Grid (rows * B, H / head_chunk, steps),
        2 scalar prefetches."""
        def view(p, c, step, firsts_ref, counts_ref):
            return self.decode(p, c, step, firsts_ref, counts_ref)

        def q_map(p, c, step, firsts_ref, counts_ref):
            v = view(p, c, step, firsts_ref, counts_ref)
            return v.b, v.qi, index_div(c * head_chunk, group), 0

        def kv_map(p, c, step, firsts_ref, counts_ref):
            v = view(p, c, step, firsts_ref, counts_ref)
            return v.b, v.kv_tile, 0

        def kmeta_map(p, c, step, firsts_ref, counts_ref):
            v = view(p, c, step, firsts_ref, counts_ref)
            return v.b, 0, v.meta_tile

        def row_map(p, c, step, firsts_ref, counts_ref):
            v = view(p, c, step, firsts_ref, counts_ref)
            return v.b, v.out_qi, 0

        def lse_map(p, c, step, firsts_ref, counts_ref):
            v = view(p, c, step, firsts_ref, counts_ref)
            return v.b, c, v.qi, 0, 0

        def stats_map(p, c, step, firsts_ref, counts_ref):  # [B, nq, 8, bq] per-row statistics of out_qi
            v = view(p, c, step, firsts_ref, counts_ref)
            return v.b, v.out_qi, 0, 0

        def qstats_map(p, c, step, firsts_ref, counts_ref):  # [B, nq, 8, bq] per-row inputs of the pass-1 tile
            v = view(p, c, step, firsts_ref, counts_ref)
            return v.b, v.qi, 0, 0

        def qrow_map(p, c, step, firsts_ref, counts_ref):  # per-query-tile blocks of the pass-1 tile
            v = view(p, c, step, firsts_ref, counts_ref)
            return v.b, v.qi, 0

        return dict(q=q_map, kv=kv_map, kmeta=kmeta_map, row=row_map, lse=lse_map, stats=stats_map,
                    qstats=qstats_map, qrow=qrow_map)


def kernel_view(walk: TeacherWalk, firsts_ref, counts_ref) -> StepView:
    """`walk.decode` at the current program ids (inside a kernel)."""
    from jax.experimental import pallas as pl  # local: keeps this module importable without pallas users
    return walk.decode(pl.program_id(0), pl.program_id(1), pl.program_id(2), firsts_ref, counts_ref)


def enumerate_steps(walk: TeacherWalk, *, batch: int, num_chunks: int, firsts=None, counts=None):
    """Every grid step of `walk` in execution order as (p, c, step, StepView with Python ints): for tests and
    benchmarks (pure Python, no kernel)."""
    def py(x):
        return int(x) if not isinstance(x, bool) else x

    for p in range(batch * walk.rows):
        for c in range(num_chunks):
            for step in range(int(walk.grid_steps(counts))):
                v = walk.decode(jnp.int32(p), jnp.int32(c), jnp.int32(step), firsts, counts)
                yield p, c, step, StepView(**{f.name: py(jax.device_get(getattr(v, f.name)))
                                              for f in dataclasses.fields(StepView)})


def dense_visibility(seq_len: int, qmeta_ref, krow_ref, *, qi, schedule: TileSchedule):
    """(visible_at(start, width) -> bool [bq, width], non-empty rows [bq, 1] or None) for the dense support V(t);
    seq_len: the real query rows (later rows are padding and see nothing)."""
    bq = schedule.block_q
    if schedule.causal:  # row t sees blocks j < limit[t] (complete blocks, real rows only)
        t = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        limit = jnp.minimum(index_div(t + 1, schedule.ratio), schedule.num_blocks)
        limit = jnp.where(t < seq_len, limit, 0)
        return (lambda start, width: start + lax.broadcasted_iota(jnp.int32, (bq, width), 1) < limit), limit > 0

    def visible_at(start, width):
        segment = krow_ref[0:1, pl.ds(start, width)]
        end = krow_ref[1:2, pl.ds(start, width)]
        return (segment == qmeta_ref[:, 0:1]) & (end <= qmeta_ref[:, 1:2])

    return visible_at, None
