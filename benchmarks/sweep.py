"""Sweep of the indexer distillation loss: sequence length x head chunk x mode x target x implementation.

For every configuration (preset shape, S, head chunk, mode dense / sparse top-K, target per_head / joint,
implementation pallas / xla) this records, depending on the host:

  aot    (any host with libtpu) forward and forward+backward are AOT-compiled for one chip of --topology
         (`csa_pallas.aot.compile_for_tpu`, real XLA:TPU + Mosaic compilers); status ok / VMEM overflow / HBM overflow
         / SMEM overflow / error with the compiler's first message line; HBM argument / temp / peak bytes from
         `compiled.memory_analysis()`; for dense Pallas rows the teacher kernel's scoped-VMEM limit
         (`ops.dense_layout(problem).cfg.vmem_limit_bytes`).
  check  (--preset tiny, or --check) the kernels run (Pallas interpret mode on a non-TPU backend) on random tiny
         inputs; loss and gradient wrt the logits are compared with implementation="xla" (max abs / rel error).
  wall   (TPU backend only) wall clock of forward and forward+backward: warm-up, median and spread of >= 10 runs
         (block_until_ready), and achieved TFLOP/s of the model FLOPs vs the chip peak (v5p 459 TFLOP/s bf16).

Implementations: pallas = `csa_pallas.indexer_distill_loss(..., implementation="pallas")`; xla = the MaxText-style
baseline `benchmarks.xla_baseline.dense_loss` for dense per_head (scan over H / chunk head chunks), and the pure-JAX
reference (`implementation="xla"`) for the other mode/target combinations, which the baseline does not cover (the
reference has no head chunk: one row per S/mode/target, at the largest swept chunk). A configuration the Pallas
kernels do not cover (`csa_pallas.api.pallas_unsupported_reason`) gets an "unsupported" row naming the reason.
AOT rows of the big presets compile in a child process each (--isolate, default on for them off-TPU): a compiler
crash, host OOM or --compile-timeout costs one row ("error" / "timeout"), not the sweep.

Presets: deepseek-v4-flash (default; H=64 D=512 m=4 W=128 K=512, S 4096/32768/131072), deepseek-v4-pro (H=128),
tiny (H=4 D=32 m=4 W=32 K=16, S 128/256; fwd+bwd only unless --passes; checks at one head chunk unless
--check-all-chunks). --quick: smallest S, one head chunk (largest divisor of H <= 8), fwd+bwd only.

    python -m benchmarks.sweep --preset tiny            # CPU: interpret-mode checks + v5p AOT rows, ~3 min on 2 cores
    python -m benchmarks.sweep --preset tiny --quick    # smallest S, one head chunk, fwd+bwd only
    python -m benchmarks.sweep --preset deepseek-v4-flash --quick
    python -m benchmarks.sweep --preset deepseek-v4-pro --seq 4096 32768 --mode dense --impl pallas

--mesh data=2,heads=4 (repeatable) adds sharded rows: `csa_pallas.sharding.sharded_indexer_distill_loss` compiled
for every chip of --mesh-topology (default v5p:2x2x2, 8 chips; per-device HBM) and, on a TPU slice with enough
devices, timed. The global batch of a mesh row is the preset's batch times the data axis.

    python -m benchmarks.sweep --preset deepseek-v4-flash --seq 4096 --impl pallas --target joint \
        --head-chunk 16 --mesh data=2,heads=4 --mesh seq=8

Outputs (under --out, default results/sweep/): sweep_<preset>.csv / .json (every row, with a `how` column),
memory_<preset>.png (temp MiB vs S, one line per head chunk, Pallas solid vs XLA dashed) and, when measured,
time_<preset>.png. The table on stdout can be read back with `parse_table`.
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
from typing import Optional, Sequence

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.dense_memory import first_error_line, package_fingerprint, time_on_tpu  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = float(1 << 20)
PASSES = ("fwd", "fwd+bwd")
MODES = ("dense", "sparse")
TARGETS = ("per_head", "joint")
IMPLS = ("pallas", "xla")
PEAK_TFLOPS = {"v5p": 459.0, "v5e": 197.0, "v6e": 918.0, "v4": 275.0}
CHECK_TOL = 1e-5  # relative: |loss - ref| / |ref| and max|dI - dI_ref| / max|dI_ref|


# ----------------------------------------------------------------------------------------------------------------------
# Presets and configurations
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    heads: int  # H
    head_dim: int  # D
    ratio: int  # m
    window: int  # W
    topk: int  # K (sparse mode)
    seqs: tuple  # default sequence lengths
    batch: int = 1
    passes: tuple = ("fwd", "fwd+bwd")  # default AOT / wall passes (--passes overrides; --quick: fwd+bwd only)

    @property
    def head_chunks(self) -> tuple:
        """Every divisor of H."""
        return tuple(c for c in range(1, self.heads + 1) if self.heads % c == 0)

    @property
    def quick_head_chunk(self) -> int:
        """The one head chunk of --quick: the largest divisor of H that is <= 8."""
        return max(c for c in self.head_chunks if c <= 8)


PRESETS = {
    "deepseek-v4-flash": Preset("deepseek-v4-flash", heads=64, head_dim=512, ratio=4, window=128, topk=512,
                                seqs=(4096, 32768, 131072)),
    "deepseek-v4-pro": Preset("deepseek-v4-pro", heads=128, head_dim=512, ratio=4, window=128, topk=512,
                              seqs=(4096, 32768, 131072)),
    # CPU preset: fwd+bwd only by default so that the whole sweep (interpret-mode checks + AOT rows) stays ~2-3 min
    # on 2 cores; --passes fwd fwd+bwd adds the forward-only compiles.
    "tiny": Preset("tiny", heads=4, head_dim=32, ratio=4, window=32, topk=16, seqs=(128, 256), passes=("fwd+bwd",)),
}


@dataclasses.dataclass(frozen=True)
class Config:
    seq: int
    head_chunk: int
    mode: str
    target: str
    impl: str

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.target}/{self.impl}/hc={self.head_chunk} S={self.seq}"


def enumerate_configs(preset: Preset, *, seqs: Optional[Sequence[int]] = None,
                      head_chunks: Optional[Sequence[int]] = None, modes: Optional[Sequence[str]] = None,
                      targets: Optional[Sequence[str]] = None, impls: Optional[Sequence[str]] = None,
                      quick: bool = False) -> list:
    """Configurations in sweep order (S, mode, target, impl, head chunk). --quick: smallest S, one head chunk."""
    if seqs is None:
        seqs = preset.seqs[:1] if quick else preset.seqs
    if head_chunks is None:
        head_chunks = (preset.quick_head_chunk,) if quick else preset.head_chunks
    for s in seqs:
        if s <= 0 or s % preset.ratio:
            raise ValueError(f"--seq: S must be a positive multiple of m={preset.ratio}, got {s}")
    for c in head_chunks:
        if c < 1 or preset.heads % c:
            raise ValueError(f"--head-chunk: expected a divisor of H={preset.heads}, got {c}")
    modes = modes or MODES
    targets = targets or TARGETS
    impls = impls or IMPLS
    out = []
    for s in sorted(set(seqs)):
        for mode in MODES:
            if mode not in modes:
                continue
            for target in TARGETS:
                if target not in targets:
                    continue
                for impl in IMPLS:
                    if impl not in impls:
                        continue
                    chunks = sorted(set(head_chunks))
                    if impl == "xla" and not uses_baseline(mode, target):
                        chunks = chunks[-1:]  # the reference ignores head_chunk: one row, at the largest chunk
                    for c in chunks:
                        out.append(Config(seq=s, head_chunk=c, mode=mode, target=target, impl=impl))
    return out


def uses_baseline(mode: str, target: str) -> bool:
    """impl=xla runs the MaxText-style baseline for dense per_head, else the reference (which has no head chunk)."""
    return mode == "dense" and target == "per_head"


def xla_program_name(cfg: Config) -> str:
    if uses_baseline(cfg.mode, cfg.target):
        return "xla_baseline.dense_loss"
    return "reference (implementation='xla'; no head chunk)"


# ----------------------------------------------------------------------------------------------------------------------
# Programs and inputs
# ----------------------------------------------------------------------------------------------------------------------


def arg_names(cfg: Config) -> list:
    names = ["logits", "q", "compressed_kv", "segment_ids"]
    if cfg.mode == "sparse":
        names.append("topk_indices")
    if cfg.target == "joint":
        names += ["window_kv", "sinks"]
    return names


def arg_structs(preset: Preset, cfg: Config) -> list:
    b, s, h, d = preset.batch, cfg.seq, preset.heads, preset.head_dim
    n = s // preset.ratio
    width = preset.topk if cfg.mode == "sparse" else n
    shapes = dict(logits=((b, s, width), jnp.float32), q=((b, s, h, d), jnp.bfloat16),
                  compressed_kv=((b, n, d), jnp.bfloat16), segment_ids=((b, s), jnp.int32),
                  topk_indices=((b, s, preset.topk), jnp.int32), window_kv=((b, s, d), jnp.bfloat16),
                  sinks=((h,), jnp.float32))
    return [jax.ShapeDtypeStruct(*shapes[k]) for k in arg_names(cfg)]


def make_inputs(preset: Preset, cfg: Config, seed: int = 0) -> list:
    """Random concrete inputs in `arg_names` order, generated on the default device (jax.random, so the Flash shape
    never passes through host memory): two packed documents, top-k indices in [-1, N)."""
    b, s, h, d = preset.batch, cfg.seq, preset.heads, preset.head_dim
    n = s // preset.ratio
    k = jax.random.split(jax.random.key(seed), 6)
    width = preset.topk if cfg.mode == "sparse" else n
    makers = dict(
        logits=lambda: jax.random.normal(k[0], (b, s, width), jnp.float32),
        q=lambda: jax.random.normal(k[1], (b, s, h, d), jnp.bfloat16),
        compressed_kv=lambda: jax.random.normal(k[2], (b, n, d), jnp.bfloat16),
        segment_ids=lambda: jnp.broadcast_to((jnp.arange(s) >= s // 3).astype(jnp.int32), (b, s)),
        topk_indices=lambda: jax.random.randint(k[3], (b, s, preset.topk), -1, n, jnp.int32),
        window_kv=lambda: jax.random.normal(k[4], (b, s, d), jnp.bfloat16),
        sinks=lambda: jax.random.normal(k[5], (h,), jnp.float32),
    )
    return [makers[name]() for name in arg_names(cfg)]


def loss_fn(preset: Preset, cfg: Config, implementation: Optional[str] = None):
    """Loss of the `arg_names` inputs. implementation overrides cfg.impl ('xla' = the reference)."""
    import csa_pallas
    from benchmarks import xla_baseline

    impl = implementation or cfg.impl
    names = arg_names(cfg)
    if impl == "xla" and implementation is None and uses_baseline(cfg.mode, cfg.target):
        def baseline(logits, q, kv, seg):
            return xla_baseline.dense_loss(logits, q, kv, segment_ids=seg, compress_ratio=preset.ratio,
                                           head_chunk=cfg.head_chunk)
        return baseline

    def loss(*vals):
        a = dict(zip(names, vals))
        return csa_pallas.indexer_distill_loss(
            a["logits"], a["q"], a["compressed_kv"], segment_ids=a["segment_ids"],
            topk_indices=a.get("topk_indices"), window_kv=a.get("window_kv"), sinks=a.get("sinks"),
            compress_ratio=preset.ratio, window_size=preset.window, target=cfg.target,
            head_chunk=cfg.head_chunk, implementation=impl)
    return loss


def program(preset: Preset, cfg: Config, which: str, implementation: Optional[str] = None):
    loss = loss_fn(preset, cfg, implementation)
    return loss if which == "fwd" else jax.value_and_grad(loss, argnums=0)


def probe_problem(preset: Preset, cfg: Config, fn):
    """fn(problem) on the validated Problem of a configuration, traced with abstract inputs (jax.eval_shape: no
    array is materialised, so it works at the Flash shape); returns fn's Python result."""
    from csa_pallas import validation
    names = arg_names(cfg)
    out = []

    def traced(*vals):
        a = dict(zip(names, vals))
        problem = validation.validate(
            a["q"], a["compressed_kv"], topk_indices=a.get("topk_indices"), window_kv=a.get("window_kv"),
            sinks=a.get("sinks"), segment_ids=a["segment_ids"], compress_ratio=preset.ratio,
            window_size=preset.window, target=cfg.target, head_chunk=cfg.head_chunk, implementation="pallas")
        out.append(fn(problem))
        return jnp.zeros(())

    jax.eval_shape(traced, *arg_structs(preset, cfg))
    return out[0]


