"""How kernels run: compiled Mosaic kernels when lowered for TPU, the Pallas interpreter for any other platform.

The choice follows the platform the program is *lowered for*, not the host's default backend: every kernel call
is staged as `jax.lax.platform_dependent(tpu=<Mosaic kernel>, default=<interpreted kernel>)`, so one jitted
function (and the jaxpr jit caches) compiles real Mosaic kernels for a TPU topology from a CPU host (MaxText's
AOT `train_compile` flow: `jax.jit(f).lower(<structs on TPU devices>).compile()`) and interprets on CPU, in either
order, with no context needed. Only the branch of the lowering platform is lowered, so the compiled TPU program
holds no interpreter code and the CPU program no Mosaic call. The kernel body is traced once: the interpreted
branch is the compiled call's jaxpr with `interpret` set (tracing it twice made tracing a program ~2x slower) and
its unrolled loops rolled (`rolled`: a loop Mosaic must see straight-line is written `fori_loop(..., unroll=True)`,
which the interpreter would otherwise discharge, lower and compile once per iteration).

Under `jax.vmap` every kernel call batches by the rule of `_vmappable` (once per element in turn, or in the grid
where Pallas's own rule is safe), so a vmapped loss compiles for v5p (`tests/test_vmap.py`).

`interpret_override(...)` pins the mode of the calls traced inside it (tests use it for
`pltpu.InterpretParams(detect_races=True, ...)`); `compiling_for_tpu()` pins compiled kernels (kept for callers
of earlier versions; no longer needed for AOT compiles).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
import jax.extend.core as jex_core
from jax.experimental import pallas as pl

# interpret_mode() when nothing is pinned: the lowering platform decides (see `pallas_call`).
FOLLOW_PLATFORM = "follow-the-lowering-platform"

_MODE = contextvars.ContextVar("csa_pallas_kernel_mode", default=None)


@contextlib.contextmanager
def compiling_for_tpu():
    """Pin compiled Mosaic kernels for the calls traced inside (lowering them for a CPU then fails)."""
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
    """The `interpret=` argument for `pallas_call`: the pinned mode, or FOLLOW_PLATFORM."""
    forced = _MODE.get()
    return FOLLOW_PLATFORM if forced is None else forced


def pallas_call(kernel, *, interpret, grid_spec=None, grid_batching: bool = False, **kwargs) -> Callable:
    """`pl.pallas_call(kernel, grid_spec=grid_spec, **kwargs)` in the given mode; FOLLOW_PLATFORM stages both modes
    and lets lowering pick: Mosaic for TPU, the interpreter for every other platform.

    grid_spec: a grid spec, or a function of the call's arguments returning one (a grid whose extent is read from
    them, e.g. the listed walk's longest list), so that no traced value is closed over. Under `jax.vmap` see
    `_vmappable`; grid_batching=True lets Pallas's own rule batch the call in its grid where it can (the kernel
    then runs once for every element, reading each in place), which only kernels whose refs keep their rank
    (no reinterpreting bitcast, no whole-array HBM operands) and whose grid is static may ask for."""
    def launch(*args):
        spec = grid_spec(*args) if callable(grid_spec) else grid_spec
        compiled = pl.pallas_call(kernel, interpret=False, grid_spec=spec, **kwargs)
        if interpret is False:
            return compiled(*args)
        # The kernel is traced once (the compiled call's jaxpr); the interpreted branch is the same jaxpr with
        # `interpret` set, so the two branches do not trace the kernel body twice.
        closed, out_shapes = jax.make_jaxpr(compiled, return_shape=True)(*args)
        out_tree = jax.tree.structure(out_shapes)
        as_fun = lambda jaxpr: lambda *a: jax.tree.unflatten(out_tree, jex_core.jaxpr_as_fun(jaxpr)(*a))
        if interpret is not FOLLOW_PLATFORM:  # pinned: the interpreter (True or `pltpu.InterpretParams`)
            return as_fun(_with_interpret(closed, interpret))(*args)
        return jax.lax.platform_dependent(*args, tpu=as_fun(closed), default=as_fun(_with_interpret(closed)))

    prefetched = 0 if callable(grid_spec) else getattr(grid_spec, "num_scalar_prefetch", 0)
    return _vmappable(launch, in_grid=grid_batching and not callable(grid_spec), prefetched=prefetched)


def _vmappable(launch: Callable, *, in_grid: bool, prefetched: int) -> Callable:
    """`launch` with a batching rule of its own: a vmapped kernel runs **once per element, in turn**.

    Why not Pallas's rule: it adds the batch to the grid, which breaks kernels that reinterpret a ref (a bitcast
    of a block that gained a dimension fails Mosaic's verifier: the student kernels) or index whole HBM operands,
    and where a scalar-prefetched table is batched it falls back to a loop in which XLA fuses the stacking of the
    outputs into the kernel's custom call and drops the kernel's own VMEM limit for its 16 MiB default (the sparse
    teacher at S = 4K needs 22 MiB: a v5p compile error). Here each element's kernel is the unbatched kernel on
    that element's slices, its outputs behind an optimization barrier, in a `lax.map`: what the same program
    written with `lax.map` does. The cost is the slices: XLA copies each batched operand's element before a
    launch (the price of any loop over stacked arrays). With `in_grid` and no batched scalar-prefetch operand,
    Pallas's rule is used (no copies)."""
    call = jax.custom_batching.custom_vmap(launch)

    @call.def_vmap
    def in_turn(axis_size, in_batched, *args):
        if in_grid and not any(in_batched[:prefetched]):
            out = jax.vmap(launch, in_axes=[0 if batched else None for batched in in_batched])(*args)
            return out, jax.tree.map(lambda _: True, out)

        def one(i):
            element = [arg[i] if batched else arg for arg, batched in zip(args, in_batched)]
            return jax.lax.optimization_barrier(call(*element))  # call: a nested vmap batches it again
        if axis_size == 1:  # e.g. a vmapped axis sharded one element per device: a reshape, no loop, no copy
            element = [arg[0] if batched else arg for arg, batched in zip(args, in_batched)]
            out = jax.tree.map(lambda x: x[None], call(*element))
        else:
            out = jax.lax.map(one, jax.numpy.arange(axis_size))
        return out, jax.tree.map(lambda _: True, out)
    return call


