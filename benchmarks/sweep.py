"""Sweep of the indexer distillation loss: sequence length x head chunk x mode x target x implementation.

For every configuration (shape, S, head chunk, mode dense / sparse top-K, target per_head / joint, implementation
pallas / xla) this records, depending on the host (the `how` column of every row says which):

  aot    (any host with libtpu) the forward and forward+backward compiled for one chip of --topology (real
         XLA:TPU + Mosaic compilers): status ok / VMEM / HBM / SMEM overflow / error with the compiler's first line;
         HBM argument / temp / peak from `memory_analysis()`; dense Pallas rows: the teacher's scoped-VMEM limit.
  check  (--shape tiny, or --check) the kernels run (interpret mode off-TPU) on random inputs; loss and gradient
         wrt the logits against implementation="xla" (relative error).
  wall   (TPU backend only) wall clock: median and spread of >= 10 runs, TFLOP/s of the model FLOPs vs the peak.

Implementations: pallas = `csa_pallas.indexer_distill_loss(implementation="pallas")`, head chunk `auto` = the
kernels' default; xla = the MaxText-style baseline `benchmarks.xla_baseline.dense_loss` for dense per_head (a scan
over H / chunk head chunks) and the pure-JAX reference (`implementation="xla"`, no head chunk: one row) for the
other combinations. Ids: `--ids default` (one document, nothing passed: the kernels' static causal schedule) or
`packed` (two documents, segment ids passed: the metadata-table schedule).

    python -m benchmarks.sweep --shape tiny                 # CPU: interpret-mode checks + v5p AOT rows, ~2 min
    python -m benchmarks.sweep --shape tiny --quick         # smallest S, one head chunk, fwd+bwd only
    python -m benchmarks.sweep --shape deepseek-v4-flash --mode dense --head-chunk auto 1 8 64 --passes fwd+bwd

`--mesh data=2,heads=4` (repeatable) adds sharded rows (`benchmarks.sweep_mesh`). Outputs under --out (default
results/sweep/): sweep_<shape>.csv / .json (every row), memory_<shape>.png (temp MiB vs S, one line per head
chunk) and, when timed, time_<shape>.png. The printed table reads back with `sweep_report.parse_table`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Optional, Sequence

from benchmarks import harness  # noqa: E402  (sets ALLOW_MULTIPLE_LIBTPU_LOAD before jax loads libtpu)
from benchmarks.sweep_report import chunk_label, format_table, write_plots  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

PASSES = ("fwd", "fwd+bwd")
MODES = ("dense", "sparse")
TARGETS = ("per_head", "joint")
IMPLS = ("pallas", "xla")
IDS = ("default", "packed")
CHECK_TOL = 1e-5  # relative: |loss - ref| / |ref| and max|dI - dI_ref| / max|dI_ref|
AUTO = None  # head chunk: the kernels' default


@dataclasses.dataclass(frozen=True)
class Config:
    seq: int
    head_chunk: Optional[int]  # None: the kernels' default (pallas) / no head chunk (reference)
    mode: str
    target: str
    impl: str
    ids: str = "default"

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.target}/{self.impl}/hc={chunk_label(self.head_chunk)} S={self.seq} ids={self.ids}"


def parse_head_chunk(text: str) -> Optional[int]:
    return AUTO if text == "auto" else int(text)


def uses_baseline(mode: str, target: str) -> bool:
    """impl=xla runs the MaxText-style baseline for dense per_head, else the reference (which has no head chunk)."""
    return mode == "dense" and target == "per_head"


def enumerate_configs(shape: harness.Shape, *, seqs: Optional[Sequence[int]] = None,
                      head_chunks: Optional[Sequence[Optional[int]]] = None, modes: Optional[Sequence[str]] = None,
                      targets: Optional[Sequence[str]] = None, impls: Optional[Sequence[str]] = None,
                      quick: bool = False, ids: str = "default") -> list:
    """Configurations in sweep order (S, mode, target, impl, head chunk). --quick: smallest S, one head chunk."""
    seqs = seqs or (shape.seqs[:1] if quick else shape.seqs)
    head_chunks = head_chunks or ((shape.quick_head_chunk,) if quick else shape.head_chunks)
    for s in seqs:
        if s <= 0 or s % shape.ratio:
            raise ValueError(f"--seq: S must be a positive multiple of m={shape.ratio}, got {s}")
    for c in head_chunks:
        if c is not AUTO and (c < 1 or shape.heads % c):
            raise ValueError(f"--head-chunk: expected 'auto' or a divisor of H={shape.heads}, got {c}")
    chunks = sorted(set(head_chunks), key=lambda c: -1 if c is AUTO else c)
    out = []
    for s in sorted(set(seqs)):
        for mode in [m for m in MODES if m in (modes or MODES)]:
            for target in [t for t in TARGETS if t in (targets or TARGETS)]:
                for impl in [i for i in IMPLS if i in (impls or IMPLS)]:
                    if impl == "xla" and not uses_baseline(mode, target):
                        these = [AUTO]  # the reference has no head chunk: one row
                    elif impl == "xla":
                        these = [c for c in chunks if c is not AUTO]  # the baseline needs a chunk
                    else:
                        these = chunks
                    out += [Config(s, c, mode, target, impl, ids) for c in these]
    return out


# ---------------------------------------------------------------------------------------------- programs, inputs

def arg_names(cfg: Config) -> list:
    names = ["logits", "q", "compressed_kv"]
    names += ["segment_ids"] if cfg.ids == "packed" else []
    names += ["topk_indices"] if cfg.mode == "sparse" else []
    names += ["window_kv", "sinks"] if cfg.target == "joint" else []
    return names


def logits_width(shape: harness.Shape, cfg: Config) -> int:
    return shape.topk if cfg.mode == "sparse" else shape.blocks(cfg.seq)


def arg_structs(shape: harness.Shape, cfg: Config) -> list:
    return harness.input_structs(shape, arg_names(cfg), cfg.seq, logits_width(shape, cfg))


def make_inputs(shape: harness.Shape, cfg: Config, seed: int = 0) -> list:
    """Random concrete inputs in `arg_names` order, made on the default device (jax.random: the Flash shape never
    passes through host memory); packed ids: two documents; top-k indices in [-1, N)."""
    keys = dict(zip(harness.INPUT_DTYPES, jax.random.split(jax.random.key(seed), len(harness.INPUT_DTYPES))))
    out = []
    for name, st in zip(arg_names(cfg), arg_structs(shape, cfg)):
        if name == "segment_ids":
            out.append(jnp.broadcast_to((jnp.arange(cfg.seq) >= cfg.seq // 3).astype(jnp.int32), st.shape))
        elif name == "topk_indices":
            out.append(jax.random.randint(keys[name], st.shape, -1, shape.blocks(cfg.seq), jnp.int32))
        else:
            out.append(jax.random.normal(keys[name], st.shape, st.dtype))
    return out


def loss_fn(shape: harness.Shape, cfg: Config, implementation: Optional[str] = None):
    """Loss of the `arg_names` inputs. implementation overrides cfg.impl ('xla' = the reference)."""
    import csa_pallas
    from benchmarks import xla_baseline

    names = arg_names(cfg)
    if implementation is None and cfg.impl == "xla" and uses_baseline(cfg.mode, cfg.target):
        def baseline(*vals):
            a = dict(zip(names, vals))
            return xla_baseline.dense_loss(a["logits"], a["q"], a["compressed_kv"], segment_ids=a.get("segment_ids"),
                                           compress_ratio=shape.ratio, head_chunk=cfg.head_chunk)
        return baseline

    def loss(*vals):
        a = dict(zip(names, vals))
        return csa_pallas.indexer_distill_loss(
            a["logits"], a["q"], a["compressed_kv"], segment_ids=a.get("segment_ids"),
            topk_indices=a.get("topk_indices"), window_kv=a.get("window_kv"), sinks=a.get("sinks"),
            compress_ratio=shape.ratio, window_size=shape.window, target=cfg.target, head_chunk=cfg.head_chunk,
            implementation=implementation or cfg.impl)
    return loss


def program(shape: harness.Shape, cfg: Config, which: str, implementation: Optional[str] = None):
    loss = loss_fn(shape, cfg, implementation)
    return loss if which == "fwd" else jax.value_and_grad(loss, argnums=0)


def probe_problem(shape: harness.Shape, cfg: Config, fn):
    """fn(problem) on the validated Problem of a configuration, traced abstractly (jax.eval_shape: works at the
    Flash shape without memory); returns fn's Python result."""
    from csa_pallas import validation
    out = []

    def traced(*vals):
        a = dict(zip(arg_names(cfg), vals))
        out.append(fn(validation.validate(
            a["q"], a["compressed_kv"], topk_indices=a.get("topk_indices"), window_kv=a.get("window_kv"),
            sinks=a.get("sinks"), segment_ids=a.get("segment_ids"), compress_ratio=shape.ratio,
            window_size=shape.window, target=cfg.target, head_chunk=cfg.head_chunk, implementation="pallas")))
        return jnp.zeros(())

    jax.eval_shape(traced, *arg_structs(shape, cfg))
    return out[0]


