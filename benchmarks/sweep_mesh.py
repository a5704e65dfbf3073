"""The sweep's sharded rows (`--mesh data=2,heads=4`): `csa_pallas.sharding.sharded_indexer_distill_loss` compiled
for every chip of --mesh-topology (per-device HBM) and, on a TPU slice with enough devices, timed. The global batch
of a mesh row is the shape's batch times the data axis.

    python -m benchmarks.sweep --shape deepseek-v4-flash --seq 4096 --impl pallas --target joint \\
        --head-chunk 16 --mesh data=2,heads=4 --mesh seq=8
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from benchmarks import harness, sweep

import jax  # noqa: E402  (after harness: ALLOW_MULTIPLE_LIBTPU_LOAD)
import numpy as np  # noqa: E402

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


def add_arguments(p) -> None:
    p.add_argument("--mesh", action="append", type=parse_mesh, default=None, metavar="AXIS=N[,AXIS=N]",
                   help="also compile (and on a TPU slice, time) the sharded loss on this mesh; axes data (batch), "
                        "heads, seq; repeatable. Pallas configs only; the global batch is the shape's times data")
    p.add_argument("--mesh-topology", default="v5p:2x2x2",
                   help="multi-chip topology of the --mesh AOT rows (its chip count must equal each mesh's size)")


def header_lines(a) -> list:
    if not a.mesh:
        return []
    return [f"# mesh rows (--mesh): csa_pallas.sharding under shard_map, AOT for {a.mesh_topology} (all its chips); "
            "MiB are PER DEVICE; B = the shape's batch x data"]


def label(axes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())


def where(axes: Optional[dict]) -> str:
    return f" mesh {label(axes)}" if axes else ""


def global_shape(shape: harness.Shape, axes: dict) -> harness.Shape:
    """The shape with the global batch of a sharded row: the shape's batch per data shard."""
    return dataclasses.replace(shape, batch=shape.batch * axes.get("data", 1))


def specs(axes: dict) -> dict:
    from jax.sharding import PartitionSpec as P
    b = ("data",) if "data" in axes else None
    seq = "seq" if "seq" in axes else None
    heads = "heads" if "heads" in axes else None
    rows = P(b, seq, None)
    return dict(logits=rows, q=P(b, seq, heads, None), compressed_kv=P(b, None, None), segment_ids=P(b, seq),
                topk_indices=rows, window_kv=rows, sinks=P(heads))


def mesh_structs(shape: harness.Shape, cfg: sweep.Config, mesh, axes: dict) -> list:
    from jax.sharding import NamedSharding
    spec = specs(axes)
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec[name]))
            for name, x in zip(sweep.arg_names(cfg), sweep.arg_structs(global_shape(shape, axes), cfg))]


def mesh_program(shape: harness.Shape, cfg: sweep.Config, which: str, mesh, axes: dict):
    from csa_pallas import sharding

    def loss(*vals):
        a = dict(zip(sweep.arg_names(cfg), vals))
        return sharding.sharded_indexer_distill_loss(
            mesh, a["logits"], a["q"], a["compressed_kv"], batch_axes=["data"] if "data" in axes else None,
            head_axis="heads" if "heads" in axes else None, seq_axis="seq" if "seq" in axes else None,
            segment_ids=a.get("segment_ids"), topk_indices=a.get("topk_indices"), window_kv=a.get("window_kv"),
            sinks=a.get("sinks"), compress_ratio=shape.ratio, window_size=shape.window, target=cfg.target,
            head_chunk=cfg.head_chunk, implementation=cfg.impl)
    return loss if which == "fwd" else jax.value_and_grad(loss, argnums=0)


def _row(shape, cfg, which, measure, how, axes) -> harness.Row:
    row = sweep.new_row(shape, cfg, which, measure, how)
    row.mesh, row.batch, row.program = label(axes), global_shape(shape, axes).batch, "csa_pallas.sharding (shard_map)"
    return row


def aot_row(shape_name: str, cfg: dict, which: str, topology: str, axes: dict, reason: Optional[str] = None) -> dict:
    """Per-device HBM of the sharded program compiled for every chip of `topology` (JSON-able arguments)."""
    from csa_pallas import aot
    shape, cfg = harness.SHAPES[shape_name], sweep.Config(**cfg)
    row = _row(shape, cfg, which, "aot", f"aot {topology} sharded, per-device memory_analysis", axes)
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    try:
        mesh = aot.tpu_mesh(topology, axes)
    except Exception as e:  # noqa: BLE001
        return dataclasses.asdict(harness.record_error(row, e))
    return dataclasses.asdict(harness.compile_row(row, mesh_program(shape, cfg, which, mesh, axes),
                                                  mesh_structs(shape, cfg, mesh, axes), topology))


def wall_row(shape: harness.Shape, cfg: sweep.Config, which: str, axes: dict, iters: int, peak_tflops: float,
             reason: Optional[str]) -> dict:
    """Wall clock of the sharded program on the TPU slice this host drives (needs prod(axes) devices)."""
    from jax.sharding import Mesh, NamedSharding
    n = math.prod(axes.values())
    row = _row(shape, cfg, which, "wall", f"TPU wall clock {jax.devices()[0].device_kind} x{n}", axes)
    if reason is not None:
        row.status, row.error = "unsupported", reason
        return dataclasses.asdict(row)
    try:
        if len(jax.devices()) < n:
            raise NotImplementedError(f"mesh {label(axes)} needs {n} devices, this host has {len(jax.devices())}")
        mesh = Mesh(np.array(jax.devices()[:n]).reshape(tuple(axes.values())), tuple(axes))
        spec = specs(axes)
        inputs = [jax.device_put(x, NamedSharding(mesh, spec[name])) for name, x in
                  zip(sweep.arg_names(cfg), sweep.make_inputs(global_shape(shape, axes), cfg))]
        row.__dict__.update(harness.time_on_tpu(mesh_program(shape, cfg, which, mesh, axes), inputs, max(10, iters)))
        row.tflops = sweep.model_flops(shape, cfg) * axes.get("data", 1) / (row.median_ms * 1e-3) / 1e12
        row.pct_peak = 100.0 * row.tflops / (peak_tflops * n)
        row.status = "ok"
    except Exception as e:  # noqa: BLE001
        harness.record_error(row, e)
    return dataclasses.asdict(row)


def row(kind: str, a, shape: harness.Shape, cfg: sweep.Config, which: str, axes: dict, reason: Optional[str],
        isolate: bool, peak_tflops: float) -> dict:
    """The sweep's 'aot-mesh' / 'wall-mesh' jobs."""
    if kind == "wall-mesh":
        return wall_row(shape, cfg, which, axes, a.iters, peak_tflops, reason)
    kwargs = dict(shape_name=shape.name, cfg=dataclasses.asdict(cfg), which=which, topology=a.mesh_topology,
                  axes=axes)
    if isolate and reason is None:
        failed = _row(shape, cfg, which, "aot", f"aot {a.mesh_topology} sharded (child process)", axes)
        return harness.run_isolated("benchmarks.sweep_mesh:aot_row", kwargs, a.compile_timeout, failed)
    return aot_row(reason=reason, **kwargs)
