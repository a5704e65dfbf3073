"""The sweep's table and plots (`benchmarks.sweep`): its columns, the printed table and how it reads back, and
one PNG per metric (HBM temp of the AOT rows, TPU wall clock of the timed rows) against S."""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

from benchmarks import harness


def chunk_label(head_chunk: Optional[int]) -> str:
    """A head chunk as printed: its number, or 'auto' for the kernels' default (None)."""
    return "auto" if head_chunk is None else str(head_chunk)


# (row key, heading, kind): see harness.cell
COLUMNS = [
    ("mode", "mode", "s"), ("target", "target", "s"), ("impl", "impl", "s"), ("head_chunk", "hc", "s"),
    ("seq", "S", "i"), ("ids", "ids", "s"), ("mesh", "mesh", "s"), ("batch", "B", "i"), ("pass_", "pass", "s"),
    ("measure", "measure", "s"), ("status", "status", "s"),
    ("argument_mib", "arg MiB", "f1"), ("temp_mib", "temp MiB", "f1"), ("peak_mib", "peak MiB", "f1"),
    ("vmem_limit_mib", "VMEM lim MiB", "f1"), ("compile_s", "compile s", "f1"), ("median_ms", "median ms", "f3"),
    ("spread_pct", "spread %", "f1"), ("tflops", "TFLOP/s", "f1"), ("pct_peak", "% peak", "f1"),
    ("loss_rel_err", "loss rel err", "e"), ("grad_rel_err", "grad rel err", "e"), ("how", "how", "s"),
]


def table_rows(rows: Sequence[dict]) -> list:
    """Rows as printed: the head chunk as 'auto' / its number (the reference's: '-')."""
    return [dict(r, head_chunk=(None if r.get("impl") == "xla" and r.get("head_chunk") is None
                                else chunk_label(r.get("head_chunk")))) for r in rows]


def format_table(rows: Sequence[dict], header: Sequence[str] = ()) -> str:
    return harness.format_table(table_rows(rows), COLUMNS, header)


def parse_table(text: str) -> list:
    return harness.parse_table(text, COLUMNS)


def plot_metric(rows: Sequence[dict], path: str, *, measure: str, key: str, ylabel: str, title: str) -> Optional[str]:
    """One panel per (mode, target, pass); x = S (log2), one line per (impl, head chunk): Pallas solid, XLA
    dashed. One-chip rows only. Returns the path, or None when no row has the value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("measure") == measure and r.get("status") == "ok" and r.get(key) is not None
           and not r.get("mesh")]
    if not pts:
        return None
    panels = sorted({(r["mode"], r["target"], r["pass_"]) for r in pts})
    ncol = min(2, len(panels))
    fig, axes = plt.subplots(math.ceil(len(panels) / ncol), ncol, figsize=(6.5 * ncol, 4.0 * math.ceil(
        len(panels) / ncol)), squeeze=False)
    lines = sorted({(r["impl"], chunk_label(r.get("head_chunk"))) for r in pts})
    for ax, panel in zip(axes.flat, panels):
        for i, (impl, chunk) in enumerate(lines):
            sel = sorted((r for r in pts if (r["mode"], r["target"], r["pass_"]) == panel and r["impl"] == impl
                          and chunk_label(r.get("head_chunk")) == chunk), key=lambda r: r["seq"])
            if sel:
                ax.plot([r["seq"] for r in sel], [r[key] for r in sel], marker="o" if impl == "pallas" else "s",
                        linestyle="-" if impl == "pallas" else "--", color=plt.get_cmap("viridis")(i / len(lines)),
                        label=f"{impl} hc={chunk}")
        ax.set(xscale="log", xlabel="sequence length S", ylabel=ylabel, title=" / ".join(panel))
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(rows: Sequence[dict], out_dir: str, stem: str, topology: str) -> list:
    paths = [plot_metric(rows, os.path.join(out_dir, f"memory_{stem}.png"), measure="aot", key="temp_mib",
                         ylabel="HBM temp MiB", title=f"HBM temp (memory_analysis(), AOT for {topology}) vs S"),
             plot_metric(rows, os.path.join(out_dir, f"time_{stem}.png"), measure="wall", key="median_ms",
                         ylabel="median ms", title="TPU wall clock (median of >= 10 runs) vs S")]
    return [p for p in paths if p]