def unsupported_reason(shape: harness.Shape, cfg: Config) -> Optional[str]:
    """`csa_pallas.api.pallas_unsupported_reason` of a Pallas configuration (None: supported, or not Pallas)."""
    if cfg.impl != "pallas":
        return None
    from csa_pallas import api
    return probe_problem(shape, cfg, api.pallas_unsupported_reason)


def teacher_vmem_mib(shape: harness.Shape, cfg: Config) -> Optional[float]:
    """The dense teacher kernel's scoped-VMEM limit (dense Pallas rows only)."""
    if cfg.impl != "pallas" or cfg.mode != "dense":
        return None
    from csa_pallas import ops
    return probe_problem(shape, cfg, lambda pr: ops.dense_layout(pr).cfg.vmem_limit_bytes) / harness.MiB


def model_flops(shape: harness.Shape, cfg: Config) -> float:
    """Teacher matmul FLOPs 2 B S H D (N or K) (+ 2 B S H D W for the joint window), not halved for causality;
    the backward (wrt the logits) adds no matmul, so fwd and fwd+bwd count the same."""
    width = logits_width(shape, cfg) + (shape.window if cfg.target == "joint" else 0)
    return 2.0 * shape.batch * cfg.seq * shape.heads * shape.head_dim * width


# --------------------------------------------------------------------------------------------------------- rows

