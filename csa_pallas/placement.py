"""Where the plain ops run when their inputs live on a device mesh: the sharding that `sharding.py` serves.

Mosaic kernels cannot be partitioned by XLA (on a TPU, a kernel whose operands XLA sharded fails to compile with
"Mosaic kernels cannot be automatically partitioned"), and JAX's automatic route for custom partitioning,
`custom_partitioning`, is not wired through on TPU (jax-ml/jax#38196). So `indexer_distill_loss` and
`teacher_distribution` decide, while tracing, how the activations are sharded and enter `sharding.py`'s shard_map
themselves. The layout is read from, in order:

  1. the queries' sharding when it is known while tracing: `AxisType.Explicit` mesh axes (`jax.set_mesh`, the
     sharding is part of the type) or a concrete, committed `jax.Array` (eager calls);
  2. a declared layout: `csa_pallas.activation_sharding(batch=..., heads=..., seq=...)`, or Flax logical axis rules
     (MaxText's `nn_partitioning.axis_rules(config.logical_axis_rules)`): the mesh axes of the logical names
     "activation_batch", "activation_heads" and "activation_length";
  3. otherwise, on a mesh of more than one device with `AxisType.Auto` axes (XLA decides the sharding after
     tracing), a ValueError that says what to declare.

On a mesh mixing Explicit and Auto axes (or inside `jax.sharding.auto_axes`) the Explicit axes come from 1. and
the Auto ones from 2. (`_mixed_placement`).

q [B, S, H, D] decides: B over the batch axes, S over the sequence axis, H over the head axis, D never sharded.
The other inputs are resharded to match (the key side is replicated over the sequence axis, see `sharding.py`).
Inside a user's `jax.shard_map` manual over every mesh axis, the op runs per device on what it is given, with
check_vma True or False (`vary_alike`). Inside one manual over some axes only (`axis_names=`, a pipeline's "stage"),
the manual axes have split the arrays already and the op shards over the others as above, in a shard_map nested
over them (`shard_map`; differentiable where the user's shard_map has check_vma=False, see there).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

AxisNames = Union[None, str, Sequence[str]]

# Flax logical axis names (MaxText's activation names) -> the dimension of q they shard.
FLAX_LOGICAL_AXES = dict(batch="activation_batch", heads="activation_heads", seq="activation_length")

ENTRY_POINT = "csa_pallas.sharded_indexer_distill_loss(mesh, ..., batch_axes=, head_axis=, seq_axis=)"


@dataclasses.dataclass(frozen=True)
class Placement:
    """The mesh and the axes that shard q's batch, sequence and heads (names of `mesh`; batch may be several)."""

    mesh: object  # jax.sharding.Mesh or AbstractMesh
    batch_axes: tuple
    head_axis: Optional[str]
    seq_axis: Optional[str]
    source: str  # where the layout came from, for error messages

    def describe(self) -> str:
        spec = P(self.batch_axes or None, self.seq_axis, self.head_axis, None)
        return f"q sharded {spec} on the mesh {dict(self.mesh.shape)} ({self.source})"


@dataclasses.dataclass(frozen=True)
class _Declared:
    batch: tuple
    heads: Optional[str]
    seq: Optional[str]


_DECLARED = contextvars.ContextVar("csa_pallas_activation_sharding", default=None)


def _names(arg: str, value: AxisNames) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"{arg}: expected None, a mesh axis name or a sequence of names, got {value!r}")


def _one_name(arg: str, value: AxisNames) -> Optional[str]:
    names = _names(arg, value)
    if len(names) > 1:
        raise ValueError(f"{arg}: one mesh axis at most (the kernels split this dimension over one axis), got "
                         f"{names}; reshape the mesh or shard it over one axis")
    return names[0] if names else None


