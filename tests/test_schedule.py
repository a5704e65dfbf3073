"""Every grid step of every teacher walk, enumerated in pure Python (no kernel runs).

For each walk (plain with a cached or a walked pass 2, pairs, merged; causal or table-driven schedules; sparse
mode walks the same plain walks) this checks that the index maps fetch exactly the tiles the kernel's decode names,
that every needed kv tile is visited once per pass and head chunk, that an output tile's pass 2 comes after all of
its pass 1, and that wherever the kernel reads a kv block or key metadata the resident tile is the one it computes
(the sparse cache bug of issue 13 was such a disagreement: a cached-score pass 2 recomputing slot weights from
metadata that the index map had clamped to the last tile; sparse mode now reads no key metadata at all).
"""

from __future__ import annotations


import numpy as np
import pytest

from csa_pallas.kernels import schedule as schedule_lib


def causal(nq, nk, block_q=16, block_k=128, ratio=4, num_blocks=None):
    num_blocks = nk * block_k if num_blocks is None else num_blocks
    return schedule_lib.TileSchedule(causal=True, nq=nq, nk=nk, block_q=block_q, block_k=block_k, ratio=ratio,
                                     num_blocks=num_blocks)


def table(nq, nk, seed, batch):
    """A table-driven schedule with random per-query-tile ranges (some empty)."""
    rng = np.random.default_rng(seed)
    firsts = rng.integers(0, nk, batch * nq).astype(np.int32)
    counts = np.minimum(rng.integers(1, nk + 1, batch * nq), nk - firsts).astype(np.int32)
    counts[::3] = 0  # query tiles that see nothing
    firsts = np.where(counts == 0, 0, firsts).astype(np.int32)
    s = schedule_lib.TileSchedule(causal=False, nq=nq, nk=nk, block_q=16, block_k=128, ratio=4,
                                  num_blocks=nk * 128)
    return s, firsts, counts


def needed(s, b, qi, firsts, counts):
    if s.listed:
        row = b * s.nq + qi
        return [int(t) for t in firsts[row * s.nk:row * s.nk + int(counts[row])]]
    if s.causal:
        return list(range(s.static_count(qi)))
    first, count = int(firsts[b * s.nq + qi]), int(counts[b * s.nq + qi])
    return list(range(first, first + count))


def check_walk(walk, *, batch, chunks, firsts=None, counts=None, reads_kv_pass2=False, reads_meta_pass2=False):
    s = walk.schedule
    maps = walk.index_maps(head_chunk=1, group=1)
    visits = {}  # (b, qi, c, pass) -> [tiles in order]
    pass1_done = {}  # (b, qi, c) -> step index (global order) of the last pass-1 visit
    finished = {}  # (b, out_qi, c) -> step index of its finishing step
    order = 0
    for p, c, step, v in schedule_lib.enumerate_steps(walk, batch=batch, num_chunks=chunks, firsts=firsts,
                                                      counts=counts):
        order += 1
        ids = (p, c, step, firsts, counts)
        # The index maps fetch what the decode names.
        assert int(maps["kv"](*ids)[1]) == v.kv_tile
        assert int(maps["kmeta"](*ids)[2]) == v.meta_tile
        assert int(maps["row"](*ids)[1]) == v.out_qi
        assert tuple(int(x) for x in maps["lse"](*ids)[:3]) == (v.b, c, v.qi)
        assert int(maps["q"](*ids)[1]) == v.qi
        if v.in_pass1 and v.active:
            # The kernel reads the kv block and (table schedules) the metadata of the tile it computes.
            assert v.kv_tile == v.tile and v.meta_tile == v.tile, (p, c, step)
            visits.setdefault((v.b, v.qi, c, 1), []).append(v.tile)
            pass1_done[(v.b, v.qi, c)] = order
        elif not v.in_pass1 and v.active and not walk.cached_pass2:
            if reads_kv_pass2:
                assert v.kv_tile == v.tile, ("pass-2 kv", p, c, step)
            if reads_meta_pass2:
                assert v.meta_tile == v.tile, ("pass-2 metadata", p, c, step)
            visits.setdefault((v.b, v.qi, c, 2), []).append(v.tile)
        if step == v.last_step:
            finished[(v.b, v.out_qi, c)] = order
    for b in range(batch):
        for qi in range(s.nq):
            want = needed(s, b, qi, firsts, counts)
            for c in range(chunks):
                assert visits.get((b, qi, c, 1), []) == want, (b, qi, c)
                if not walk.cached_pass2:
                    assert visits.get((b, qi, c, 2), []) == want, ("pass 2", b, qi, c)
                assert (b, qi, c) in finished, ("no finishing step", b, qi, c)
                if want:
                    assert finished[(b, qi, c)] >= pass1_done[(b, qi, c)], ("pass 2 before pass 1", b, qi, c)