def new_row(shape: harness.Shape, cfg: Config, which: str, measure: str, how: str) -> harness.Row:
    prog = ("csa_pallas (implementation='pallas')" if cfg.impl == "pallas" else
            "xla_baseline.dense_loss" if uses_baseline(cfg.mode, cfg.target) else "reference (implementation='xla')")
    return harness.Row(bench="sweep", shape=shape.name, program=prog, mode=cfg.mode, target=cfg.target,
                       impl=cfg.impl, head_chunk=cfg.head_chunk, seq=cfg.seq, heads=shape.heads, batch=shape.batch,
                       ids=cfg.ids, width=shape.topk if cfg.mode == "sparse" else None, pass_=which,
                       measure=measure, how=how, package_fingerprint=harness.package_fingerprint())


def aot_row(shape_name: str, cfg: dict, which: str, topology: str, reason: Optional[str] = None) -> dict:
    """Memory of the one-chip program compiled for `topology` (arguments are JSON-able: it runs in a child too)."""
    shape, cfg = harness.SHAPES[shape_name], Config(**cfg)
    row = new_row(shape, cfg, which, "aot", f"aot {topology} memory_analysis")
    row.vmem_limit_mib = teacher_vmem_mib(shape, cfg)
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    return dataclasses.asdict(harness.compile_row(row, program(shape, cfg, which), arg_structs(shape, cfg), topology))


def check_row(shape: harness.Shape, cfg: Config, reason: Optional[str]) -> dict:
    """Loss and gradient wrt the logits (kernels: interpret mode off-TPU) against implementation='xla'."""
    backend = jax.default_backend()
    row = new_row(shape, cfg, "fwd+bwd", "check",
                  "TPU kernels vs xla" if backend == "tpu" else f"interpret-mode {backend.upper()} vs xla")
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    t0 = time.perf_counter()
    try:
        args = make_inputs(shape, cfg)
        loss, grad = jax.jit(jax.value_and_grad(loss_fn(shape, cfg), argnums=0))(*args)
        ref_loss, ref_grad = jax.jit(jax.value_and_grad(loss_fn(shape, cfg, "xla"), argnums=0))(*args)
        loss, ref_loss = float(loss), float(ref_loss)
        grad, ref_grad = np.asarray(grad, np.float64), np.asarray(ref_grad, np.float64)
        row.loss, row.loss_abs_err = loss, abs(loss - ref_loss)
        row.loss_rel_err = row.loss_abs_err / max(abs(ref_loss), 1e-30)
        row.grad_abs_err = float(np.max(np.abs(grad - ref_grad)))
        row.grad_rel_err = row.grad_abs_err / max(float(np.max(np.abs(ref_grad))), 1e-30)
        finite = math.isfinite(loss) and bool(np.all(np.isfinite(grad)))
        ok = finite and row.loss_rel_err <= CHECK_TOL and row.grad_rel_err <= CHECK_TOL
        row.status = "ok" if ok else "MISMATCH"
        if not ok:
            row.error = (f"loss rel err {row.loss_rel_err:.2e}, grad rel err {row.grad_rel_err:.2e} "
                         f"(tolerance {CHECK_TOL:g}; finite={finite})")
    except Exception as e:  # noqa: BLE001
        harness.record_error(row, e)
    row.compile_s = time.perf_counter() - t0  # here: jit + run wall time of both implementations
    return dataclasses.asdict(row)


