"""How kernels run: compiled Mosaic kernels when lowered for TPU, the Pallas interpreter for any other platform.

The choice follows the platform the program is *lowered for*, not the host's default backend: every kernel call
is staged as one `csa_pallas_kernel` primitive holding both forms (the Mosaic kernel for TPU, the interpreted
kernel for any other platform), so one jitted function (and the jaxpr jit caches) compiles real Mosaic kernels
for a TPU topology from a CPU host (MaxText's AOT `train_compile` flow: `jax.jit(f).lower(<structs on TPU
devices>).compile()`) and interprets on CPU, in either order, with no context needed. Each form is lowered for its
own platforms only, so the compiled TPU program holds no interpreter code, the CPU program no Mosaic call, and a
multi-platform `jax.export(..., platforms=("cpu", "tpu"))` holds both (`lax.platform_dependent`, used before,
lowers its branches for every platform of the program, and Pallas refuses a compiled kernel for CPU). The kernel
body is traced once: the interpreted branch is the compiled call's jaxpr with `interpret` set (tracing it twice
made tracing a program ~2x slower) and its unrolled loops rolled (`rolled`: a loop Mosaic must see straight-line
is written `fori_loop(..., unroll=True)`, which the interpreter would otherwise discharge, lower and compile once
per iteration).

Inside a `jax.shard_map(check_vma=True)` a kernel call's outputs vary over every manual axis its inputs vary over
(the primitive's abstract evaluation), and it is lowered as the plain kernel, without those types.

Under `jax.vmap` every kernel call batches by the rule of `_KernelCall.vmappable` (once per element in turn, each
element of a blocked operand read in place), so a vmapped loss compiles for v5p (`tests/test_vmap.py`).

`interpret_override(...)` pins the mode of the calls traced inside it (tests use it for
`pltpu.InterpretParams(detect_races=True, ...)`); `compiling_for_tpu()` pins compiled kernels (kept for callers
of earlier versions; no longer needed for AOT compiles).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Callable

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax._src import dispatch
from jax._src.interpreters import mlir as jax_mlir
from jax._src.interpreters import partial_eval as pe
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.interpreters import ad, mlir

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


def pallas_call(kernel, *, interpret, grid_spec=None, **kwargs) -> Callable:
    """`pl.pallas_call(kernel, grid_spec=grid_spec, **kwargs)` in the given mode; FOLLOW_PLATFORM stages both modes
    and lets lowering pick: Mosaic for TPU, the interpreter for every other platform. Under `jax.vmap` the call
    batches by `_KernelCall`'s rule (once per element, in turn, each element read in place).

    grid_spec: a grid spec, or a function of the call's arguments returning one whose grid extent is read from the
    scalar-prefetch arguments (the listed walk's longest list), so that no traced value is closed over."""
    return _KernelCall(kernel, interpret, grid_spec, kwargs).vmappable()


@dataclasses.dataclass(frozen=True)
class _KernelCall:
    """One kernel call: `pl.pallas_call(kernel, grid_spec=..., **kwargs)` staged for the lowering platform."""

    kernel: Callable
    interpret: object
    grid_spec: object  # None (grid, in_specs, ... in kwargs), a grid spec, or a function of the arguments
    kwargs: dict

    def spec(self, args):
        return self.grid_spec(*args) if callable(self.grid_spec) else self.grid_spec

    def __call__(self, *args):
        compiled = pl.pallas_call(self.kernel, interpret=False, grid_spec=self.spec(args), **self.kwargs)
        # The kernel is traced once (the compiled call's jaxpr); the interpreted form is the same jaxpr with
        # `interpret` set, so the two forms do not trace the kernel body twice. Traced with the varying-manual-axes
        # check off: inside a `jax.shard_map(check_vma=True)` Pallas wants every out_shape to name its varying
        # axes; the primitive's abstract evaluation gives the outputs the inputs' varying axes instead.
        with jax_config._check_vma(False):
            closed, out_shapes = jax.make_jaxpr(compiled, return_shape=True)(*args)
        out_tree = jax.tree.structure(out_shapes)
        if self.interpret not in (FOLLOW_PLATFORM, False):
            # Pinned interpreter (True or `pltpu.InterpretParams`, the tests' race checking): inline, since the
            # race-checking interpreter's ordered callback effects cannot be lowered inside a primitive's rule (so
            # this mode does not take a check_vma shard_map's types).
            return jax.tree.unflatten(out_tree, jex_core.jaxpr_as_fun(_with_interpret(closed, self.interpret))(*args))
        # The jaxpr's constants become its leading arguments: they may be tracers of the caller's trace (the listed
        # walk's dynamic grid extent), which a primitive's parameters must not hold.
        opened = jex_core.ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ())
        # FOLLOW_PLATFORM: Mosaic for TPU, the interpreter elsewhere; pinned compiled (False): Mosaic everywhere.
        default = _with_interpret(opened) if self.interpret is FOLLOW_PLATFORM else opened
        outs = _per_platform_p.bind(*closed.consts, *jax.tree.leaves(args), tpu=opened, default=default)
        return jax.tree.unflatten(out_tree, outs)

    def vmappable(self) -> Callable:
        """The call with a batching rule of its own: a vmapped kernel runs **once per element, in turn**, reading
        its element of each batched blocked operand in place.

        Why not Pallas's rule (it adds the batch to the grid): it breaks kernels that reinterpret a ref (a bitcast
        of a block that gained a dimension fails Mosaic's verifier: the student kernels), and where a
        scalar-prefetched table is batched (every selection, packed documents) it falls back to a loop in which
        XLA fuses the stacking of the outputs into the kernel's custom call and drops the kernel's VMEM limit for
        its 16 MiB default (the sparse teacher at S = 4K asks 22 MiB: a v5p compile error). Here each element is
        one launch of the unbatched kernel (`element`), its outputs behind an optimization barrier, in a
        `lax.map`; a size-1 axis is squeezed (no loop)."""
        call = jax.custom_batching.custom_vmap(self)

        @call.def_vmap
        def in_turn(axis_size, in_batched, *args):
            if axis_size == 1:  # e.g. a vmapped axis sharded one element per device: a reshape, no loop
                out = call(*[arg[0] if batched else arg for arg, batched in zip(args, in_batched)])
                return jax.tree.map(lambda x: x[None], out), jax.tree.map(lambda _: True, out)
            launch, element_args = self.element(args, in_batched)
            one = lambda i: jax.lax.optimization_barrier(launch(jnp.reshape(i, (1,)).astype(jnp.int32),
                                                                *element_args(i)))
            out = jax.lax.map(one, jnp.arange(axis_size))
            return out, jax.tree.map(lambda _: True, out)
        return call

    def element(self, args, in_batched):
        """(launch, element_args): launch(i, *element_args(i)) is the kernel on element i of the batched args, i an
        int32[1] prepended as a scalar-prefetch argument. A batched operand whose block spec tiles its leading axis
        exactly is read in place: the element axis is folded into that axis (a free reshape, the rank and so any
        ref bitcast of the kernel unchanged) and its index map offset by i's blocks. Any other batched argument (a
        scalar-prefetch table, an HBM ref without a block shape) is sliced: one element copied."""
        first = [arg[0] if batched else arg for arg, batched in zip(args, in_batched)]
        spec = self.spec(first)  # the element's grid spec, for its structure (a dynamic extent is recomputed)
        kw = dict(self.kwargs)
        if spec is None:
            spec = pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=0, grid=kw.pop("grid", ()), in_specs=kw.pop("in_specs", pl.no_block_spec),
                out_specs=kw.pop("out_specs", pl.no_block_spec), scratch_shapes=kw.pop("scratch_shapes", ()))
        prefetched = getattr(spec, "num_scalar_prefetch", 0)
        in_specs = [None] * prefetched + (list(spec.in_specs) if spec.in_specs is not pl.no_block_spec
                                          else [None] * (len(args) - prefetched))
        # Blocks of one element along the leading axis (the index-map offset per element), or None: sliced.
        strides = [_element_stride(spec_j, x.shape) if batched else None
                   for spec_j, x, batched in zip(in_specs, first, in_batched)]
        grid_rank = len(spec.grid)

        def element_spec(element_args):
            base = self.spec(element_args) if callable(self.grid_spec) else spec
            specs = base.in_specs if base.in_specs is pl.no_block_spec else [
                _with_element(s, grid_rank, strides[prefetched + j]) for j, s in enumerate(base.in_specs)]
            out_specs = jax.tree.map(lambda s: _with_element(s, grid_rank, None), base.out_specs,
                                     is_leaf=lambda s: isinstance(s, pl.BlockSpec))
            return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=prefetched + 1, grid=base.grid, in_specs=specs,
                                                out_specs=out_specs, scratch_shapes=base.scratch_shapes)

        if "input_output_aliases" in kw:
            kw["input_output_aliases"] = {j + 1: o for j, o in kw["input_output_aliases"].items()}
        kernel = self.kernel
        rows = [x.shape[0] if x.ndim else None for x in first]
        launch = _KernelCall(lambda element_ref, *refs: kernel(*refs), self.interpret,
                             lambda element, *rest: element_spec(
                                 [r if strides[j] is None else r[:rows[j]] for j, r in enumerate(rest)]),
                             kw).vmappable()

        # Folded once, outside the loop: an in-place operand is the same whole array for every element.
        folded = [arg.reshape(-1, *arg.shape[2:]) if stride is not None else arg
                  for arg, stride in zip(args, strides)]

        def element_args(i):
            return [arg[i] if batched and stride is None else arg
                    for arg, batched, stride in zip(folded, in_batched, strides)]
        return launch, element_args


