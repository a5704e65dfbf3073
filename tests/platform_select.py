"""Which devices the suite runs on, decided before jax initialises (imported by conftest.py).

  * A TPU host (libtpu's chip device files exist: /dev/accel* on v4/v5e, /dev/vfio/<n> on v5p/v6e): the suite runs
    on the chips, so every kernel test without an interpreter pin compiles Mosaic and runs it on the TPU, and the
    sharded tests use the slice's chips (4 on a v5p-8: their meshes shrink to fit, `fit_mesh_axes`).
  * Any other host: the CPU with 8 host devices (`--xla_force_host_platform_device_count=8`) and the Pallas
    interpreter, compiled by XLA:CPU's loop emitters (`--xla_cpu_use_fusion_emitters=false`, `CPU_FLAGS`).
  * CSA_PALLAS_TEST_PLATFORM=cpu|tpu overrides the detection; an explicit JAX_PLATFORMS is left alone.
"""

import glob
import math
import os

HOST_DEVICES = 8
# XLA flags of a CPU run, each added unless XLA_FLAGS sets it. An interpreted kernel is a large program (one HLO op
# per ref access, slot loops unrolled), and compiling it dominates the interpreter tests: XLA:CPU's loop emitters
# compile it ~3.8x faster than its fusion emitters (a gather-kernel test: 11.5 -> 3.0 s of backend compile,
# 18.8 -> 9.6 s in all), and LLVM without its optimisation passes (`xla_backend_optimization_level=0`; each test
# program runs once or twice, so optimising its machine code costs more than it saves) another 7-14% of an
# interpreter file's time with two files side by side, as CI runs its parts (README "Tests"; no fast math either
# way, but two programs of the same arithmetic can round apart: `bit_exact_compiler_options`). Flags of the CPU
# backend only: libtpu's v5p compiles do not read them (the compiled v5p HLO is unchanged).
CPU_FLAGS = {"xla_force_host_platform_device_count": str(HOST_DEVICES), "xla_cpu_use_fusion_emitters": "false",
             "xla_backend_optimization_level": "0"}
_CHIP_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")


def tpu_chips_present() -> bool:
    return any(glob.glob(pattern) for pattern in _CHIP_FILES)


def chosen_platform(environ=os.environ, chips_present=None) -> str:
    """"tpu" or "cpu": the override, else JAX_PLATFORMS, else what the host has."""
    forced = environ.get("CSA_PALLAS_TEST_PLATFORM")
    if forced:
        if forced not in ("cpu", "tpu"):
            raise ValueError(f"CSA_PALLAS_TEST_PLATFORM: expected 'cpu' or 'tpu', got {forced!r}")
        return forced
    if environ.get("JAX_PLATFORMS"):
        return "tpu" if "tpu" in environ["JAX_PLATFORMS"].split(",")[0] else "cpu"
    present = tpu_chips_present() if chips_present is None else chips_present
    return "tpu" if present else "cpu"


def configure(environ=os.environ, chips_present=None) -> str:
    """Sets JAX_PLATFORMS (and on the CPU `CPU_FLAGS`: the host device count, the emitters) in `environ`; returns
    the platform."""
    platform = chosen_platform(environ, chips_present)
    environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not environ.get("JAX_PLATFORMS"):
        environ["JAX_PLATFORMS"] = platform
    if platform == "cpu":
        for flag, value in CPU_FLAGS.items():
            if flag not in environ.get("XLA_FLAGS", ""):
                environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} --{flag}={value}".strip()
    return platform


def bit_exact_compiler_options(environ=os.environ) -> dict:
    """`jax.jit(..., compiler_options=...)` for a test that compares two different programs bit for bit (rematted
    against unrematted, exported against jitted): on the CPU, XLA's default LLVM level 3, which a user's CPU program
    gets, instead of CPU_FLAGS' level 0, at which two programs of the same arithmetic rounded differently in the last
    bit (the sparse loss with and without `jax.checkpoint`); on the chips, nothing."""
    return {"xla_backend_optimization_level": 3} if chosen_platform(environ) == "cpu" else {}


def fit_mesh_axes(axes: dict, available: int) -> dict:
    """A mesh shape that fits `available` devices: the largest axis (the last of equals) halves until the product
    fits, so a v5p-8's 4 chips run an 8-device case as e.g. {"data": 2, "heads": 2}; an axis may reach size 1 and
    keeps its name (the op then treats it as unsharded). Sizes are powers of two."""
    sizes = dict(axes)
    if available < 1:
        raise ValueError(f"available: expected >= 1 device, got {available}")
    while math.prod(sizes.values()) > available:
        largest = max(sizes.values())
        name = [n for n, v in sizes.items() if v == largest][-1]
        sizes[name] = largest // 2
    return sizes