def unsupported_reason(preset: Preset, cfg: Config) -> Optional[str]:
    """`csa_pallas.api.pallas_unsupported_reason` of a Pallas configuration (None: supported, or not Pallas)."""
    if cfg.impl != "pallas":
        return None
    from csa_pallas import api
    return probe_problem(preset, cfg, api.pallas_unsupported_reason)


def teacher_vmem_mib(preset: Preset, cfg: Config) -> Optional[float]:
    """The dense teacher kernel's scoped-VMEM limit, `ops.dense_layout(problem).cfg` (dense Pallas rows only)."""
    if cfg.impl != "pallas" or cfg.mode != "dense":
        return None
    try:
        from csa_pallas import ops
        return probe_problem(preset, cfg, lambda pr: ops.dense_layout(pr).cfg.vmem_limit_bytes) / MiB
    except Exception:  # noqa: BLE001 - informational
        return None


def model_flops(preset: Preset, cfg: Config) -> float:
    """Teacher matmul FLOPs 2*B*S*H*D*(N or K) (+ 2*B*S*H*D*W for the joint window), not halved for causality.
    The backward (wrt the logits only) adds no matmul, so fwd and fwd+bwd count the same."""
    b, s, h, d = preset.batch, cfg.seq, preset.heads, preset.head_dim
    width = preset.topk if cfg.mode == "sparse" else s // preset.ratio
    if cfg.target == "joint":
        width += preset.window
    return 2.0 * b * s * h * d * width