def _with_interpret(closed, interpret=True):
    """`closed` (a ClosedJaxpr of one kernel call) with its pallas_call's `interpret` set (re-bound on evaluation,
    so the interpreter's effects and lowering follow from the new parameter) and its kernel's loops rolled."""
    eqns = [eqn.replace(params={**eqn.params, "interpret": interpret, "jaxpr": rolled(eqn.params["jaxpr"])})
            if eqn.primitive.name == "pallas_call" else eqn for eqn in closed.jaxpr.eqns]
    if not any(eqn.primitive.name == "pallas_call" for eqn in eqns):  # e.g. a jax that stops inlining the call
        raise AssertionError("runtime.pallas_call: no pallas_call at the top of the traced kernel call")
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns))


def rolled(jaxpr):
    """`jaxpr` (a Jaxpr or ClosedJaxpr, nested ones included) with every scan's `unroll` set to 1.

    Why: kernels write the loops Mosaic must see straight-line (static SMEM offsets, e.g. a chunk's 128 slots) as
    `fori_loop(..., unroll=True)`, which Mosaic unrolls with the index as a constant. The interpreter would unroll
    them too: every copy discharged, lowered and compiled by XLA:CPU. Unrolling is code generation only (a scan's
    result does not depend on it), so the interpreted kernel keeps them as loops."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        return jaxpr.replace(jaxpr=rolled(jaxpr.jaxpr))
    if not isinstance(jaxpr, jex_core.Jaxpr):
        return jaxpr
    eqns = []
    for eqn in jaxpr.eqns:
        params = {name: _rolled_param(value) for name, value in eqn.params.items()}
        if eqn.primitive.name == "scan":
            params["unroll"] = 1
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns)


def _rolled_param(value):
    if isinstance(value, (tuple, list)) and any(isinstance(v, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) for v in value):
        return type(value)(rolled(v) for v in value)
    return rolled(value)