@contextlib.contextmanager
def activation_sharding(batch: AxisNames = None, heads: Optional[str] = None, seq: Optional[str] = None):
    """Declares how the activations are sharded for the ops traced inside, when the mesh's axes are
    `AxisType.Auto` (XLA picks shardings after tracing, so the op cannot read them). batch: mesh axis name(s)
    sharding B; heads: the axis sharding the H attention heads; seq: the axis sharding the query sequence.
    `activation_sharding()` (all None) declares the inputs replicated: every device computes the whole op."""
    token = _DECLARED.set(_Declared(_names("batch", batch), _one_name("heads", heads), _one_name("seq", seq)))
    try:
        yield
    finally:
        _DECLARED.reset(token)


def _mesh_of(x):
    """The mesh an input lives on (its type's mesh while tracing, its committed sharding's mesh eagerly)."""
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
    elif isinstance(x, jax.Array) and getattr(x, "committed", True):
        sharding = x.sharding
    else:
        sharding = None
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        return sharding.mesh, sharding
    return None, None


def _flax_rules_layout(mesh) -> Optional[_Declared]:
    if "flax" not in sys.modules:  # no rules can be active without flax
        return None
    from flax.linen import spmd
    rules = dict(spmd.get_logical_axis_rules() or ())
    if not any(name in rules for name in FLAX_LOGICAL_AXES.values()):
        return None

    def axes(dim: str) -> tuple:
        value = rules.get(FLAX_LOGICAL_AXES[dim])
        names = _names(f"Flax logical axis rule {FLAX_LOGICAL_AXES[dim]!r}", value)
        # Rules list axes of any mesh; a manual axis has split the arrays already.
        return tuple(n for n in names if n in mesh.shape and mesh.shape[n] > 1 and n not in manual_axes(mesh))

    batch, heads, seq = axes("batch"), axes("heads"), axes("seq")
    seq = tuple(n for n in seq if n not in batch + heads)
    return _Declared(batch, _one_name(f"Flax logical axis rule {FLAX_LOGICAL_AXES['heads']!r}", heads),
                     _one_name(f"Flax logical axis rule {FLAX_LOGICAL_AXES['seq']!r}", seq))


def _from_spec(spec, mesh, source: str) -> Placement:
    entries = tuple(spec) + (None,) * (4 - len(tuple(spec)))
    where = f"q is sharded {P(*entries)} on the mesh {dict(mesh.shape)} ({source})"
    if entries[3] is not None:
        raise ValueError(f"q: {where}; the head dimension D cannot be sharded (each score reads all of D); "
                         f"reshard q with D replicated, or use {ENTRY_POINT}")
    try:
        seq, heads = _one_name("seq", entries[1]), _one_name("heads", entries[2])
    except ValueError as e:
        raise ValueError(f"q: {where}; the sequence and head dimensions can each be split over one mesh axis "
                         f"only; use {ENTRY_POINT}") from e
    return Placement(mesh, _names("batch", entries[0]), heads, seq, source)


def resolve(q) -> Optional[Placement]:
    """The sharding to run the op with for queries `q`, or None when the plain (single-device) op is right."""
    mesh, sharding = _mesh_of(q)
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        mesh = None if abstract.empty else abstract
    if mesh is None or mesh.size == 1:
        return None
    manual = manual_axes(mesh)
    if all(mesh.shape[n] == 1 for n in mesh.axis_names if n not in manual):
        return None  # inside a user's shard_map manual over every axis that splits anything: the op runs per device
    free_types = {t for n, t in zip(mesh.axis_names, mesh.axis_types) if n not in manual}
    return _free_axes_placement(q, mesh, sharding, free_types, manual)