# ----------------------------------------------------------------------------------------------------------------------
# Sharded configurations (--mesh): csa_pallas.sharding on a multi-chip topology
# ----------------------------------------------------------------------------------------------------------------------

MESH_AXES = ("data", "heads", "seq")  # data: batch_axes, heads: head_axis, seq: seq_axis


def parse_mesh(text: str) -> dict:
    """'data=2,heads=4' -> {'data': 2, 'heads': 4} (axis names from MESH_AXES, sizes >= 1)."""
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh: expected comma-separated axis=size with axis in {MESH_AXES}, got {text!r}")
        if name in axes:
            raise ValueError(f"--mesh: axis {name!r} given twice in {text!r}")
        axes[name] = int(size)
    return axes


def mesh_label(axes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())


def mesh_batch(preset: Preset, axes: dict) -> int:
    """Global batch of a sharded row: the preset's batch per data shard."""
    return preset.batch * axes.get("data", 1)


def mesh_specs(cfg: Config, axes: dict) -> dict:
    from jax.sharding import PartitionSpec as P
    b = ("data",) if "data" in axes else None
    seq = "seq" if "seq" in axes else None
    heads = "heads" if "heads" in axes else None
    rows = P(b, seq, None)
    return dict(logits=rows, q=P(b, seq, heads, None), compressed_kv=P(b, None, None), segment_ids=P(b, seq),
                topk_indices=rows, window_kv=rows, sinks=P(heads))


