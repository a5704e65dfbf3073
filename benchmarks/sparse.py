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
import csv
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.dense_memory import load_tpu_estimate  # noqa: E402  (one estimator loader for the benchmarks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
B, D, M, W = 1, 512, 4, 128
PEAK_FLOPS, HBM_BW = 459e12, 2.46e12
PATTERNS = ("uniform", "local_heavy", "banded")
# Previous sparse kernel (K compares per (query, block)), fwd+bwd per_head, the sparse issue's table (estimates).
PREVIOUS_US = {(4096, 512): 668.0, (32768, 512): 172436.0}


def heads_for(width: int) -> int:
    return 128 if width >= 1024 else 64  # V4-Pro widths with K = 1024, V4-Flash otherwise


def mxu_floor_us(seq: int, width: int) -> float:
    """The K-proportional MXU floor: 2 B H D x (selectable slots, summed over queries) / peak, where query t can
    select min(K, visible blocks) slots (the scores of the selected slots and nothing else)."""
    slots = np.minimum(width, (np.arange(seq) + 1) // M).sum()
    return 2 * B * heads_for(width) * D * float(slots) / PEAK_FLOPS * 1e6


def structs(seq: int, width: int):
    h, n = heads_for(width), seq // M
    s = jax.ShapeDtypeStruct
    return (s((B, seq, width), jnp.float32), s((B, seq, h, D), jnp.bfloat16), s((B, n, D), jnp.bfloat16),
            s((B, seq, width), jnp.int32))


def loss_program(path: str):
    """fwd+bwd of the per_head loss through the given sparse path, Mosaic kernels (not the interpreter)."""
    import csa_pallas
    from csa_pallas.kernels import runtime

    def fn(logits, q, kv, topk):
        with runtime.compiling_for_tpu():
            return jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
                x, q, kv, topk_indices=topk, target="per_head", implementation="pallas",
                config={"path": path}))(logits)
    return fn


def dense_program(logits, q, kv):
    """fwd+bwd of dense mode (every visible block, no top-k; logits [B, S, N]) on the same shape: the cost sparse
    mode must not exceed."""
    import csa_pallas
    from csa_pallas.kernels import runtime
    with runtime.compiling_for_tpu():
        return jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
            x, q, kv, target="per_head", implementation="pallas"))(logits)