def _free_axes_placement(q, mesh, sharding, types, manual) -> Placement:
    """The placement over the mesh's non-manual axes: all of them outside a shard_map; inside one manual over some
    axes (`axis_names=`, e.g. a pipeline's "stage"), the others, where the per-device arrays are still global."""
    inside = f" inside a jax.shard_map manual over {sorted(manual)}" if manual else ""
    if AxisType.Explicit in types:
        typed = _from_spec(jax.typeof(q).sharding.spec, mesh, "its Explicit sharding" + inside)
        if AxisType.Auto not in types:
            return typed
        return _mixed_placement(typed, mesh, manual, inside)
    if sharding is not None and not isinstance(q, jax.core.Tracer):
        return _from_spec(sharding.spec, mesh, "the array's sharding")
    declared, source = _declared_layout(mesh)
    if declared is None:
        raise ValueError(
            f"q: the inputs live on a mesh of {mesh.size} devices {dict(mesh.shape)}{inside} with Auto axes, whose "
            f"shardings XLA decides after tracing, and the Pallas kernels cannot be partitioned by XLA. Declare how "
            f"the activations are sharded: `with csa_pallas.activation_sharding(batch=..., heads=..., seq=...):` "
            f"around the call (or Flax logical axis rules for {tuple(FLAX_LOGICAL_AXES.values())}, as MaxText sets), "
            f"use a mesh with AxisType.Explicit axes, or call {ENTRY_POINT}")
    _check_declared_names(declared, source, mesh)
    # A manual axis has split the arrays already (each device holds its part): the op shards over the rest.
    free = lambda name: None if name in manual else name
    return Placement(mesh, tuple(n for n in declared.batch if n not in manual), free(declared.heads),
                     free(declared.seq), source + inside)


def _declared_layout(mesh):
    """(the declared layout, where it came from): `activation_sharding`, else Flax logical axis rules; (None, ...)
    when neither is active."""
    declared = _DECLARED.get()
    if declared is not None:
        return declared, "csa_pallas.activation_sharding"
    return _flax_rules_layout(mesh), "Flax logical axis rules"


def _check_declared_names(declared: _Declared, source: str, mesh):
    for arg, names in (("batch", declared.batch), ("heads", (declared.heads,)), ("seq", (declared.seq,))):
        for name in names:
            if name is not None and name not in mesh.shape:
                raise ValueError(f"{source}: {arg} names mesh axis {name!r}, but the mesh's axes are "
                                 f"{tuple(mesh.shape)}")


def _mixed_placement(typed: Placement, mesh, manual, inside: str) -> Placement:
    """A mesh mixing Explicit and Auto axes (`jax.make_mesh(..., axis_types=...)`, or inside
    `jax.sharding.auto_axes`): q's type gives the Explicit axes' layout; the Auto axes', which XLA decides after
    tracing, comes from the declared layout (`activation_sharding` or Flax rules), whose Explicit axis names are
    left to the type. With nothing declared, a ValueError unless every Auto axis has size 1."""
    auto = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Auto and n not in manual]
    declared, source = _declared_layout(mesh)
    if declared is None:
        if all(mesh.shape[n] == 1 for n in auto):
            return typed
        raise ValueError(
            f"q: the mesh {dict(mesh.shape)}{inside} mixes Explicit and Auto axes: q's type gives the layout over "
            f"the Explicit ones ({typed.describe()}), and XLA decides the Auto ones {auto} after tracing, which the "
            f"Pallas kernels cannot follow. Declare them: `with csa_pallas.activation_sharding(batch=..., heads=..., "
            f"seq=...):` around the call (or Flax logical axis rules), make every axis Explicit, or call "
            f"{ENTRY_POINT}")
    _check_declared_names(declared, source, mesh)
    pick = lambda names: tuple(n for n in names if n in auto)
    batch, heads, seq = pick(declared.batch), pick((declared.heads,)), pick((declared.seq,))
    for arg, declared_axis, typed_axis in (("heads", heads, typed.head_axis), ("seq", seq, typed.seq_axis)):
        if declared_axis and typed_axis is not None:
            raise ValueError(f"{source}: {arg} names the Auto mesh axis {declared_axis[0]!r}, but q's Explicit type "
                             f"splits that dimension over {typed_axis!r} already ({typed.describe()}); one axis at "
                             f"most per dimension")
    return Placement(mesh, typed.batch_axes + batch, typed.head_axis or (heads[0] if heads else None),
                     typed.seq_axis or (seq[0] if seq else None), f"{typed.source}, and {source} for the Auto axes")