def mesh_arg_structs(preset: Preset, cfg: Config, mesh, axes: dict) -> list:
    from jax.sharding import NamedSharding
    batch = mesh_batch(preset, axes)
    specs = mesh_specs(cfg, axes)
    structs = arg_structs(dataclasses.replace(preset, batch=batch), cfg)
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, specs[name]))
            for name, x in zip(arg_names(cfg), structs)]


def mesh_program(preset: Preset, cfg: Config, which: str, mesh, axes: dict):
    from csa_pallas import sharding
    names = arg_names(cfg)

    def loss(*vals):
        a = dict(zip(names, vals))
        return sharding.sharded_indexer_distill_loss(
            mesh, a["logits"], a["q"], a["compressed_kv"], batch_axes=["data"] if "data" in axes else None,
            head_axis="heads" if "heads" in axes else None, seq_axis="seq" if "seq" in axes else None,
            segment_ids=a["segment_ids"], topk_indices=a.get("topk_indices"), window_kv=a.get("window_kv"),
            sinks=a.get("sinks"), compress_ratio=preset.ratio, window_size=preset.window, target=cfg.target,
            head_chunk=cfg.head_chunk, implementation=cfg.impl)
    return loss if which == "fwd" else jax.value_and_grad(loss, argnums=0)


def mesh_aot_row(preset: Preset, cfg: Config, which: str, topology: str, axes: dict, reason: Optional[str]) -> dict:
    """Per-device HBM of the sharded program compiled for every chip of `topology`."""
    from csa_pallas import aot
    row = _new_row(preset, cfg, which, "aot", f"aot {topology} sharded, per-device memory_analysis")
    row.mesh, row.batch = mesh_label(axes), mesh_batch(preset, axes)
    row.program = "csa_pallas.sharding (shard_map)"
    row.package_fingerprint = package_fingerprint()
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    t0 = time.perf_counter()
    try:
        mesh = aot.tpu_mesh(topology, axes)
        compiled = aot.compile_for_tpu(mesh_program(preset, cfg, which, mesh, axes),
                                       *mesh_arg_structs(preset, cfg, mesh, axes), topology=topology)
        rep = aot.memory_report(compiled)
        row.argument_mib, row.output_mib = rep.argument_bytes / MiB, rep.output_bytes / MiB
        row.temp_mib, row.peak_mib = rep.temp_bytes / MiB, rep.peak_bytes / MiB
        row.status = "ok"
    except Exception as e:  # noqa: BLE001 - every configuration gets a row
        row.status, row.error = _error_status(e)
    row.compile_s = time.perf_counter() - t0
    return dataclasses.asdict(row)


def mesh_wall_row(preset: Preset, cfg: Config, which: str, axes: dict, iters: int, peak_tflops: float,
                  reason: Optional[str]) -> dict:
    """Wall clock of the sharded program on the TPU slice this host drives (needs prod(axes) devices)."""
    from jax.sharding import Mesh, NamedSharding
    row = _new_row(preset, cfg, which, "wall", f"TPU wall clock {jax.devices()[0].device_kind} x{math.prod(axes.values())}")
    row.mesh, row.batch = mesh_label(axes), mesh_batch(preset, axes)
    row.package_fingerprint = package_fingerprint()
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    try:
        n = math.prod(axes.values())
        if len(jax.devices()) < n:
            raise NotImplementedError(f"mesh {mesh_label(axes)} needs {n} devices, this host has {len(jax.devices())}")
        mesh = Mesh(np.array(jax.devices()[:n]).reshape(tuple(axes.values())), tuple(axes))
        specs = mesh_specs(cfg, axes)
        inputs = make_inputs(dataclasses.replace(preset, batch=mesh_batch(preset, axes)), cfg)
        inputs = [jax.device_put(x, NamedSharding(mesh, specs[name])) for name, x in zip(arg_names(cfg), inputs)]
        row.__dict__.update(time_on_tpu(mesh_program(preset, cfg, which, mesh, axes), inputs, max(10, iters)))
        row.tflops = model_flops(preset, cfg) * axes.get("data", 1) / (row.median_ms * 1e-3) / 1e12
        row.pct_peak = 100.0 * row.tflops / (peak_tflops * n)
        row.status = "ok"
    except Exception as e:  # noqa: BLE001
        row.status, row.error = _error_status(e)
    return dataclasses.asdict(row)


# ----------------------------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    preset: str
    mode: str
    target: str
    impl: str
    head_chunk: int
    seq: int
    pass_: str
    measure: str  # aot / check / wall
    how: str
    mesh: str = ""  # "data=2,heads=4": sharded rows (--mesh); "": one chip, unsharded
    batch: Optional[int] = None
    status: str = "?"
    error: str = ""
    program: str = ""
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
    package_fingerprint: str = ""


ROW_FIELDS = [f.name for f in dataclasses.fields(Row)]


def classify_error(text: str) -> str:
    """Compile status from an error message."""
    t = text.lower()
    if "vmem" in t and any(k in t for k in ("overflow", "exceed", "out of memory", "limit", "not enough", "oom")):
        return "VMEM overflow"
    if "smem" in t and any(k in t for k in ("overflow", "exceed", "out of memory", "limit", "not enough", "oom")):
        return "SMEM overflow"
    if "hbm" in t or "resource_exhausted" in t or "ran out of memory" in t or "out of memory" in t:
        return "HBM overflow"
    return "error"