def wall_row(shape: harness.Shape, cfg: Config, which: str, iters: int, peak_tflops: float,
             reason: Optional[str]) -> dict:
    """TPU wall clock (only on a TPU backend)."""
    row = new_row(shape, cfg, which, "wall", f"TPU wall clock {jax.devices()[0].device_kind}")
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    try:
        row.__dict__.update(harness.time_on_tpu(program(shape, cfg, which), make_inputs(shape, cfg), max(10, iters)))
        row.tflops = model_flops(shape, cfg) / (row.median_ms * 1e-3) / 1e12
        row.pct_peak = 100.0 * row.tflops / peak_tflops
        row.status = "ok"
    except Exception as e:  # noqa: BLE001
        harness.record_error(row, e)
    return dataclasses.asdict(row)


def isolated(call: str, kwargs: dict, timeout: float, shape: harness.Shape, cfg: Config, which: str,
             topology: str) -> dict:
    """A row function in a child interpreter (`harness.run_isolated`)."""
    failed = new_row(shape, cfg, which, "aot", f"aot {topology} memory_analysis (child process)")
    return harness.run_isolated(call, kwargs, timeout, failed)


# ------------------------------------------------------------------------------------------------------- header

def header_lines(shape: harness.Shape, topology: str, backend: str) -> list:
    s = shape
    return [
        f"# sweep shape={s.name} (B={s.batch} H={s.heads} D={s.head_dim} m={s.ratio} W={s.window} K={s.topk}; "
        "q/kv/window_kv bf16, logits/sinks f32)",
        f"# aot rows: compiled for {topology} (one chip) on a {backend} host; HBM MiB from compiled.memory_analysis() "
        "(peak = arg + out - alias + temp); compile s = lower+compile wall time",
        "# check rows: " + ("kernels on the TPU" if backend == "tpu" else f"Pallas interpret mode on {backend}") +
        f", loss and dI vs implementation='xla' (ok if rel err <= {CHECK_TOL:g}); compile s = jit+run of both",
        "# wall rows: " + ("TPU wall clock, median / spread of >= 10 runs after warm-up" if backend == "tpu"
                           else "none (no TPU backend on this host)"),
    ]


# ------------------------------------------------------------------------------------------------------------ CLI

def build_parser() -> argparse.ArgumentParser:
    from benchmarks import sweep_mesh
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v4-flash", choices=sorted(harness.SHAPES))
    p.add_argument("--quick", action="store_true", help="smallest S, one head chunk, fwd+bwd only")
    p.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (default: the shape's)")
    p.add_argument("--head-chunk", type=parse_head_chunk, nargs="+", default=None,
                   help="head chunks: 'auto' (the kernels' default) or divisors of H (default: every divisor)")
    p.add_argument("--mode", nargs="+", choices=MODES, default=None)
    p.add_argument("--target", nargs="+", choices=TARGETS, default=None)
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=None)
    p.add_argument("--ids", choices=IDS, default="default",
                   help="default: one document, no ids passed; packed: two documents, segment ids passed")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=None, help="default: the shape's; --quick: fwd+bwd")
    p.add_argument("--topology", default="v5p:2x2x1")
    sweep_mesh.add_arguments(p)
    p.add_argument("--iters", type=int, default=10, help="timed runs per configuration on a TPU (>= 10)")
    p.add_argument("--out", default=os.path.join("results", "sweep"), help="output directory")
    p.add_argument("--no-aot", action="store_true", help="skip the AOT compile rows")
    p.add_argument("--isolate", choices=["auto", "on", "off"], default="auto",
                   help="compile each AOT row in a child process (auto: on for the big shapes off-TPU)")
    p.add_argument("--compile-timeout", type=float, default=3600.0, help="seconds per isolated AOT row")
    chk = p.add_mutually_exclusive_group()
    chk.add_argument("--check", dest="check", action="store_true", default=None,
                     help="run the kernels vs the reference (default: only for --shape tiny)")
    chk.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--check-all-chunks", action="store_true", help="check every swept head chunk (default: one)")
    return p


