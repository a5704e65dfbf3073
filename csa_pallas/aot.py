"""Compile a jitted function for a TPU topology on any host (no TPU needed) and read its memory use.

With libtpu installed (the `jax[tpu]` extra), `jax.experimental.topologies` gives abstract TPU devices; lowering
and compiling against them runs the real XLA:TPU and Mosaic compilers, so VMEM overflows, unsupported ops and bad
tilings fail here exactly as on the chip, and `memory_analysis()` reports the program's HBM bytes.

    compiled = compile_for_tpu(jax.grad(loss), sds_a, sds_b)   # jax.ShapeDtypeStruct inputs
    compiled.memory_analysis().temp_size_in_bytes

libtpu takes a process lock when it loads; set ALLOW_MULTIPLE_LIBTPU_LOAD=1 (done here) so several compile-only
processes (tests, benchmarks) can coexist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
from typing import Any, Callable, Sequence

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402


DEFAULT_TOPOLOGY = "v5p:2x2x1"


@contextlib.contextmanager
def _quiet_stderr():
    """Silences file descriptor 2 (libtpu's C++ start-up warnings about TPU_WORKER_HOSTNAMES and the accelerator
    type, meaningless on a host that only compiles); what was written is re-emitted if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


@functools.lru_cache(maxsize=None)
def tpu_devices(topology: str = DEFAULT_TOPOLOGY):
    """Abstract TPU devices of `topology` (e.g. 'v5p:2x2x1' = 4 chips). Raises RuntimeError without libtpu."""
    try:
        with _quiet_stderr():
            return tuple(topologies.get_topology_desc(topology, "tpu").devices)
    except Exception as e:  # libtpu missing or unknown topology
        raise RuntimeError(f"cannot build TPU topology {topology!r} (is libtpu installed? pip install "
                           f"'jax[tpu]==0.10.2'): {e}") from e


def libtpu_available() -> bool:
    try:
        tpu_devices(DEFAULT_TOPOLOGY)
        return True
    except RuntimeError:
        return False


def single_chip_mesh(topology: str = DEFAULT_TOPOLOGY, axis_name: str = "x") -> Mesh:
    return Mesh(np.array(tpu_devices(topology)[:1]), (axis_name,))


def tpu_mesh(topology: str, axes: dict) -> Mesh:
    """A mesh over all chips of `topology` with named axes, e.g. tpu_mesh('v5p:2x2x2', {'data': 2, 'heads': 4}).
    The product of the axis sizes must be the number of chips."""
    devices = tpu_devices(topology)
    sizes = tuple(axes.values())
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"axes: sizes {axes} multiply to {int(np.prod(sizes))}, but topology {topology!r} has "
                         f"{len(devices)} chips")
    return Mesh(np.array(devices).reshape(sizes), tuple(axes))


def sharded_struct(shape: Sequence[int], dtype, mesh: Mesh, spec: PartitionSpec) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))


def _place(tree, sharding):
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "shape"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or sharding)
        return x
    return jax.tree_util.tree_map(one, tree)


def compile_for_tpu(fn: Callable, *args: Any, topology: str = DEFAULT_TOPOLOGY, static_kwargs=None):
    """AOT-compiles `fn(*args, **static_kwargs)` for one chip of `topology`.

    Args:
      fn: a function of arrays (it is wrapped in `jax.jit`).
      args: pytrees of `jax.ShapeDtypeStruct` (or arrays; only shape and dtype are used). A struct that already
        carries a sharding keeps it (multi-chip compiles); the rest are replicated on a one-chip mesh.
      topology: TPU topology string, default 'v5p:2x2x1'.
      static_kwargs: Python values bound into `fn`.

    Returns:
      The `jax.stages.Compiled` program (`.memory_analysis()`, `.as_text()`, `.cost_analysis()`).
    """
    sharding = NamedSharding(single_chip_mesh(topology), PartitionSpec())
    placed = [_place(a, sharding) for a in args]
    bound = functools.partial(fn, **(static_kwargs or {}))
    # No context needed: the kernels follow the lowering platform (`kernels.runtime`), so this is exactly the
    # plain `jax.jit(...).lower(...).compile()` a MaxText AOT run does.
    return jax.jit(bound).lower(*placed).compile()


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """HBM bytes of a compiled program (from `memory_analysis()`).

    compiler_peak_bytes is XLA's own peak (`peak_memory_in_bytes`): it also counts what the temp field can leave
    out, the executable's constants (v5p: a 64 MiB constant was in it and not in temp) and, on v6e, buffers its
    temp field omits (the dense per_head loss at S = 32K, Flash widths: peak 4,320.2 MB on v5p, TPU7x and v6e
    alike, temp 17.0 / 17.1 / 0 MB; the v6e compiler also keeps more arrays in VMEM, memory space S(1), and
    whether its peak counts those is not documented). `peak_bytes` takes the larger, so it errs high, never low.
    0 when the backend does not report it."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    compiler_peak_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """The larger of arguments + outputs - aliased + temp and XLA's own peak."""
        return max(self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes,
                   self.compiler_peak_bytes)

    @property
    def working_bytes(self) -> int:
        """HBM beyond the arguments and outputs at the peak: temp, or more where XLA's own peak says so (compare
        programs across chips by this, not by temp)."""
        return self.peak_bytes - (self.argument_bytes + self.output_bytes - self.alias_bytes)


def memory_report(compiled) -> MemoryReport:
    m = compiled.memory_analysis()
    return MemoryReport(argument_bytes=int(m.argument_size_in_bytes), output_bytes=int(m.output_size_in_bytes),
                        alias_bytes=int(m.alias_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes),
                        compiler_peak_bytes=int(getattr(m, "peak_memory_in_bytes", 0) or 0))


def compile_memory(fn: Callable, *args: Any, topology: str = DEFAULT_TOPOLOGY, static_kwargs=None) -> MemoryReport:
    """`compile_for_tpu` followed by `memory_report`."""
    return memory_report(compile_for_tpu(fn, *args, topology=topology, static_kwargs=static_kwargs))


def struct(shape: Sequence[int], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)