def _error_status(e: BaseException):
    if isinstance(e, NotImplementedError):
        return "unsupported", first_error_line(e)
    full = f"{type(e).__name__}: {e}"
    return classify_error(full), first_error_line(e)


def _new_row(preset: Preset, cfg: Config, which: str, measure: str, how: str) -> Row:
    return Row(preset=preset.name, mode=cfg.mode, target=cfg.target, impl=cfg.impl, head_chunk=cfg.head_chunk,
               seq=cfg.seq, pass_=which, measure=measure, how=how, batch=preset.batch,
               program="csa_pallas (implementation='pallas')" if cfg.impl == "pallas" else xla_program_name(cfg))


def aot_row(preset: Preset, cfg: Config, which: str, topology: str, reason: Optional[str]) -> dict:
    from csa_pallas import aot

    row = _new_row(preset, cfg, which, "aot", f"aot {topology} memory_analysis")
    row.package_fingerprint = package_fingerprint()
    row.vmem_limit_mib = teacher_vmem_mib(preset, cfg)
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    t0 = time.perf_counter()
    try:
        compiled = aot.compile_for_tpu(program(preset, cfg, which), *arg_structs(preset, cfg), topology=topology)
        rep = aot.memory_report(compiled)
        row.argument_mib = rep.argument_bytes / MiB
        row.output_mib = rep.output_bytes / MiB
        row.temp_mib = rep.temp_bytes / MiB
        row.peak_mib = rep.peak_bytes / MiB
        row.status = "ok"
        del compiled
    except Exception as e:  # noqa: BLE001 - every configuration gets a row
        row.status, row.error = _error_status(e)
    row.compile_s = time.perf_counter() - t0
    return dataclasses.asdict(row)


def check_row(preset: Preset, cfg: Config, reason: Optional[str]) -> dict:
    """Loss and gradient wrt the logits of cfg (kernels: interpret mode off-TPU) vs implementation='xla'."""
    backend = jax.default_backend()
    how = "interpret-mode CPU vs xla" if backend != "tpu" else "TPU kernels vs xla"
    if backend not in ("cpu", "tpu"):
        how = f"interpret-mode {backend} vs xla"
    row = _new_row(preset, cfg, "fwd+bwd", "check", how)
    row.package_fingerprint = package_fingerprint()
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    t0 = time.perf_counter()
    try:
        args = make_inputs(preset, cfg)
        loss, grad = jax.jit(jax.value_and_grad(loss_fn(preset, cfg), argnums=0))(*args)
        ref_loss, ref_grad = jax.jit(jax.value_and_grad(loss_fn(preset, cfg, "xla"), argnums=0))(*args)
        loss, ref_loss = float(loss), float(ref_loss)
        grad, ref_grad = np.asarray(grad, np.float64), np.asarray(ref_grad, np.float64)
        row.loss = loss
        row.loss_abs_err = abs(loss - ref_loss)
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
        row.status, row.error = _error_status(e)
    row.compile_s = time.perf_counter() - t0  # here: jit + run wall time of both implementations
    return dataclasses.asdict(row)