@pytest.mark.parametrize("nq, block_q, ratio, block_k", [(8, 16, 1, 32), (5, 32, 1, 64), (6, 16, 4, 16)])
@pytest.mark.parametrize("cached", [True, False])
def test_plain_walk_causal(nq, block_q, ratio, block_k, cached):
    num_blocks = nq * block_q // ratio - 3  # S not a multiple of m: padding blocks in the last kv tile
    s = causal(nq, -(-num_blocks // block_k), block_q, block_k, ratio, num_blocks=num_blocks)
    check_walk(schedule_lib.TeacherWalk(s, kind="plain", cached_pass2=cached), batch=2, chunks=2,
               reads_kv_pass2=not cached, reads_meta_pass2=not cached)


@pytest.mark.parametrize("cached", [True, False])
def test_plain_walk_table(cached):
    s, firsts, counts = table(5, 4, seed=0, batch=2)
    assert (counts == 0).any() and (counts > 1).any()
    check_walk(schedule_lib.TeacherWalk(s, kind="plain", cached_pass2=cached), batch=2, chunks=2, firsts=firsts,
               counts=counts, reads_kv_pass2=not cached, reads_meta_pass2=not cached)


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("causal_ids", [True, False])
def test_plain_walk_listed(cached, causal_ids):
    """tile_list: each query tile walks its own list of selected kv tiles (`selection.tile_lists`, here from a
    random selection with gaps, empty rows and one row selecting every tile), on a grid as long as the longest
    list; the shorter lists' later steps are inactive and re-fetch nothing."""
    import jax.numpy as jnp
    from csa_pallas.kernels import selection
    batch, nq, nk = 2, 5, 6
    active = np.random.default_rng(3).random((batch, nq, nk)) < 0.4
    active[0, 1] = False  # a query tile that selected nothing
    active[1, 2] = True  # one that selected every tile: the longest list is nk
    active[1, 3] = False
    lists, counts = (np.asarray(x) for x in selection.tile_lists(jnp.asarray(active)))
    assert counts[-1] == nk == counts[:-1].max()
    for row, flags in enumerate(active.reshape(batch * nq, nk)):
        got = lists[row * nk:(row + 1) * nk]
        want = np.flatnonzero(flags)
        assert got[:want.size].tolist() == want.tolist()
        assert (got[want.size:] == (want[-1] if want.size else 0)).all()  # padding repeats the last tile
    s = schedule_lib.TileSchedule(causal=causal_ids, nq=nq, nk=nk, block_q=16, block_k=128, ratio=1,
                                  num_blocks=nk * 128, listed=True)
    walk = schedule_lib.TeacherWalk(s, kind="plain", cached_pass2=cached)
    assert int(walk.grid_steps(counts)) == (nk + 1 if cached else 2 * nk)
    check_walk(walk, batch=batch, chunks=2, firsts=lists, counts=counts, reads_kv_pass2=not cached,
               reads_meta_pass2=not cached)
    # A shorter longest list shortens the grid: the steps past it are the ones the walk no longer takes.
    active[1, 2] = active[1, 1]
    lists, counts = (np.asarray(x) for x in selection.tile_lists(jnp.asarray(active)))
    longest = int(active.sum(-1).max())
    assert counts[-1] == longest < nk and int(walk.grid_steps(counts)) == (longest + 1 if cached else 2 * longest)
    check_walk(walk, batch=batch, chunks=1, firsts=lists, counts=counts, reads_kv_pass2=not cached,
               reads_meta_pass2=not cached)
    with pytest.raises(ValueError, match="needs the plain walk"):
        schedule_lib.TeacherWalk(s, kind="pairs", cached_pass2=True)


@pytest.mark.parametrize("nq, block_q, ratio, block_k, kind", [
    (32, 16, 1, 128, "merged"), (32, 16, 1, 128, "pairs"), (16, 32, 2, 128, "merged"), (16, 16, 32, 16, "pairs"),
])
def test_pair_walks(nq, block_q, ratio, block_k, kind):
    num_blocks = nq * block_q // ratio
    s = causal(nq, -(-num_blocks // block_k), block_q, block_k, ratio, num_blocks=num_blocks)
    assert s.pairs_fit() and (kind == "pairs" or s.pairs_merge())
    walk = schedule_lib.TeacherWalk(s, kind=kind, cached_pass2=True)
    check_walk(walk, batch=2, chunks=1)
    # No idle grid steps: every pair's steps are all used (the counts of (i, nq-1-i) add up to the same number).
    used = {s.static_count(i) + s.static_count(nq - 1 - i) for i in range(nq // 2)}
    assert walk.steps - max(used) in (0, 1)


def test_pair_walk_needs_the_causal_schedule():
    s, _, _ = table(4, 2, seed=1, batch=1)
    with pytest.raises(ValueError, match="walk:"):
        schedule_lib.TeacherWalk(s, kind="pairs", cached_pass2=True)
    with pytest.raises(ValueError, match="walk: 'merged'"):
        schedule_lib.TeacherWalk(causal(16, 1, 16, 16, 32, num_blocks=8), kind="merged", cached_pass2=True)


def test_the_benchmark_switch_fixes_every_list_to_the_most_recent_visible_tiles():
    """`schedule.ESTIMATE_LIST_STEPS = M` (benchmarks only: the estimator cannot read the lists): with default ids
    every query tile walks its min(M, visible) most recent causally visible kv tiles, computed from the grid ids,
    on a grid of M pass-1 steps; the benchmark's tile count (`benchmarks.sparse.tile_counts`) is the lists'."""
    s = schedule_lib.TileSchedule(causal=True, nq=6, nk=4, block_q=16, block_k=32, ratio=1, num_blocks=96, listed=True)
    walk = schedule_lib.TeacherWalk(s, kind="plain", cached_pass2=True)
    schedule_lib.ESTIMATE_LIST_STEPS = 2
    try:
        assert walk.grid_steps(None) == 3
        walked = {}
        for _, _, _, v in schedule_lib.enumerate_steps(walk, batch=1, num_chunks=1):
            if v.in_pass1 and v.active:
                walked.setdefault(v.qi, []).append(v.tile)
    finally:
        schedule_lib.ESTIMATE_LIST_STEPS = None
    visible = {qi: s.static_count(qi) for qi in range(s.nq)}
    assert walked == {qi: list(range(max(n - 2, 0), n)) for qi, n in visible.items() if n}
    from benchmarks import sparse as bench
    idx = np.full((96, 4), -1, np.int32)
    idx[40:, 0], idx[70:, 1] = 3, 65  # tile 0 from query 40 on, tile 2 from query 70 on
    assert bench.tile_counts(idx, 16, 32).tolist() == [0, 0, 1, 1, 2, 2]
