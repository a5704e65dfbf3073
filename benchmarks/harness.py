"""The one benchmark harness: shapes, the row record, the estimator adapter, the child-process protocol, files.

Every benchmark module (`sweep`, `estimates`, `sparse`, `demo`) builds its programs from a `Shape`, records what
it measured in `Row`s (one record type: each row fills the fields of what it measured and says how in `how`),
gets static v5p estimates through `estimate` (the only caller of `../shared/tools/tpu_estimate.py`), compiles a
configuration in a child interpreter through `run_isolated` (a compiler crash, host OOM or timeout costs one row)
and writes CSV / JSON with `write_rows`. Targets are not in code: the README compares the numbers with them.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import importlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = float(1 << 20)
V5P_PEAK_FLOPS = 459e12  # bf16 MXU peak of one v5p chip
V5P_HBM_BYTES_PER_S = 2.46e12  # the bandwidth floor of the benchmarks' max(estimate, bytes / bandwidth)
PEAK_TFLOPS = {"v5p": 459.0, "v5e": 197.0, "v6e": 918.0, "v4": 275.0}  # for TFLOP/s of wall rows on those chips


# --------------------------------------------------------------------------------------------------------- shapes

@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's widths: B, H, D, m (compress ratio), W (window), K (top-k of sparse mode), default S values."""
    name: str
    heads: int
    head_dim: int
    ratio: int
    window: int
    topk: int
    seqs: tuple
    batch: int = 1
    passes: tuple = ("fwd", "fwd+bwd")  # default passes of the sweep (--passes overrides)
    index_heads: int = 64  # H_I of the lightning indexer (V4: 64)
    index_dim: int = 128  # d_I

    @property
    def head_chunks(self) -> tuple:
        """Every divisor of H."""
        return tuple(c for c in range(1, self.heads + 1) if self.heads % c == 0)

    @property
    def quick_head_chunk(self) -> int:
        """The largest divisor of H that is <= 8 (the sweep's --quick chunk)."""
        return max(c for c in self.head_chunks if c <= 8)

    def blocks(self, seq: int) -> int:
        return seq // self.ratio


SHAPES = {
    "deepseek-v4-flash": Shape("deepseek-v4-flash", heads=64, head_dim=512, ratio=4, window=128, topk=512,
                               seqs=(4096, 32768, 131072)),
    "deepseek-v4-pro": Shape("deepseek-v4-pro", heads=128, head_dim=512, ratio=4, window=128, topk=1024,
                             seqs=(4096, 32768, 131072)),
    # CPU shape (MaxText's deepseek4-tiny widths): fwd+bwd only so that a sweep stays ~2 min on 2 cores.
    "tiny": Shape("tiny", heads=4, head_dim=32, ratio=4, window=32, topk=16, seqs=(128, 256), passes=("fwd+bwd",)),
}
FLASH = SHAPES["deepseek-v4-flash"]

# Every input a loss program can take: (shape, dtype) from the shape, S and the logits' width (N or K).
INPUT_DTYPES = dict(logits=jnp.float32, q=jnp.bfloat16, compressed_kv=jnp.bfloat16, segment_ids=jnp.int32,
                    topk_indices=jnp.int32, window_kv=jnp.bfloat16, sinks=jnp.float32, full_lse=jnp.float32,
                    index_q=jnp.bfloat16, index_k=jnp.bfloat16, index_weights=jnp.bfloat16)


def input_shape(shape: Shape, name: str, seq: int, width: int) -> tuple:
    b, h, d, n = shape.batch, shape.heads, shape.head_dim, shape.blocks(seq)
    h_i, d_i = shape.index_heads, shape.index_dim
    return dict(logits=(b, seq, width), q=(b, seq, h, d), compressed_kv=(b, n, d), segment_ids=(b, seq),
                topk_indices=(b, seq, width), window_kv=(b, seq, d), sinks=(h,), full_lse=(b, seq, h),
                index_q=(b, seq, h_i, d_i), index_k=(b, n, d_i), index_weights=(b, seq, h_i))[name]


def input_structs(shape: Shape, names: Sequence[str], seq: int, width: int) -> list:
    """Abstract inputs (jax.ShapeDtypeStruct) in `names` order."""
    return [jax.ShapeDtypeStruct(input_shape(shape, k, seq, width), INPUT_DTYPES[k]) for k in names]


# ------------------------------------------------------------------------------------------------------------ rows