def _element_stride(spec, element_shape) -> int | None:
    """How many blocks of `spec` one element spans along its leading axis, when it tiles that axis exactly (a
    squeezed block dimension counts rows); None when the element cannot be read in place."""
    if not isinstance(spec, pl.BlockSpec) or spec.block_shape is None or spec.index_map is None:
        return None
    if not element_shape or spec.memory_space not in (None, pltpu.VMEM, pltpu.SMEM):
        return None
    lead, rows = spec.block_shape[0], element_shape[0]
    if lead is None:
        return rows
    if type(lead) is int and rows % lead == 0:
        return rows // lead
    return None


def _with_element(spec, grid_rank: int, stride: int | None):
    """`spec` in the element's call, whose index maps also receive the element ref (the first scalar-prefetch ref,
    after the grid indices): ignored, or with a stride (the array's leading axis holds every element) the block
    index along that axis offset by the element's `stride` blocks."""
    if not isinstance(spec, pl.BlockSpec) or spec.index_map is None:
        return spec
    index_map = spec.index_map

    def element_index_map(*indices):
        grid, (element_ref, *refs) = indices[:grid_rank], indices[grid_rank:]
        lead, *rest = index_map(*grid, *refs)
        return (lead + element_ref[0] * stride, *rest) if stride is not None else (lead, *rest)
    return dataclasses.replace(spec, index_map=element_index_map)


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