def dense_structs(seq: int, width: int):
    _, q, kv, _ = structs(seq, width)
    return (jax.ShapeDtypeStruct((B, seq, seq // M), jnp.float32), q, kv)


def baseline_program(logits, q, kv, topk):
    from benchmarks import xla_baseline
    return jax.value_and_grad(lambda x: xla_baseline.sparse_loss(x, q, kv, topk))(logits)


def layout_for(seq: int, width: int, path: str):
    """The sparse layout the loss program uses (traced abstractly: no arrays)."""
    from csa_pallas import ops_sparse
    return ops_sparse.abstract_layout(*structs(seq, width)[1:], {"path": path}, kl_logits_dtype=jnp.float32)


def pattern_indices(pattern: str, seq: int, width: int, seed: int = 0) -> np.ndarray:
    """int32 [S, K] top-k indices over the visible blocks (block s complete at t = 4 s + 3): uniform over them,
    local-heavy (the K/2 most recent + K/2 uniform) or banded (all within the 2K most recent); -1 where a query
    sees fewer than the pattern needs."""
    rng = np.random.default_rng(seed)
    t = np.arange(seq)[:, None]
    visible = (t + 1) // M  # blocks 0 .. visible - 1
    if pattern == "uniform":
        idx = (rng.random((seq, width)) * visible).astype(np.int64)
    elif pattern == "local_heavy":
        recent = visible - 1 - np.arange(width // 2)[None, :]
        far = (rng.random((seq, width - width // 2)) * visible).astype(np.int64)
        idx = np.concatenate([recent, far], axis=1)
    else:
        idx = visible - 1 - (rng.random((seq, width)) * np.minimum(2 * width, np.maximum(visible, 1))).astype(np.int64)
    return np.where((idx < 0) | (visible == 0), -1, idx).astype(np.int32)


def active_fraction(idx: np.ndarray, block_q: int, block_k: int) -> float:
    """Active (query tile, kv tile) pairs / causally visible ones at the visit path's tiling."""
    seq = idx.shape[0]
    nq = -(-seq // block_q)
    qi = np.repeat(np.arange(seq) // block_q, idx.shape[1])
    flat = idx.reshape(-1)
    keep = flat >= 0
    pairs = np.unique(qi[keep].astype(np.int64) * (1 << 20) + flat[keep] // block_k).size
    causal = sum((min((i * block_q + block_q) // M, seq // M) - 1) // block_k + 1 for i in range(nq))
    return pairs / max(causal, 1)


def dma_count(seq: int, width: int, path: str, layout) -> int:
    """Block DMAs of the sparse kernel: one per block-index change of each operand along the grid (per core the
    resident rows once), from the tiling. Visit: per visited kv tile one kv block; per (query tile, head chunk)
    the q block and, per query tile, 2 slot-index blocks, the bits, the logits, the statistics and G."""
    cfg = layout.cfg
    if path == "gather":
        steps = seq // cfg.block_q
        return 6 * steps + 2
    s = layout.schedule
    chunks = heads_for(width) // cfg.head_chunk
    tiles = sum(s.static_count(i) for i in range(s.nq))
    return tiles * chunks * (1 if cfg.cache_scores else 2) + s.nq * (chunks + 6)


@dataclasses.dataclass
class Row:
    seq: int
    width: int
    heads: int
    program: str
    pattern: str = "-"
    est_us: float = float("nan")
    derived_us: float = float("nan")
    hbm_bytes: float = float("nan")
    bw_floor_us: float = float("nan")
    best_us: float = float("nan")
    dmas: int = 0
    floor_us: float = float("nan")
    temp_mib: float = float("nan")
    peak_mib: float = float("nan")
    note: str = ""


def estimate(te, fn, args, label: str, **switches):
    from csa_pallas.kernels import selection
    selection._ESTIMATE_TILES = switches.get("tiles")
    selection._EXACT_COUNTS_BRANCH = switches.get("exact", True)
    try:
        rep = te.estimate(fn, *args, libtpu_profile="off", timeout=3600, path_budget=2_000_000_000,
                          name=label.replace(" ", "_"))
    finally:
        selection._ESTIMATE_TILES, selection._EXACT_COUNTS_BRANCH = None, True
    s, m = rep["summary"], rep["memory"]
    warn = [w for w in rep.get("warnings", []) if "NOT determined" in w or "budget" in w or "NO bundle" in w]
    return dict(us=s.get("best_estimate_us"), bundle=s.get("bundle_est_us"), lower=s.get("bundle_est_lower_bound_us"),
                bytes=(rep.get("roofline") or {}).get("bytes"),
                temp=(m.get("temp_bytes") or 0) / MiB, peak=(m.get("peak_bytes") or 0) / MiB, warnings=warn)


def run(seqs, widths, baseline: bool, out_dir: str, dense: bool = False, paths=("visit", "gather"), rows=None):
    te = load_tpu_estimate()
    rows = [] if rows is None else rows
    for width in widths:
        for seq in seqs:
            h = heads_for(width)
            floor = mxu_floor_us(seq, width)
            args = structs(seq, width)
            for path in paths:
                try:
                    layout = layout_for(seq, width, path)
                except ValueError as e:  # e.g. the gather path's resident rows do not fit in VMEM
                    rows.append(Row(seq, width, h, path, note=f"not run: {e}"))
                    continue
                t0 = time.time()
                runs = {"all": dict(tiles="all", exact=False), "none": dict(tiles="none", exact=False)} \
                    if path == "visit" else {"": {}}
                res = {k: estimate(te, loss_program(path), args, f"{path}_{k}_{seq}_{width}", **sw)
                       for k, sw in runs.items()}
                main = res.get("all", res.get(""))
                dmas = dma_count(seq, width, path, layout)
                bw = (main["bytes"] or float("nan")) / HBM_BW * 1e6
                note = "; ".join(main["warnings"])[:200]
                if path == "gather":
                    us = main["us"] or float("nan")
                    rows.append(Row(seq, width, h, "gather", "any", us, us, main["bytes"] or float("nan"), bw,
                                    max(us, bw), dmas, floor, main["temp"], main["peak"], note))
                else:
                    for pattern in PATTERNS:
                        frac = active_fraction(pattern_indices(pattern, seq, width), layout.cfg.block_q,
                                               layout.cfg.block_k)
                        # "none" by its bundle estimate: BEST ESTIMATE clamps it to the declared flops / peak
                        none = res["none"]["bundle"]
                        derived = none + (res["all"]["us"] - none) * frac
                        rows.append(Row(seq, width, h, "visit", pattern, main["us"], derived, main["bytes"], bw,
                                        max(derived, bw), dmas, floor, main["temp"], main["peak"],
                                        f"active tiles {frac:.3f}; none {none:.0f} us; {note}"))
                print(f"  [{path} S={seq} K={width}: {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
                write(rows, out_dir)
            if dense:
                res = estimate(te, dense_program, dense_structs(seq, width), f"dense_{seq}_{width}")
                rows.append(Row(seq, width, h, "dense mode", "all blocks", res["us"], res["us"], res["bytes"],
                                (res["bytes"] or float("nan")) / HBM_BW * 1e6, res["us"], floor_us=floor,
                                temp_mib=res["temp"], peak_mib=res["peak"], note="; ".join(res["warnings"])[:200]))
                write(rows, out_dir)
            if baseline:
                res = estimate(te, baseline_program, args, f"baseline_{seq}_{width}")
                rows.append(Row(seq, width, h, "xla gather baseline", "any", res["us"] or float("nan"),
                                note=f"lower bound {res['lower']} us" if res["us"] is None else "",
                                temp_mib=res["temp"], peak_mib=res["peak"], floor_us=floor))
                write(rows, out_dir)
    return rows


def fmt(x, nd=0):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"


def table(rows) -> str:
    head = (f"{'S':>7} {'K':>5} {'H':>4} {'program':<20} {'pattern':<12} {'est us':>10} {'derived us':>11} "
            f"{'bw floor':>9} {'best us':>10} {'MXU floor':>10} {'DMAs':>8} {'temp MiB':>9}  note")
    lines = [head]
    for r in rows:
        lines.append(f"{r.seq:>7} {r.width:>5} {r.heads:>4} {r.program:<20} {r.pattern:<12} {fmt(r.est_us):>10} "
                     f"{fmt(r.derived_us):>11} {fmt(r.bw_floor_us):>9} {fmt(r.best_us):>10} {fmt(r.floor_us):>10} "
                     f"{r.dmas:>8} {fmt(r.temp_mib, 1):>9}  {r.note[:90]}")
    return "\n".join(lines)


def write(rows, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sparse.json"), "w") as f:
        json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    with open(os.path.join(out_dir, "sparse.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[x.name for x in dataclasses.fields(Row)])
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))


def plot(rows, out_dir) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len({r.width for r in rows}), figsize=(12, 4.5), squeeze=False)
    for ax, width in zip(axes[0], sorted({r.width for r in rows})):
        def series(pred, key):
            pts = sorted((r.seq, getattr(r, key)) for r in rows if r.width == width and pred(r))
            return [p[0] for p in pts if not math.isnan(p[1])], [p[1] / 1e3 for p in pts if not math.isnan(p[1])]
        for pattern, style in zip(PATTERNS, ("-", "--", ":")):
            ax.plot(*series(lambda r: r.program == "visit" and r.pattern == pattern, "derived_us"), "o" + style,
                    color="C0", label=f"visit path, {pattern}")
        ax.plot(*series(lambda r: r.program == "gather", "est_us"), "s-", color="C1", label="gather path (any)")
        ax.plot(*series(lambda r: r.program == "gather", "floor_us"), "k:", label="K-proportional MXU floor")
        dense = series(lambda r: r.program == "dense mode", "est_us")
        if dense[0]:
            ax.plot(*dense, "d--", color="C2", label="dense mode (all blocks)")
        base = series(lambda r: r.program.startswith("xla"), "est_us")
        if base[0]:
            ax.plot(*base, "^-", color="C3", label="XLA gather baseline")
        prev = sorted((s, us / 1e3) for (s, k), us in PREVIOUS_US.items() if k == width)
        if prev:
            ax.plot(*zip(*prev), "x", color="C7", markersize=9, label="previous sparse kernel")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("fwd+bwd, ms (static v5p estimate)")
        ax.set_title(f"K = {width}, H = {heads_for(width)}")
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
    parser.add_argument("--out", default=os.path.join(REPO, "results", "sparse"))
    parser.add_argument("--paths", nargs="*", default=["visit", "gather"], choices=["visit", "gather"],
                        help="sparse paths to estimate (none: only --dense / --baseline rows)")
    parser.add_argument("--append", action="store_true", help="add the new rows to the saved JSON in --out")
    parser.add_argument("--replot", action="store_true", help="re-print and re-plot the saved JSON")
    args = parser.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out, "sparse.json")) as f:
            rows = [Row(**r) for r in json.load(f)]
        for r in rows:
            r.floor_us = mxu_floor_us(r.seq, r.width)
    else:
        saved = []
        if args.append:
            with open(os.path.join(args.out, "sparse.json")) as f:
                saved = [Row(**r) for r in json.load(f)]
        rows = run(args.seq, args.width, args.baseline, args.out, args.dense, args.paths, saved)
        latest = {(r.seq, r.width, r.program, r.pattern): r for r in rows}  # a re-measured row replaces the saved one
        rows = sorted(latest.values(), key=lambda r: (r.width, r.seq))
        write(rows, args.out)
    print("Sparse loss, fwd+bwd, per_head, static v5p estimates (tpu_estimate BEST ESTIMATE; not measurements)")
    print(table(rows))
    print(f"plot: {plot(rows, args.out)}")


if __name__ == "__main__":
    main()