def aot_row_isolated(preset: Preset, cfg: Config, which: str, topology: str, reason: Optional[str],
                     timeout: float, mesh: Optional[dict] = None) -> dict:
    """`aot_row` in a child interpreter (own process group, killed after `timeout` s): a compiler crash, host OOM or
    hang costs one row, not the sweep."""
    import signal
    import subprocess

    if reason is not None:
        return aot_row(preset, cfg, which, topology, reason) if mesh is None else \
            mesh_aot_row(preset, cfg, which, topology, mesh, reason)
    job = dict(preset=preset.name, cfg=dataclasses.asdict(cfg), which=which, topology=topology, mesh=mesh)
    cmd = [sys.executable, "-m", "benchmarks.sweep", "--_worker", json.dumps(job)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        out, err, timed_out = "", f"compile timeout after {timeout:g} s (killed)", True
    for line in reversed(out.splitlines()):
        if line.startswith("@@ROW "):
            return json.loads(line[len("@@ROW "):])
    row = _new_row(preset, cfg, which, "aot", f"aot {topology} memory_analysis")
    if mesh is not None:
        row.mesh, row.batch = mesh_label(mesh), mesh_batch(preset, mesh)
    tail = [ln for ln in err.splitlines() if ln.strip() and "WARNING" not in ln]
    row.status = "timeout" if timed_out else "error"
    row.error = (f"worker exited {proc.returncode}: " if proc.returncode and not timed_out else "") + (tail[-1][:300] if tail
                                                                                      else "no output")
    row.compile_s = time.perf_counter() - t0
    return dataclasses.asdict(row)


def _worker(job_json: str) -> int:
    job = json.loads(job_json)
    preset, cfg = PRESETS[job["preset"]], Config(**job["cfg"])
    if job.get("mesh"):
        row = mesh_aot_row(preset, cfg, job["which"], job["topology"], job["mesh"], None)
    else:
        row = aot_row(preset, cfg, job["which"], job["topology"], None)
    print("@@ROW " + json.dumps(row), flush=True)
    return 0


# --- TPU wall clock (only on a TPU backend; not exercised on CPU hosts) -----------------------------------------------


def chip_peak_tflops(topology: str) -> float:
    return PEAK_TFLOPS.get(topology.split(":")[0], PEAK_TFLOPS["v5p"])


def wall_row(preset: Preset, cfg: Config, which: str, iters: int, peak_tflops: float, reason: Optional[str]) -> dict:
    row = _new_row(preset, cfg, which, "wall", f"TPU wall clock {jax.devices()[0].device_kind}")
    row.package_fingerprint = package_fingerprint()
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    try:
        row.__dict__.update(time_on_tpu(program(preset, cfg, which), make_inputs(preset, cfg), max(10, iters)))
        row.tflops = model_flops(preset, cfg) / (row.median_ms * 1e-3) / 1e12
        row.pct_peak = 100.0 * row.tflops / peak_tflops
        row.status = "ok"
    except Exception as e:  # noqa: BLE001
        row.status, row.error = _error_status(e)
    return dataclasses.asdict(row)


# ----------------------------------------------------------------------------------------------------------------------
# Table (format + parse)
# ----------------------------------------------------------------------------------------------------------------------

# (row key, header, kind): kind "s" string, "i" int, "f1"/"f3"/"e" floats
COLUMNS = [
    ("mode", "mode", "s"), ("target", "target", "s"), ("impl", "impl", "s"), ("head_chunk", "hc", "i"),
    ("seq", "S", "i"), ("mesh", "mesh", "s"), ("batch", "B", "i"), ("pass_", "pass", "s"),
    ("measure", "measure", "s"), ("status", "status", "s"),
    ("argument_mib", "arg MiB", "f1"), ("temp_mib", "temp MiB", "f1"), ("peak_mib", "peak MiB", "f1"),
    ("vmem_limit_mib", "VMEM lim MiB", "f1"), ("compile_s", "compile s", "f1"), ("median_ms", "median ms", "f3"),
    ("spread_pct", "spread %", "f1"), ("tflops", "TFLOP/s", "f1"), ("pct_peak", "% peak", "f1"),
    ("loss_rel_err", "loss rel err", "e"), ("grad_abs_err", "grad abs err", "e"),
    ("grad_rel_err", "grad rel err", "e"), ("how", "how", "s"),
]


def header_lines(preset: Preset, topology: str, backend: str) -> list:
    tpu = backend == "tpu"
    return [
        f"# sweep preset={preset.name} (B={preset.batch} H={preset.heads} D={preset.head_dim} m={preset.ratio} "
        f"W={preset.window} K={preset.topk}; q/kv/window_kv bf16, logits/sinks f32, ids int32)",
        f"# aot rows: AOT compile for {topology} (one chip) on a {backend} host; HBM MiB from "
        "compiled.memory_analysis() (peak = arg + out - alias + temp); compile s = lower+compile wall time; "
        "VMEM lim = dense teacher kernel's vmem_limit_bytes",
        "# check rows: " + ("kernels run on the TPU" if tpu else f"Pallas interpret mode on {backend}") +
        f" on random inputs, loss and dI vs implementation='xla' (pass if rel err <= {CHECK_TOL:g}); "
        "compile s = jit+run wall time of both",
        "# wall rows: " + (f"TPU wall clock on {jax.devices()[0].device_kind}, median / spread of >= 10 runs after "
                           "warm-up (block_until_ready); TFLOP/s from model FLOPs 2*B*S*H*D*(N|K [+W])"
                           if tpu else "none (no TPU backend on this host; wall clock is only measured on a TPU)"),
        "# xla impl: benchmarks.xla_baseline.dense_loss (scan over H/hc head chunks) for dense per_head, else the "
        "pure-JAX reference (implementation='xla'; it has no head chunk: one row, at the largest hc)",
    ]


def _cell(value, kind: str) -> str:
    if value is None or value == "":
        return "-"
    if kind == "s":
        return str(value).replace("|", "/")
    if kind == "i":
        return str(int(value))
    if kind == "e":
        return f"{value:.2e}"
    return f"{value:.{int(kind[1:])}f}"


def format_table(rows: Sequence[dict], header: Sequence[str] = ()) -> str:
    """Header comment lines, a '|'-separated table (one line per row) and the error notes."""
    cells = [[_cell(r.get(k), kind) for k, _, kind in COLUMNS] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(COLUMNS)]
    right = [kind != "s" for _, _, kind in COLUMNS]

    def line(vals):
        return "| " + " | ".join(v.rjust(w) if rt else v.ljust(w) for v, w, rt in zip(vals, widths, right)) + " |"

    out = list(header)
    out.append(line([h for _, h, _ in COLUMNS]))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out.extend(line(c) for c in cells)
    notes = [f"  {r['mode']}/{r['target']}/{r['impl']}/hc={r['head_chunk']} S={r['seq']} {r['pass_']} "
             f"{r['measure']}: {r['status']}: {r['error']}" for r in rows if r.get("error")]
    if notes:
        out.append("notes (first message line):")
        out.extend(notes)
    return "\n".join(out)


def parse_table(text: str) -> list:
    """Rows of a `format_table` text (other lines are ignored); '-' cells become None, numbers are parsed."""
    headers = [h for _, h, _ in COLUMNS]
    rows, cols = [], None
    for raw in text.splitlines():
        line = raw.strip()
        if not (line.startswith("|") and line.endswith("|")):
            cols = None if not line.startswith("|") else cols
            continue
        parts = [p.strip() for p in line[1:-1].split("|")]
        if parts == headers:
            cols = COLUMNS
            continue
        if cols is None or set(line) <= set("|-"):
            continue
        row = {}
        for (key, _, kind), v in zip(cols, parts):
            if v == "-":
                row[key] = None
            elif kind == "i":
                row[key] = int(v)
            elif kind == "s":
                row[key] = v
            else:
                row[key] = float(v)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Files and plots
# ----------------------------------------------------------------------------------------------------------------------


def write_csv_json(rows: Sequence[dict], out_dir: str, stem: str, meta: dict) -> tuple:
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, stem + ".csv")
    json_path = os.path.join(out_dir, stem + ".json")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in ROW_FIELDS})
    with open(json_path, "w") as f:
        json.dump(dict(meta, rows=list(rows)), f, indent=1)
    return csv_path, json_path


