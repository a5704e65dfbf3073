"""How kernels run on this host: compiled (TPU, or AOT lowering for a TPU target) or interpreted (CPU/GPU).

On a non-TPU backend the kernels run in Pallas interpret mode automatically. `compiling_for_tpu()` is the
context used by `csa_pallas.aot` while lowering for an abstract TPU on a CPU host: the kernels must then be real
Mosaic kernels even though the default backend is CPU. `interpret_override(...)` lets tests pick an interpreter
(e.g. `pltpu.InterpretParams(detect_races=True)`) for the calls made inside it.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_MODE = contextvars.ContextVar("csa_pallas_kernel_mode", default=None)


@contextlib.contextmanager
def compiling_for_tpu():
    token = _MODE.set(False)
    try:
        yield
    finally:
        _MODE.reset(token)


@contextlib.contextmanager
def interpret_override(interpret):
    """Run the kernels traced inside with `interpret` (True or a `pltpu.InterpretParams`)."""
    token = _MODE.set(interpret)
    try:
        yield
    finally:
        _MODE.reset(token)


def interpret_mode():
    """The `interpret=` argument for pallas_call: False on TPU, True (or the override) elsewhere."""
    forced = _MODE.get()
    if forced is not None:
        return forced
    return jax.default_backend() != "tpu"