def plan_jobs(a, shape: harness.Shape, configs: list, do_aot: bool, do_check: bool, do_wall: bool) -> list:
    """(kind, cfg, pass[, mesh axes]) in run order."""
    passes = a.passes or (["fwd+bwd"] if a.quick else list(shape.passes))
    swept = sorted({c.head_chunk for c in configs if c.head_chunk is not AUTO})
    check_chunk = shape.quick_head_chunk if shape.quick_head_chunk in swept else (swept[-1] if swept else AUTO)
    jobs = []
    for cfg in configs:
        if do_check and cfg.impl == "pallas" and (a.check_all_chunks or cfg.head_chunk == check_chunk):
            jobs.append(("check", cfg, "fwd+bwd"))
        jobs += [("aot", cfg, w) for w in passes if do_aot] + [("wall", cfg, w) for w in passes if do_wall]
        for axes in (a.mesh or []) if cfg.impl == "pallas" else []:
            jobs += [("aot-mesh", cfg, w, axes) for w in passes if do_aot]
            jobs += [("wall-mesh", cfg, w, axes) for w in passes if do_wall]
    return jobs


def main(argv=None) -> int:
    from benchmarks import sweep_mesh
    from csa_pallas import aot
    a = build_parser().parse_args(argv)
    shape = harness.SHAPES[a.shape]
    configs = enumerate_configs(shape, seqs=a.seq, head_chunks=a.head_chunk, modes=a.mode, targets=a.target,
                                impls=a.impl, quick=a.quick, ids=a.ids)
    backend = jax.default_backend()
    do_aot = not a.no_aot and aot.libtpu_available()
    isolate = a.isolate == "on" or (a.isolate == "auto" and shape.name != "tiny" and backend != "tpu")
    jobs = plan_jobs(a, shape, configs, do_aot, a.check if a.check is not None else shape.name == "tiny",
                     backend == "tpu")
    header = header_lines(shape, a.topology, backend) + sweep_mesh.header_lines(a)
    if not do_aot:
        header.append("# aot rows: skipped (" + ("--no-aot" if a.no_aot else "libtpu not installed") + ")")
    meta = dict(shape=dataclasses.asdict(shape), topology=a.topology, backend=backend, jax_version=jax.__version__,
                header=header, argv=list(argv) if argv is not None else sys.argv[1:])
    stem = shape.name + ("_quick" if a.quick else "")
    rows, reasons, t_start = [], {}, time.perf_counter()
    peak = harness.PEAK_TFLOPS.get(a.topology.split(":")[0], harness.PEAK_TFLOPS["v5p"])
    for i, (kind, cfg, which, *mesh) in enumerate(jobs, 1):
        axes = mesh[0] if mesh else None
        print(f"[{i}/{len(jobs)}] {kind} {cfg.label}{sweep_mesh.where(axes)} {which} ...", file=sys.stderr, flush=True)
        if cfg not in reasons:
            try:
                reasons[cfg] = unsupported_reason(shape, cfg)
            except Exception as e:  # noqa: BLE001 - the probe failed: the run itself reports the error
                print(f"        (support probe failed: {harness.first_error_line(e)})", file=sys.stderr, flush=True)
                reasons[cfg] = None
        reason, t0 = reasons[cfg], time.perf_counter()
        if kind == "check":
            row = check_row(shape, cfg, reason)
        elif kind == "aot":
            kwargs = dict(shape_name=shape.name, cfg=dataclasses.asdict(cfg), which=which, topology=a.topology)
            row = (isolated("benchmarks.sweep:aot_row", kwargs, a.compile_timeout, shape, cfg, which, a.topology)
                   if isolate and reason is None else aot_row(reason=reason, **kwargs))
        elif kind == "wall":
            row = wall_row(shape, cfg, which, a.iters, peak, reason)
        else:
            row = sweep_mesh.row(kind, a, shape, cfg, which, axes, reason, isolate, peak)
        rows.append(row)
        print(f"        -> {row['status']} ({time.perf_counter() - t0:.1f} s) {row['error'][:160]}",
              file=sys.stderr, flush=True)
        harness.write_rows(rows, a.out, f"sweep_{stem}", meta)  # partial results survive an interrupt
    meta["elapsed_s"] = time.perf_counter() - t_start
    csv_path, json_path = harness.write_rows(rows, a.out, f"sweep_{stem}", meta)
    plots = write_plots(rows, a.out, stem, a.topology)
    print(format_table(rows, header))
    checks = [r for r in rows if r["measure"] == "check"]
    bad = [r for r in checks if r["status"] not in ("ok", "unsupported")]
    if checks:
        print(f"\ninterpret-mode checks: {len(checks) - len(bad)}/{len(checks)} ok or unsupported"
              + "".join(f"; FAILED: {r['mode']}/{r['target']}/hc={r['head_chunk']} S={r['seq']}" for r in bad))
    print(f"\n{len(rows)} rows in {meta['elapsed_s']:.1f} s; wrote {csv_path}, {json_path}"
          + "".join(f", {p}" for p in plots))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