@dataclasses.dataclass
class Row:
    """One measurement. Identity fields first; each benchmark fills the measured fields it has and says how."""
    bench: str = ""  # sweep / estimates / sparse / demo
    shape: str = ""
    program: str = ""
    mode: str = ""
    target: str = ""
    impl: str = ""
    head_chunk: Optional[int] = None  # None: the kernels' default
    seq: Optional[int] = None
    width: Optional[int] = None  # K of sparse rows
    heads: Optional[int] = None
    batch: Optional[int] = None
    mesh: str = ""  # "data=2,heads=4": sharded rows (per-device memory); "": one chip
    ids: str = ""  # "default" (one document, nothing passed) or "packed" (segment ids passed)
    pattern: str = ""  # sparse selection pattern
    pass_: str = ""
    measure: str = ""  # aot / check / wall / estimate
    how: str = ""
    status: str = "?"
    error: str = ""
    argument_mib: Optional[float] = None
    output_mib: Optional[float] = None
    temp_mib: Optional[float] = None
    peak_mib: Optional[float] = None
    vmem_limit_mib: Optional[float] = None
    compile_s: Optional[float] = None
    median_ms: Optional[float] = None
    min_ms: Optional[float] = None
    max_ms: Optional[float] = None
    spread_pct: Optional[float] = None
    runs: Optional[int] = None
    tflops: Optional[float] = None
    pct_peak: Optional[float] = None
    loss: Optional[float] = None
    loss_abs_err: Optional[float] = None
    loss_rel_err: Optional[float] = None
    grad_abs_err: Optional[float] = None
    grad_rel_err: Optional[float] = None
    est_us: Optional[float] = None  # tpu_estimate BEST ESTIMATE
    bundle_us: Optional[float] = None
    no_floor_us: Optional[float] = None
    derived_us: Optional[float] = None  # sparse visit path: from the active tiles of the pattern's indices
    hbm_bytes: Optional[float] = None
    bw_floor_us: Optional[float] = None  # hbm_bytes / 2.46 TB/s
    best_us: Optional[float] = None  # max(estimate, bandwidth floor)
    dmas: Optional[int] = None
    floor_us: Optional[float] = None  # MXU floor
    note: str = ""
    package_fingerprint: str = ""


ROW_FIELDS = [f.name for f in dataclasses.fields(Row)]


def row_from_dict(d: dict) -> Row:
    """A Row from a saved dict (unknown keys are ignored; NaN from older files becomes None)."""
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items() if k in ROW_FIELDS}
    return Row(**clean)


def first_error_line(e: BaseException) -> str:
    for line in f"{type(e).__name__}: {e}".splitlines():
        if line.strip():
            return line.strip()[:300]
    return type(e).__name__


def classify_error(text: str) -> str:
    """Compile status from an error message."""
    t = text.lower()
    full = any(k in t for k in ("overflow", "exceed", "out of memory", "limit", "not enough", "oom"))
    if "vmem" in t and full:
        return "VMEM overflow"
    if "smem" in t and full:
        return "SMEM overflow"
    if "hbm" in t or "resource_exhausted" in t or "ran out of memory" in t or "out of memory" in t:
        return "HBM overflow"
    return "error"


def record_error(row: Row, e: BaseException) -> Row:
    """status / error of a failed measurement: NotImplementedError is 'unsupported', else the compiler's class."""
    row.status = "unsupported" if isinstance(e, NotImplementedError) else classify_error(f"{type(e).__name__}: {e}")
    row.error = first_error_line(e)
    return row


def package_fingerprint() -> str:
    """sha1 (12 hex) of the csa_pallas sources as imported: which package a row was measured with."""
    import csa_pallas
    root = os.path.dirname(os.path.abspath(csa_pallas.__file__))
    h = hashlib.sha1()
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(dirpath, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:12]


# ----------------------------------------------------------------------------------------------- what is measured

def record_memory(row: Row, compiled) -> Row:
    """HBM bytes of a compiled program (`memory_analysis()`, exact for it) into the row; peak is the larger of
    arguments + outputs + temp and XLA's own peak (`aot.MemoryReport.peak_bytes`)."""
    from csa_pallas import aot
    rep = aot.memory_report(compiled)
    row.argument_mib, row.output_mib = rep.argument_bytes / MiB, rep.output_bytes / MiB
    row.temp_mib, row.peak_mib = rep.temp_bytes / MiB, rep.peak_bytes / MiB
    return row


def compile_row(row: Row, fn: Callable, structs: Sequence, topology: str) -> Row:
    """AOT-compile fn for `topology` (every chip of it: shardings in `structs` pick the devices) and record the
    memory and the compile time; a failure is a status, not an exception."""
    from csa_pallas import aot
    t0 = time.perf_counter()
    try:
        record_memory(row, aot.compile_for_tpu(fn, *structs, topology=topology))
        row.status = "ok"
    except Exception as e:  # noqa: BLE001 - every configuration gets a row
        record_error(row, e)
    row.compile_s = time.perf_counter() - t0
    return row