def plot_metric(rows: Sequence[dict], path: str, *, measure: str, key: str, ylabel: str, title: str) -> Optional[str]:
    """One panel per (mode, target, pass); x = S (log2), one line per (impl, head chunk): Pallas solid, XLA dashed.
    Returns the path, or None when no row has the value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("measure") == measure and r.get("status") == "ok" and r.get(key) is not None
           and r.get("mesh", "-") in ("-", None, "")]  # one-chip rows; sharded rows are per-device, not comparable
    if not pts:
        return None
    panels = sorted({(r["mode"], r["target"], r["pass_"]) for r in pts},
                    key=lambda p: (MODES.index(p[0]) if p[0] in MODES else 9,
                                   TARGETS.index(p[1]) if p[1] in TARGETS else 9, p[2]))
    ncol = min(2, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 4.0 * nrow), squeeze=False)
    chunks = sorted({int(r["head_chunk"]) for r in pts})
    cmap = plt.get_cmap("viridis")
    for ax, (mode, target, which) in zip(axes.flat, panels):
        for impl in IMPLS:
            for i, c in enumerate(chunks):
                sel = sorted((r for r in pts if (r["mode"], r["target"], r["pass_"], r["impl"]) ==
                              (mode, target, which, impl) and int(r["head_chunk"]) == c), key=lambda r: r["seq"])
                if not sel:
                    continue
                ax.plot([r["seq"] for r in sel], [r[key] for r in sel], marker="o" if impl == "pallas" else "s",
                        linestyle="-" if impl == "pallas" else "--",
                        color=cmap(i / max(1, len(chunks) - 1) * 0.9),
                        label=(f"{impl} hc={c}" if impl == "pallas" or uses_baseline(mode, target)
                               else "xla reference"))
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{mode} / {target} / {which}", fontsize=9)
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(ylabel)
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
                         ylabel="HBM temp MiB",
                         title=f"HBM temp (compiled.memory_analysis(), AOT for {topology}) vs S")]
    paths.append(plot_metric(rows, os.path.join(out_dir, f"time_{stem}.png"), measure="wall", key="median_ms",
                             ylabel="median ms", title="TPU wall clock (median of >= 10 runs) vs S"))
    return [p for p in paths if p]


# ----------------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument("--quick", action="store_true", help="fewest configs: smallest S, one head chunk, fwd+bwd only")
    p.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (default: the preset's)")
    p.add_argument("--head-chunk", type=int, nargs="+", default=None, help="head chunks (default: every divisor of H)")
    p.add_argument("--mode", nargs="+", choices=MODES, default=None)
    p.add_argument("--target", nargs="+", choices=TARGETS, default=None)
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=None)
    p.add_argument("--passes", nargs="+", choices=PASSES, default=None,
                   help="default: the preset's (flash/pro: fwd fwd+bwd; tiny: fwd+bwd); --quick: fwd+bwd")
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--mesh", action="append", type=parse_mesh, default=None, metavar="AXIS=N[,AXIS=N]",
                   help="also compile (and on a TPU slice, time) the sharded loss (csa_pallas.sharding) on this mesh; "
                        "axes data (batch), heads, seq; repeatable, e.g. --mesh data=2,heads=4 --mesh seq=8. Pallas "
                        "configs only; the global batch is the preset's times data")
    p.add_argument("--mesh-topology", default="v5p:2x2x2",
                   help="multi-chip topology of the --mesh AOT rows (its chip count must equal each mesh's size)")
    p.add_argument("--iters", type=int, default=10, help="timed runs per configuration on a TPU (>= 10)")
    p.add_argument("--out", default=os.path.join("results", "sweep"), help="output directory")
    p.add_argument("--no-aot", action="store_true", help="skip the AOT compile rows")
    p.add_argument("--isolate", choices=["auto", "on", "off"], default="auto",
                   help="compile each AOT row in a child process (crash / host-OOM / hang isolation, ~5 s start-up "
                        "per row); auto = on for the big presets on a non-TPU host, off for tiny")
    p.add_argument("--compile-timeout", type=float, default=3600.0, help="seconds per isolated AOT row")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    chk = p.add_mutually_exclusive_group()
    chk.add_argument("--check", dest="check", action="store_true", default=None,
                     help="run the kernels vs the reference (default: only for --preset tiny)")
    p.add_argument("--check-all-chunks", action="store_true",
                   help="check every swept head chunk (default: one per S/mode/target, the largest divisor of H <= 8 "
                        "if swept, else the largest swept)")
    chk.add_argument("--no-check", dest="check", action="store_false")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a._worker is not None:
        return _worker(a._worker)
    preset = PRESETS[a.preset]
    configs = enumerate_configs(preset, seqs=a.seq, head_chunks=a.head_chunk, modes=a.mode, targets=a.target,
                                impls=a.impl, quick=a.quick)
    backend = jax.default_backend()
    from csa_pallas import aot
    do_aot = not a.no_aot and aot.libtpu_available()
    do_check = a.check if a.check is not None else preset.name == "tiny"
    do_wall = backend == "tpu"
    isolate = a.isolate == "on" or (a.isolate == "auto" and preset.name != "tiny" and backend != "tpu")
    passes = a.passes or (["fwd+bwd"] if a.quick else list(preset.passes))
    swept = sorted({c.head_chunk for c in configs})
    check_chunk = preset.quick_head_chunk if preset.quick_head_chunk in swept else (swept[-1] if swept else None)

    jobs = []  # (kind, cfg, which[, mesh axes])
    for cfg in configs:
        if do_check and cfg.impl == "pallas" and (a.check_all_chunks or cfg.head_chunk == check_chunk):
            jobs.append(("check", cfg, "fwd+bwd"))
        if do_aot:
            jobs += [("aot", cfg, w) for w in passes]
        if do_wall:
            jobs += [("wall", cfg, w) for w in passes]
        for axes in (a.mesh or []) if cfg.impl == "pallas" else []:
            if do_aot:
                jobs += [("aot-mesh", cfg, w, axes) for w in passes]
            if do_wall:
                jobs += [("wall-mesh", cfg, w, axes) for w in passes]

    header = header_lines(preset, a.topology, backend)
    if a.mesh:
        header.append(f"# mesh rows (--mesh): csa_pallas.sharding under shard_map, AOT for {a.mesh_topology} "
                      "(all its chips); MiB are PER DEVICE; B = the preset's batch x data")
    if not do_aot:
        header.append("# aot rows: skipped (" + ("--no-aot" if a.no_aot else "libtpu not installed") + ")")
    meta = dict(preset=dataclasses.asdict(preset), topology=a.topology, backend=backend, jax_version=jax.__version__,
                header=header, argv=list(argv) if argv is not None else sys.argv[1:])
    stem = preset.name + ("_quick" if a.quick else "")
    rows, reasons, t_start = [], {}, time.perf_counter()
    peak = chip_peak_tflops(a.topology)
    for i, (kind, cfg, which, *mesh) in enumerate(jobs, 1):
        axes = mesh[0] if mesh else None
        where = f" mesh {mesh_label(axes)}" if axes else ""
        print(f"[{i}/{len(jobs)}] {kind} {cfg.label}{where} {which} ...", file=sys.stderr, flush=True)
        if cfg not in reasons:
            try:
                reasons[cfg] = unsupported_reason(preset, cfg)
            except Exception as e:  # noqa: BLE001 - the probe failed: let the run itself report the error
                print(f"        (support probe failed: {first_error_line(e)})", file=sys.stderr, flush=True)
                reasons[cfg] = None
        t0 = time.perf_counter()
        if kind == "check":
            row = check_row(preset, cfg, reasons[cfg])
        elif kind == "aot":
            row = (aot_row_isolated(preset, cfg, which, a.topology, reasons[cfg], a.compile_timeout) if isolate
                   else aot_row(preset, cfg, which, a.topology, reasons[cfg]))
        elif kind == "aot-mesh":
            row = (aot_row_isolated(preset, cfg, which, a.mesh_topology, reasons[cfg], a.compile_timeout, axes)
                   if isolate else mesh_aot_row(preset, cfg, which, a.mesh_topology, axes, reasons[cfg]))
        elif kind == "wall-mesh":
            row = mesh_wall_row(preset, cfg, which, axes, a.iters, peak, reasons[cfg])
        else:
            row = wall_row(preset, cfg, which, a.iters, peak, reasons[cfg])
        rows.append(row)
        print(f"        -> {row['status']} ({time.perf_counter() - t0:.1f} s) {row['error'][:160]}",
              file=sys.stderr, flush=True)
        write_csv_json(rows, a.out, f"sweep_{stem}", meta)  # partial results survive an interrupt
    meta["elapsed_s"] = time.perf_counter() - t_start
    csv_path, json_path = write_csv_json(rows, a.out, f"sweep_{stem}", meta)
    plots = write_plots(rows, a.out, stem, a.topology)
    print(format_table(rows, header))
    checks = [r for r in rows if r["measure"] == "check"]
    bad = [r for r in checks if r["status"] not in ("ok", "unsupported")]
    if checks:
        print(f"\ninterpret-mode checks: {len(checks) - len(bad)}/{len(checks)} ok or unsupported"
              + ("" if not bad else f"; FAILED: {', '.join(r['mode'] + '/' + r['target'] + '/hc=' + str(r['head_chunk']) + ' S=' + str(r['seq']) for r in bad)}"))
    print(f"\n{len(rows)} rows in {meta['elapsed_s']:.1f} s; wrote {csv_path}, {json_path}"
          + "".join(f", {p}" for p in plots))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