# One kernel call, two lowerings: `tpu` (a ClosedJaxpr of the compiled pallas_call) where the program is lowered for
# TPU, `default` (the same call interpreted) for any other platform. Not `jax.lax.platform_dependent`: its branches
# are lowered for every platform of the program, so a multi-platform lowering (`jax.export(...,
# platforms=("cpu", "tpu"))`) asked Pallas to lower the compiled kernel for CPU and failed ("Only interpret mode is
# supported on CPU backend"). `mlir.lower_per_platform` lowers each rule for its own platforms only.
_per_platform_p = jex_core.Primitive("csa_pallas_kernel")
_per_platform_p.multiple_results = True
_per_platform_p.def_impl(functools.partial(dispatch.apply_primitive, _per_platform_p))


def _abstract_eval(*avals, tpu, default):
    varying = frozenset().union(*(a.manual_axis_type.varying for a in avals
                                  if getattr(a, "manual_axis_type", None) is not None))
    outs = tpu.out_avals
    if varying:
        mat = jax_core.ManualAxisType(varying=varying)
        outs = [a.update_manual_axis_type(mat) for a in outs]
    return outs, tpu.effects


_per_platform_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx, *args, tpu, default):
    as_rule = lambda closed: mlir.lower_fun(jex_core.jaxpr_as_fun(closed), multiple_results=True)  # noqa: E731
    # Lowered as the plain kernel: the varying-manual-axes types of a `jax.shard_map(check_vma=True)` stay outside
    # (the interpreter's loops would otherwise mix typed carries with untyped kernel values).
    plain = lambda avals: [a.update_manual_axis_type(jax_core.empty_mat) if hasattr(a, "manual_axis_type") else a
                           for a in avals]  # noqa: E731
    ctx = ctx.replace(avals_in=plain(ctx.avals_in), avals_out=plain(ctx.avals_out))
    with jax_config._check_vma(False):
        return jax_mlir.lower_per_platform(ctx, "csa_pallas kernel", {"tpu": as_rule(tpu)}, as_rule(default),
                                           tpu.effects, *args)


mlir.register_lowering(_per_platform_p, _lowering)


def _jvp(primals, tangents, *, tpu, default):
    # The ops differentiate through their custom_vjp / custom_jvp (the teacher's inputs are stop-gradients), so
    # no kernel call is ever differentiated; batching goes through `_KernelCall.vmappable`'s custom_vmap rule.
    raise NotImplementedError(
        "csa_pallas: a kernel call was differentiated directly; differentiate the public ops (their custom_vjp "
        "carries the gradients), or use implementation='xla'")


ad.primitive_jvps[_per_platform_p] = _jvp