def time_on_tpu(fn: Callable, args: Sequence, iters: int, warmup: int = 2) -> dict:
    """Wall clock of jit(fn)(*args) on the TPU: median / min / max / spread of `iters` runs after warm-up."""
    jitted = jax.jit(fn)
    for _ in range(warmup):
        jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    return dict(median_ms=med, min_ms=min(times), max_ms=max(times),
                spread_pct=100.0 * (max(times) - min(times)) / med, runs=len(times))


# ------------------------------------------------------------------------------------------ the estimator adapter

def load_tpu_estimate():
    """`../shared/tools/tpu_estimate.py` (or $CSA_PALLAS_TPU_ESTIMATE_DIR) as a module."""
    tools = os.path.abspath(os.environ.get("CSA_PALLAS_TPU_ESTIMATE_DIR", os.path.join(REPO, "..", "shared", "tools")))
    if not os.path.exists(os.path.join(tools, "tpu_estimate.py")):
        raise SystemExit(f"static estimates: tpu_estimate.py not found in {tools} (set CSA_PALLAS_TPU_ESTIMATE_DIR)")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import tpu_estimate
    return tpu_estimate


def _no_floor_us(rep: dict) -> Optional[float]:
    """Sum over ops of max(bundle estimate, libtpu profile) + top-level overhead: the estimate without the HBM floor
    (useful for XLA scan programs, whose HBM floor the tool over-counts - see its README)."""
    total = 0.0
    for op in rep["ops"]:
        vals = [op.get(k) for k in ("bundle_est_cycles", "libtpu_profile_cycles") if op.get(k) is not None]
        if not vals or op.get("calls") is None:
            return None
        total += max(vals) * op["calls"]
    total += rep["totals"].get("tlp_overhead_bundles") or 0
    return total / rep["assumptions"]["clock_hz"] * 1e6


def estimate(row: Row, fn: Callable, args: Sequence, *, topology: str = "v5p:2x2x1", libtpu_profile: str = "off",
             timeout: float = 3600, estimator=None, **options) -> Row:
    """Static v5p estimate of fn(*args) with the kernels lowered for Mosaic, into the row: est_us (BEST ESTIMATE),
    bundle_us, no_floor_us, hbm_bytes (declared HBM traffic, gathers included), bw_floor_us, best_us
    (max(estimate, bytes / 2.46 TB/s)), memory; the estimator's unresolved-branch warnings go to `note`.
    Estimates of the compiled bundles, not measurements."""
    from csa_pallas.kernels import runtime

    def on_tpu(*a):
        with runtime.compiling_for_tpu():
            return fn(*a)

    te = estimator or load_tpu_estimate()
    row.measure, row.how = "estimate", f"tpu_estimate BEST ESTIMATE ({topology}, libtpu profile {libtpu_profile})"
    try:
        rep = te.estimate(on_tpu, *args, topology=topology, libtpu_profile=libtpu_profile, timeout=timeout,
                          name=(row.program or "fn").replace(" ", "_"), **options)
    except Exception as e:  # noqa: BLE001 - the row records the failure
        return record_error(row, e)
    s, mem = rep["summary"], rep.get("memory", {})
    row.est_us, row.bundle_us = s.get("best_estimate_us"), s.get("bundle_est_us")
    row.no_floor_us = _no_floor_us(rep)
    row.hbm_bytes = (rep.get("roofline") or {}).get("bytes")
    row.bw_floor_us = row.hbm_bytes / V5P_HBM_BYTES_PER_S * 1e6 if row.hbm_bytes else None
    if row.est_us is None and s.get("bundle_est_lower_bound_us") is not None:
        row.note = f"lower bound {s['bundle_est_lower_bound_us']:.0f} us (data-dependent trip count)"
    if row.est_us is not None:
        row.best_us = max(row.est_us, row.bw_floor_us or 0.0)
    row.temp_mib = (mem.get("temp_bytes") or 0) / MiB
    row.peak_mib = (mem.get("peak_bytes") or 0) / MiB
    warn = [w for w in rep.get("warnings", []) if "NOT determined" in w or "budget" in w or "NO bundle" in w]
    row.note = "; ".join(filter(None, [row.note] + warn))[:300]
    row.status = ("ok" if row.est_us is not None else
                  "lower bound" if row.note.startswith("lower bound") else "no estimate")
    return row


