"""Sparse (top-k) mode at DeepSeek-V4 shapes: both paths, static v5p estimates, memory, and selection patterns.

    python -m benchmarks.sparse --seq 4096 32768 --width 512             # estimates + memory, CSV/JSON + plot
    python -m benchmarks.sparse --seq 4096 16384 32768 65536 131072 --width 512 1024 --baseline --dense

What each row measures, and how (no TPU: nothing here is a wall-clock measurement):

* `est_us`: `../shared/tools/tpu_estimate.py` BEST ESTIMATE (static bundle schedule at an assumed 1.75 GHz, libtpu
  profile off) of the forward + backward loss program (per_head target, f32 logits, bf16 q / kv, default ids).
  The estimator cannot read scalar-prefetched flags, so the visit path is compiled twice with the benchmark
  switches of `kernels.selection`: every causally visible kv tile selected (`visit all`: exact for a selection
  that touches every tile, e.g. uniform) and none (`visit none`: the fixed cost). Both compile out the exact-count
  branch of query tiles holding a duplicated index (the selections here have none).
* `derived_us` (visit path, per pattern): none + (all - none) x (active tiles / causally visible tiles), the
  active (query tile, kv tile) pairs counted from the pattern's real indices at the path's tiling ("none" by its
  bundle estimate: BEST ESTIMATE would clamp it to the declared flops / peak).
  The gather path's cost does not depend on the pattern (K rows per query).
* `visit_list` rows (`TeacherConfig.tile_list`: each query tile walks a list of its selected kv tiles on a grid
  as long as the longest list, a dynamic grid the estimator cannot follow): per pattern, the longest list M at the
  path's tiling (`--list-block-k`, default the heuristic's) is counted from the real indices and the walk compiled
  with the benchmark switch `kernels.schedule.ESTIMATE_LIST_STEPS = M` (every query tile's list its min(M,
  visible) most recent visible tiles, exact for banded), all / none as above; `derived_us` = none + (all - none)
  x (listed tiles / those fixed lists' tiles).
* `hbm_bytes`: the kernels' declared HBM traffic (`pl.CostEstimate`, gathers included) plus the XLA ops', from the
  compiled program's cost analysis; `bw_floor_us` = bytes / 2.46 TB/s; `best_us` = max(estimate, bw floor).
* `dmas`: block DMAs the kernel issues (one per block-index change of each operand along its grid; the gather
  path's resident rows once per core), computed from the tiling.
* `floor_us`: the K-proportional MXU floor 2 B H D sum_t min(K, visible blocks of t) / 459 TFLOP/s (the scores of
  the selected slots; 2 B S K H D / peak once every query sees K blocks).
* `temp_mib` / `peak_mib`: v5p AOT `memory_analysis()` of the program (exact for the compiled program).
* `dense mode`: the dense loss (every visible block) on the same shape, the bar sparse mode must not exceed.
* `baseline`: `xla_baseline.sparse_loss` (the Primus eager gather); its loop trip count is data-dependent, so the
  estimator gives a lower bound only (printed as such).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import numpy as np

from benchmarks import harness  # noqa: E402  (sets ALLOW_MULTIPLE_LIBTPU_LOAD before jax loads libtpu)

import jax  # noqa: E402

PATTERNS = ("uniform", "local_heavy", "banded")


def shape_for(width: int) -> harness.Shape:
    """V4-Pro widths (H = 128) with K = 1024, V4-Flash (H = 64) otherwise."""
    return harness.SHAPES["deepseek-v4-pro" if width >= 1024 else "deepseek-v4-flash"]


def mxu_floor_us(seq: int, width: int) -> float:
    """The K-proportional MXU floor: 2 B H D x (selectable slots, summed over queries) / peak, where query t can
    select min(K, visible blocks) slots (the scores of the selected slots and nothing else)."""
    sh = shape_for(width)
    slots = np.minimum(width, (np.arange(seq) + 1) // sh.ratio).sum()
    return 2 * sh.batch * sh.heads * sh.head_dim * float(slots) / harness.V5P_PEAK_FLOPS * 1e6


def structs(seq: int, width: int):
    return harness.input_structs(shape_for(width), ["logits", "q", "compressed_kv", "topk_indices"], seq, width)


def path_config(path: str, list_block_k=None) -> dict:
    """The config= of a benchmark path: "visit" / "gather", or "visit_list" (the visit path with tile lists)."""
    if path != "visit_list":
        return {"path": path}
    return {"path": "visit", "tile_list": True, **({"block_k": list_block_k} if list_block_k else {})}


def loss_program(path: str, list_block_k=None):
    """fwd+bwd of the per_head loss through the given sparse path."""
    import csa_pallas
    config = path_config(path, list_block_k)

    def fn(logits, q, kv, topk):
        return jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
            x, q, kv, topk_indices=topk, target="per_head", implementation="pallas", config=config))(logits)
    return fn


def dense_program(logits, q, kv):
    """fwd+bwd of dense mode (every visible block; logits [B, S, N]) on the same shape: the bar sparse mode must
    not exceed."""
    import csa_pallas
    return jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
        x, q, kv, target="per_head", implementation="pallas"))(logits)


def dense_structs(seq: int, width: int):
    return harness.input_structs(shape_for(width), ["logits", "q", "compressed_kv"], seq, seq // shape_for(width).ratio)


def baseline_program(logits, q, kv, topk):
    from benchmarks import xla_baseline
    return jax.value_and_grad(lambda x: xla_baseline.sparse_loss(x, q, kv, topk))(logits)


def layout_for(seq: int, width: int, path: str, list_block_k=None):
    """The sparse layout the loss program uses (traced abstractly: no arrays)."""
    import jax.numpy as jnp
    from csa_pallas import ops_sparse
    return ops_sparse.abstract_layout(*structs(seq, width)[1:], path_config(path, list_block_k),
                                      kl_logits_dtype=jnp.float32)


def pattern_indices(pattern: str, seq: int, width: int, seed: int = 0) -> np.ndarray:
    """int32 [S, K] top-k indices over the visible blocks (block s complete at t = 4 s + 3): uniform over them,
    local-heavy (the K/2 most recent + K/2 uniform) or banded (all within the 2K most recent); -1 where a query
    sees fewer than the pattern needs."""
    rng = np.random.default_rng(seed)
    t = np.arange(seq)[:, None]
    visible = (t + 1) // shape_for(width).ratio  # blocks 0 .. visible - 1
    if pattern == "uniform":
        idx = (rng.random((seq, width)) * visible).astype(np.int64)
    elif pattern == "local_heavy":
        recent = visible - 1 - np.arange(width // 2)[None, :]
        far = (rng.random((seq, width - width // 2)) * visible).astype(np.int64)
        idx = np.concatenate([recent, far], axis=1)
    else:
        idx = visible - 1 - (rng.random((seq, width)) * np.minimum(2 * width, np.maximum(visible, 1))).astype(np.int64)
    return np.where((idx < 0) | (visible == 0), -1, idx).astype(np.int32)


def tile_counts(idx: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """Selected kv tiles per query tile (the active (query tile, kv tile) pairs; the tile lists' lengths), int
    [nq]."""
    seq = idx.shape[0]
    qi = np.repeat(np.arange(seq) // block_q, idx.shape[1])
    flat = idx.reshape(-1)
    keep = flat >= 0
    pairs = np.unique(qi[keep].astype(np.int64) * (1 << 20) + flat[keep] // block_k)
    return np.bincount(pairs >> 20, minlength=-(-seq // block_q))


def active_fraction(idx: np.ndarray, block_q: int, block_k: int, ratio: int = 4) -> float:
    """Active (query tile, kv tile) pairs / causally visible ones at the visit path's tiling."""
    seq = idx.shape[0]
    nq = -(-seq // block_q)
    causal = sum((min((i * block_q + block_q) // ratio, seq // ratio) - 1) // block_k + 1 for i in range(nq))
    return int(tile_counts(idx, block_q, block_k).sum()) / max(causal, 1)


def list_rows(te, seq: int, width: int, layout, list_block_k=None) -> list:
    """The visit path with tile lists, per pattern: compiled with every list fixed to the pattern's longest M
    (`schedule.ESTIMATE_LIST_STEPS`), all / none; derived none + (all - none) x (listed tiles / fixed tiles)."""
    from csa_pallas.kernels import schedule
    cfg, sched = layout.cfg, layout.schedule
    visible = np.array([sched.static_count(i) for i in range(sched.nq)])
    args, out = structs(seq, width), []
    for pattern in PATTERNS:
        counts = tile_counts(pattern_indices(pattern, seq, width), cfg.block_q, cfg.block_k)
        longest = max(int(counts.max()), 1)
        schedule.ESTIMATE_LIST_STEPS = longest
        try:
            program = loss_program("visit_list", list_block_k)
            row = new_row(seq, width, "visit_list", pattern)
            full = estimate(te, program, args, row, tiles="all", exact=False)
            none = estimate(te, program, args, dataclasses.replace(row), tiles="none", exact=False)
        finally:
            schedule.ESTIMATE_LIST_STEPS = None
        frac = counts.sum() / max(np.minimum(visible, longest).sum(), 1)
        full.dmas = dma_count(seq, width, "visit_list", layout, tiles=int(counts.sum()))
        if full.est_us is not None and none.bundle_us is not None:
            full.derived_us = none.bundle_us + (full.est_us - none.bundle_us) * frac
            full.best_us = max(full.derived_us, full.bw_floor_us or 0.0)
        full.note = (f"bq{cfg.block_q} bk{cfg.block_k}; longest list {longest} of {sched.nk} tiles; listed / fixed "
                     f"tiles {frac:.3f}; none {none.bundle_us or float('nan'):.0f} us; {full.note}")[:300]
        out.append(full)
    return out


def dma_count(seq: int, width: int, path: str, layout, tiles=None) -> int:
    """Block DMAs of the sparse kernel: one per block-index change of each operand along the grid (per core the
    resident rows once), from the tiling. Visit: per visited kv tile one kv block (tiles: the visited tiles; None:
    every causally visible one, as the flag walk visits); per (query tile, head chunk) the q block and, per query
    tile, 2 slot-index blocks, the bits, the logits, the statistics and G."""
    cfg = layout.cfg
    if path == "gather":
        return 6 * (seq // cfg.block_q) + 2
    s = layout.schedule
    chunks = shape_for(width).heads // cfg.head_chunk
    if tiles is None:
        tiles = sum(s.static_count(i) for i in range(s.nq))
    return tiles * chunks * (1 if cfg.cache_scores else 2) + s.nq * (chunks + 6)


def new_row(seq: int, width: int, program: str, pattern: str = "") -> harness.Row:
    sh = shape_for(width)
    return harness.Row(bench="sparse", shape=sh.name, program=program, mode="sparse", target="per_head",
                       impl="pallas", seq=seq, width=width, heads=sh.heads, batch=sh.batch, ids="default",
                       pattern=pattern, pass_="fwd+bwd", floor_us=mxu_floor_us(seq, width),
                       package_fingerprint=harness.package_fingerprint())


def estimate(te, fn, args, row: harness.Row, **switches) -> harness.Row:
    """harness.estimate with the visit path's benchmark switches (`kernels.selection`) set while it compiles."""
    from csa_pallas.kernels import selection
    selection._ESTIMATE_TILES = switches.get("tiles")
    selection._EXACT_COUNTS_BRANCH = switches.get("exact", True)
    try:
        return harness.estimate(row, fn, args, estimator=te, path_budget=2_000_000_000)
    finally:
        selection._ESTIMATE_TILES, selection._EXACT_COUNTS_BRANCH = None, True


def visit_rows(te, seq: int, width: int, layout) -> list:
    """The visit path compiled with every causally visible tile selected ('all') and none ('none'); each pattern's
    derived estimate none + (all - none) x active fraction ('none' by its bundle estimate: BEST ESTIMATE would
    clamp it to the declared flops / peak)."""
    args = structs(seq, width)
    full = estimate(te, loss_program("visit"), args, new_row(seq, width, "visit"), tiles="all", exact=False)
    none = estimate(te, loss_program("visit"), args, new_row(seq, width, "visit"), tiles="none", exact=False)
    out = []
    for pattern in PATTERNS:
        frac = active_fraction(pattern_indices(pattern, seq, width), layout.cfg.block_q, layout.cfg.block_k)
        row = dataclasses.replace(full, pattern=pattern)
        if full.est_us is not None and none.bundle_us is not None:
            row.derived_us = none.bundle_us + (full.est_us - none.bundle_us) * frac
            row.best_us = max(row.derived_us, row.bw_floor_us or 0.0)
        row.note = f"active tiles {frac:.3f}; none {none.bundle_us or float('nan'):.0f} us; {full.note}"[:300]
        out.append(row)
    return out


def run(seqs, widths, baseline: bool, out_dir: str, dense: bool = False, paths=("visit", "gather"), rows=None,
        list_block_k=None):
    te = harness.load_tpu_estimate()
    rows = [] if rows is None else rows
    for width in widths:
        for seq in seqs:
            for path in paths:
                try:
                    layout = layout_for(seq, width, path, list_block_k)
                except ValueError as e:  # e.g. the gather path's resident rows do not fit in VMEM
                    rows.append(dataclasses.replace(new_row(seq, width, path), status="not run", note=str(e)[:300]))
                    continue
                t0 = time.time()
                if path == "gather":
                    row = estimate(te, loss_program(path), structs(seq, width), new_row(seq, width, path, "any"))
                    row.derived_us = row.est_us
                    new = [row]
                elif path == "visit_list":
                    new = list_rows(te, seq, width, layout, list_block_k)
                else:
                    new = visit_rows(te, seq, width, layout)
                for row in new:
                    if row.dmas is None:  # (visit_list rows count theirs from the lists)
                        row.dmas = dma_count(seq, width, path, layout)
                rows += new
                print(f"  [{path} S={seq} K={width}: {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
                write(rows, out_dir)
            if dense:
                row = estimate(te, dense_program, dense_structs(seq, width), new_row(seq, width, "dense mode",
                                                                                        "all blocks"))
                rows.append(dataclasses.replace(row, mode="dense", derived_us=row.est_us))
                write(rows, out_dir)
            if baseline:
                base = dataclasses.replace(new_row(seq, width, "xla gather baseline", "any"), impl="xla")
                rows.append(estimate(te, baseline_program, structs(seq, width), base))
                write(rows, out_dir)
    return rows


COLUMNS = [("seq", "S", "i"), ("width", "K", "i"), ("heads", "H", "i"), ("program", "program", "s"),
           ("pattern", "pattern", "s"), ("est_us", "est us", "f0"), ("derived_us", "derived us", "f0"),
           ("bw_floor_us", "bw floor", "f0"), ("best_us", "best us", "f0"), ("floor_us", "MXU floor", "f0"),
           ("dmas", "DMAs", "i"), ("temp_mib", "temp MiB", "f1"), ("note", "note", "s")]


def table(rows) -> str:
    return harness.format_table([dict(dataclasses.asdict(r), note=r.note[:90]) for r in rows], COLUMNS)


def write(rows, out_dir):
    harness.write_rows(rows, out_dir, "sparse", dict(
        what="sparse loss, fwd+bwd per_head, static v5p estimates (tpu_estimate BEST ESTIMATE; not measurements)"))


def plot(rows, out_dir) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    widths = sorted({r.width for r in rows})
    fig, axes = plt.subplots(1, len(widths), figsize=(12, 4.5), squeeze=False)
    for ax, width in zip(axes[0], widths):
        def series(pred, key):
            pts = sorted((r.seq, getattr(r, key)) for r in rows if r.width == width and pred(r)
                         and getattr(r, key) is not None)
            return [p[0] for p in pts], [p[1] / 1e3 for p in pts]
        for pattern, style in zip(PATTERNS, ("-", "--", ":")):
            ax.plot(*series(lambda r: r.program == "visit" and r.pattern == pattern, "derived_us"), "o" + style,
                    color="C0", label=f"visit path, {pattern}")
        listed = {}  # the visit path with tile lists, banded: its best tiling per S
        for r in rows:
            if r.width == width and r.program == "visit_list" and r.pattern == "banded" and r.derived_us:
                listed[r.seq] = min(listed.get(r.seq, r.derived_us), r.derived_us)
        if listed:
            ax.plot(sorted(listed), [listed[s] / 1e3 for s in sorted(listed)], "v:", color="C4",
                    label="visit path, tile lists, banded")
        ax.plot(*series(lambda r: r.program == "gather", "est_us"), "s-", color="C1", label="gather path (any)")
        ax.plot(*series(lambda r: r.program == "gather", "floor_us"), "k:", label="K-proportional MXU floor")
        for prog, style, color, label in [("dense mode", "d--", "C2", "dense mode (all blocks)"),
                                          ("xla gather baseline", "^-", "C3", "XLA gather baseline")]:
            pts = series(lambda r: r.program == prog, "est_us")
            if pts[0]:
                ax.plot(*pts, style, color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="sequence length S", ylabel="fwd+bwd, ms (static v5p estimate)",
               title=f"K = {width}, H = {shape_for(width).heads}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Sparse indexer loss, per_head, static v5p estimates (tpu_estimate; not measurements)")
    fig.tight_layout()
    path = os.path.join(out_dir, "sparse.png")
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="*", default=[4096, 16384, 32768, 65536, 131072])
    parser.add_argument("--width", type=int, nargs="*", default=[512])
    parser.add_argument("--baseline", action="store_true", help="also the XLA gather baseline (lower bounds)")
    parser.add_argument("--dense", action="store_true", help="also dense mode on the same shape (per_head)")
    parser.add_argument("--out", default=os.path.join(harness.REPO, "results", "sparse"))
    parser.add_argument("--paths", nargs="*", default=["visit", "gather"], choices=["visit", "gather", "visit_list"],
                        help="sparse paths to estimate (none: only --dense / --baseline rows); visit_list: the visit "
                             "path with tile lists (TeacherConfig.tile_list)")
    parser.add_argument("--list-block-k", type=int, default=None,
                        help="visit_list: the kv tile (default: the heuristic's)")
    parser.add_argument("--append", action="store_true", help="add the new rows to the saved JSON in --out")
    parser.add_argument("--replot", action="store_true", help="re-print and re-plot the saved JSON")
    args = parser.parse_args(argv)
    saved = os.path.join(args.out, "sparse.json")
    if args.replot:
        rows = harness.read_rows(saved)
        for r in rows:  # the floor's definition may be newer than the record
            r.floor_us = mxu_floor_us(r.seq, r.width)
    else:
        rows = run(args.seq, args.width, args.baseline, args.out, args.dense, args.paths,
                   harness.read_rows(saved) if args.append else [], args.list_block_k)
        # a re-measured row replaces the saved one (visit_list rows per tiling: their note's first field)
        latest = {(r.seq, r.width, r.program, r.pattern, r.note.split(";")[0] if r.program == "visit_list" else ""): r
                  for r in rows}
        rows = sorted(latest.values(), key=lambda r: (r.width, r.seq))
        write(rows, args.out)
    print("Sparse loss, fwd+bwd, per_head, static v5p estimates (tpu_estimate BEST ESTIMATE; not measurements)")
    print(table(rows))
    print(f"plot: {plot(rows, args.out)}")


if __name__ == "__main__":
    main()