def manual_axes(mesh) -> frozenset:
    """The names of the mesh's Manual axes (those of the jax.shard_map the op is traced in)."""
    return frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)


def shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map(fn, check_vma=False)` over the mesh's non-manual axes: every axis outside a user's
    shard_map; inside one manual over some axes (`axis_names=`), a nested shard_map over the others.

    JAX 0.10.2 cannot transpose a shard_map nested in a `check_vma=True` shard_map that is manual over some axes
    (`jnp.sin` alone fails: a cotangent-type error with the inner check_vma False, a Shardy verifier error with it
    True), so there the nested shard_map gets its own VJP (`_nested_with_own_vjp`): nothing is transposed."""
    vmapped = sorted(jax_core.get_axis_env().explicit_mesh_axis_names)
    if vmapped:  # measured: reshapes around the window-LSE and teacher kernels, v5p compiles at the Flash widths
        raise ValueError(
            f"jax.vmap over the Explicit mesh axes {vmapped} (spmd_axis_name on an Explicit mesh): JAX 0.10.2 keeps "
            "a vmapped Explicit axis inside the op's shard_map, and its sharding rules reject the reshapes around "
            "the kernels there ('This reshape is not supported'); make that mesh axis Auto (the op's layout then "
            "comes from csa_pallas.activation_sharding or Flax rules, as in MaxText's pipeline), or split it with a "
            "jax.shard_map manual over it")
    manual = manual_axes(mesh)
    free = frozenset(n for n in mesh.axis_names if n not in manual)
    if not manual:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    if not jax_config._check_vma.value:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, axis_names=free)
    spmd = sorted(jax_core.get_axis_env().spmd_axis_names & free)
    if spmd:  # JAX 0.10.2 types the nested shard_map's outputs as varying over them outside it: an error later
        raise ValueError(
            f"jax.vmap(spmd_axis_name={spmd!r}) inside a jax.shard_map(check_vma=True) manual over {sorted(manual)}: "
            f"the op shards over the mesh axes left automatic ({sorted(free)}) in a nested shard_map, which JAX "
            "cannot batch over a mesh axis of its own with check_vma=True; vmap without spmd_axis_name, or make the "
            "outer shard_map check_vma=False")
    return functools.partial(_nested_with_own_vjp, fn, mesh, in_specs, out_specs, free)


def _nested_with_own_vjp(fn, mesh, in_specs, out_specs, free, *args):
    """fn(*args) in a check_vma=True shard_map over the axes `free`, differentiable without JAX transposing a
    shard_map: under differentiation the forward shard_map also returns each device's VJP residuals (stacked over
    the free axes' devices) and the backward is a second shard_map that applies them. Integer inputs get no
    cotangent; an input replicated over an axis gets its cotangent summed over it (`call`'s pcast)."""
    leaves, in_tree = jax.tree.flatten(args)
    leaf_specs = _leaf_specs(in_specs, args)
    inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
    stacked = P(tuple(sorted(free)))  # device i's residual at row i
    nested = functools.partial(jax.shard_map, mesh=mesh, axis_names=set(free), check_vma=True)
    traced = {}

    def call(local):
        # Every input made to vary over every axis any input varies over, the free ones included, so that the
        # op's custom_vjps see one type (as `vary_alike`); pcast's transpose sums a replicated input's cotangent.
        every = frozenset(free).union(*(_varying(x) for x in local))
        local = [_vary_over(x, every) for x in local]
        return fn(*jax.tree.unflatten(in_tree, local))

    def forward_body(*local):
        def of_inexact(*xs):  # (inexact outputs, the others): only the former are differentiated
            it = iter(xs)
            flat, traced["out_tree"] = jax.tree.flatten(call([next(it) if d else x for x, d in zip(local, inexact)]))
            traced["out_inexact"] = [jnp.issubdtype(x.dtype, jnp.inexact) for x in flat]
            return ([x for x, d in zip(flat, traced["out_inexact"]) if d],
                    [x for x, d in zip(flat, traced["out_inexact"]) if not d])
        outs, vjp_fn, others = jax.vjp(of_inexact, *[x for x, d in zip(local, inexact) if d], has_aux=True)
        residuals, traced["vjp_tree"] = jax.tree.flatten(vjp_fn)
        traced["out_varying"] = [_varying(x) for x in outs]  # a cotangent of a sum does not vary: cast it
        outs, others = iter(outs), iter(others)
        out = jax.tree.unflatten(traced["out_tree"], [next(outs) if d else next(others)
                                                      for d in traced["out_inexact"]])
        return out, [r[None] for r in residuals]

    @jax.custom_vjp
    def op(*flat):
        return nested(lambda *local: call(list(local)), in_specs=tuple(leaf_specs), out_specs=out_specs)(*flat)

    def op_fwd(*flat):
        return nested(forward_body, in_specs=tuple(leaf_specs), out_specs=(out_specs, stacked))(*flat)

    def op_bwd(residuals, cotangent):
        pick = lambda items: [x for x, d in zip(items, traced["out_inexact"]) if d]
        cts, ct_specs = pick(jax.tree.leaves(cotangent)), pick(_leaf_specs(out_specs, cotangent))

        def backward_body(local_residuals, *local_cts):
            vjp_fn = jax.tree.unflatten(traced["vjp_tree"], [r[0] for r in local_residuals])
            return list(vjp_fn([_vary_over(c, v) for c, v in zip(local_cts, traced["out_varying"])]))
        grads = iter(nested(backward_body, in_specs=(stacked, *ct_specs),
                            out_specs=[s for s, d in zip(leaf_specs, inexact) if d])(residuals, *cts))
        return tuple(next(grads) if d else None for d in inexact)

    op.defvjp(op_fwd, op_bwd)
    return op(*leaves)


def _leaf_specs(specs, tree) -> list:
    """The PartitionSpec of each leaf of `tree`, from `specs`, a prefix of it (shard_map's in_specs / out_specs)."""
    per_subtree = jax.tree.map(lambda spec, sub: [spec] * len(jax.tree.leaves(sub)), specs, tree,
                               is_leaf=lambda x: isinstance(x, P))
    return [s for group in jax.tree.leaves(per_subtree, is_leaf=lambda x: isinstance(x, list)) for s in group]


def reshard_for_shard_map(tree, specs, mesh):
    """Explicit-axis meshes: shard_map requires each input's type to carry its in_spec; reshard to it (a no-op
    where the input already has it), over the Explicit axes only on a mesh that mixes in Auto ones (a type names
    no Auto axis). Auto meshes: returned unchanged (XLA reshards at the boundary)."""
    if AxisType.Explicit not in set(mesh.axis_types):
        return tree
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}

    def typed_part(spec):
        keep = lambda entry: tuple(n for n in ((entry,) if isinstance(entry, str) else entry or ()) if n in explicit)
        return P(*[(kept if len(kept) > 1 else kept[0]) if (kept := keep(e)) else None for e in spec])
    # A NamedSharding, not the bare spec: the caller's inputs carry their mesh, no `jax.set_mesh` context needed.
    return jax.tree.map(lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, typed_part(spec))), tree, specs,
                        is_leaf=lambda x: x is None)


def explicit_mesh(x):
    """The mesh of a traced input whose mesh has Explicit axes, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and AxisType.Explicit in set(sharding.mesh.axis_types):
        return sharding.mesh
    return None


def on_auto_axes(fn, problem, *args, row_dims: int):
    """fn(problem, *args) (the XLA reference) with the Explicit mesh axes of q's type turned Auto inside: JAX has
    no Explicit sharding rule for some of the reference's gathers, XLA partitions it freely. The result is laid
    out like q's rows: [B, S, ...] with row_dims dimensions (0: a replicated scalar). Non-Explicit inputs: fn as is.
    """
    mesh = explicit_mesh(problem.q)
    if mesh is None:
        return fn(problem, *args)
    fields = _array_fields(problem)
    batch, seq = (tuple(jax.typeof(problem.q).sharding.spec) + (None, None))[:2]
    out = P() if row_dims == 0 else P(batch, seq, *([None] * (row_dims - 2)))
    inner = lambda arrays, rest: fn(dataclasses.replace(problem, **arrays), *rest)
    return jax.sharding.auto_axes(inner, out_sharding=NamedSharding(mesh, out))(fields, args)


def vary_alike(problem, *arrays):
    """(problem, *arrays) with every array cast to vary over the same manual mesh axes, when the op is traced
    inside a `jax.shard_map(check_vma=True)` (JAX's default) and its inputs do not all vary alike (e.g. q split
    over "data", compressed_kv or index_k replicated); else unchanged.

    Why: the kernels' outputs vary over every axis any input varies over (`kernels.runtime`), and the custom_vjps,
    scans and cotangents around them need one type throughout. The cast is `jax.lax.pcast(..., to="varying")`,
    whose transpose sums the cotangent of an input replicated over an axis over that axis, as JAX does for any
    replicated input used by per-device values."""
    fields = _array_fields(problem)
    every = frozenset().union(*(_varying(x) for x in (*fields.values(), *arrays)))
    if not every:
        return (problem, *arrays)

    cast = lambda x: _vary_over(x, every)
    problem = dataclasses.replace(problem, **{name: cast(x) for name, x in fields.items()})
    return (problem, *(jax.tree.map(cast, x) for x in arrays))


def _array_fields(problem) -> dict:
    """{field name: array} of a `validation.Problem`'s array fields."""
    return {f.name: getattr(problem, f.name) for f in dataclasses.fields(problem)
            if isinstance(getattr(problem, f.name), jax.Array)}


def _vary_over(x, axes) -> jax.Array:
    """x cast (`jax.lax.pcast(..., to="varying")`) to vary over the manual mesh axes `axes` too; x if it does."""
    missing = tuple(sorted(frozenset(axes) - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varying(x) -> frozenset:
    """The manual mesh axes x varies over (a tracer inside a `jax.shard_map(check_vma=True)`), else empty."""
    if not isinstance(x, jax.core.Tracer):
        return frozenset()
    return getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", None) or frozenset()


def zeros_varying_like(like, reference) -> jax.Array:
    """Zeros of like's shape and dtype, varying over the manual mesh axes `reference` varies over: a custom_vjp's
    exact-zero cotangent for an input that `vary_alike` made vary like every other (so like the op's output)."""
    return _vary_over(jnp.zeros(like.shape, like.dtype), _varying(reference))


def mesh_for_sharded_call(mesh, q):
    """The mesh a sharded entry point's shard_map runs on. Outside any jax.shard_map: `mesh`. Inside one manual
    over some of the axes (a pipeline's "stage"): the traced mesh of that context, whose other axes the op's
    nested shard_map takes (`mesh` must have the same axes). Inside one manual over every axis: a ValueError."""
    context = getattr(getattr(jax.typeof(q), "sharding", None), "mesh", None)
    manual = set() if context is None else manual_axes(context)
    if not manual:
        return mesh
    if manual == set(context.axis_names):
        raise ValueError(f"mesh: the sharded op is called inside a jax.shard_map that is manual over {sorted(manual)}; "
                         f"it runs its own shard_map over the mesh, so call it outside, or call "
                         f"csa_pallas.indexer_distill_loss inside (it then runs per device on the shard it is given)")
    if dict(getattr(mesh, "shape", {})) != dict(context.shape):
        raise ValueError(f"mesh: the op is traced inside a jax.shard_map over the mesh {dict(context.shape)}, got a "
                         f"mesh {dict(getattr(mesh, 'shape', {}))}; pass the mesh the shard_map runs on")
    return context