# ------------------------------------------------------------------------------------ the child-process protocol

ROW_MARK = "@@ROW "


def run_isolated(call: str, kwargs: dict, timeout: float, failed: Row) -> dict:
    """`module:function`(**kwargs) -> row dict, run in a child interpreter (own process group, killed after
    `timeout` s). A crash, host OOM or timeout returns `failed` with status error / timeout and the child's last
    stderr line."""
    cmd = [sys.executable, "-m", "benchmarks.harness", json.dumps(dict(call=call, kwargs=kwargs))]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        out, err, timed_out = "", f"timeout after {timeout:g} s (killed)", True
    for line in reversed(out.splitlines()):
        if line.startswith(ROW_MARK):
            return json.loads(line[len(ROW_MARK):])
    tail = [ln for ln in err.splitlines() if ln.strip() and "WARNING" not in ln]
    failed.status = "timeout" if timed_out else "error"
    failed.error = (f"worker exited {proc.returncode}: " if proc.returncode and not timed_out else "") + (
        tail[-1][:300] if tail else "no output")
    failed.compile_s = time.perf_counter() - t0
    return dataclasses.asdict(failed)


def _child(job_json: str) -> int:
    job = json.loads(job_json)
    module, _, name = job["call"].partition(":")
    row = getattr(importlib.import_module(module), name)(**job["kwargs"])
    print(ROW_MARK + json.dumps(row if isinstance(row, dict) else dataclasses.asdict(row)), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------------- files

def write_rows(rows: Sequence, out_dir: str, stem: str, meta: Optional[dict] = None) -> tuple:
    """<out_dir>/<stem>.csv (every Row field) and .json (meta + rows); returns both paths."""
    dicts = [r if isinstance(r, dict) else dataclasses.asdict(r) for r in rows]
    os.makedirs(out_dir, exist_ok=True)
    csv_path, json_path = os.path.join(out_dir, stem + ".csv"), os.path.join(out_dir, stem + ".json")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        w.writeheader()
        for r in dicts:
            w.writerow({k: r.get(k) for k in ROW_FIELDS})
    with open(json_path, "w") as f:
        json.dump(dict(meta or {}, rows=dicts), f, indent=1)
    return csv_path, json_path


def read_rows(path: str) -> list:
    """Rows of a `write_rows` JSON (or of an older list-of-rows file)."""
    with open(path) as f:
        data = json.load(f)
    return [row_from_dict(r) for r in (data["rows"] if isinstance(data, dict) else data)]


# ----------------------------------------------------------------------------------------------------------- tables

def cell(value, kind: str) -> str:
    """kind: "s" string, "i" int, "e" float in e-notation, "f<n>" float with n decimals ("-" for no value)."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "s":
        return str(value).replace("|", "/")
    if kind == "i":
        return str(int(value))
    if kind == "e":
        return f"{value:.2e}"
    return f"{value:,.{int(kind[1:])}f}"


def format_table(rows: Sequence[dict], columns: Sequence[tuple], header: Sequence[str] = ()) -> str:
    """Header lines, then a '|' table of `columns` ((row key, heading, kind) triples), then the rows' errors."""
    cells = [[cell(r.get(k), kind) for k, _, kind in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(columns)]
    right = [kind != "s" for _, _, kind in columns]

    def line(vals):
        return "| " + " | ".join(v.rjust(w) if rt else v.ljust(w) for v, w, rt in zip(vals, widths, right)) + " |"

    out = list(header) + [line([h for _, h, _ in columns]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(c) for c in cells)
    notes = [f"  {r.get('program') or r.get('mode')} S={r.get('seq')} {r.get('pass_', '')} {r.get('measure', '')}: "
             f"{r['status']}: {r['error']}" for r in rows if r.get("error")]
    if notes:
        out += ["notes (first message line):"] + notes
    return "\n".join(out)


def parse_table(text: str, columns: Sequence[tuple]) -> list:
    """Rows of a `format_table` text (other lines are ignored); '-' cells become None, numbers are parsed."""
    headings = [h for _, h, _ in columns]
    rows, inside = [], False
    for raw in text.splitlines():
        line = raw.strip()
        if not (line.startswith("|") and line.endswith("|")):
            inside = False
            continue
        parts = [p.strip() for p in line[1:-1].split("|")]
        if parts == headings:
            inside = True
            continue
        if not inside or set(line) <= set("|-"):
            continue
        row = {}
        for (key, _, kind), v in zip(columns, parts):
            row[key] = None if v == "-" else v if kind == "s" else int(v) if kind == "i" else float(v.replace(",", ""))
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
