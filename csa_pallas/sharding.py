"""The loss and the teacher under SPMD: batch, heads and query sequence sharded over a device mesh.

Mosaic kernels cannot be partitioned by XLA, so the Pallas path runs inside `jax.shard_map` and does the
partitioning itself:

  * batch (`batch_axes`, one or more mesh axes): rows are independent.
  * heads (`head_axis`): each shard runs the teacher on its heads without the final L1 normalisation, a `psum` over
    the head axis gives sum_h pi_h, which is normalised once. Per-head LSEs (C, u) stay local; so do the sinks.
    More exactly, the head sums are reduce-scattered (`psum_scatter`) along the rows: each head shard receives
    1/n_heads of the rows summed over all heads, normalises them and takes their KL, so the student logits are
    sharded over the rows by (seq, heads) and no all-reduce of [B, S, N] appears in either direction.
  * query sequence (`seq_axis`, context parallelism): each shard keeps its queries with their *global* positions
    and segment ids; compressed_kv and the key-side ids are replicated over the axis (shard_map all-gathers them
    when they arrive sharded); the window LSE gets the W - 1 keys before the shard's first query from the previous
    shard (`lax.ppermute` halo), so it assumes shards are contiguous, in sequence order, of at least W - 1 tokens.
    A caller with a load-balanced (permuted) layout passes `noncompressed_lse` or `full_lse` instead of window_kv.

The loss reduction is global: the per-row KL [B, S] leaves the shard_map sharded like the logits and is reduced in
XLA (mean over the non-empty rows of the whole batch, not a mean of shard means). Gradients of `indexer_logits`
come back with the logits' sharding. implementation="xla" runs the reference under plain `jit`, which XLA
partitions by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from csa_pallas import api
from csa_pallas import placement
from csa_pallas import plans
from csa_pallas import reference
from csa_pallas import teacher_args
from csa_pallas import validation
from csa_pallas.validation import Problem


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Which mesh axes shard which dimension. batch: tuple of axis names (may be empty); heads/seq: a name or None."""

    batch: tuple
    heads: Optional[str]
    seq: Optional[str]

    @property
    def batch_entry(self):
        return self.batch if self.batch else None

    def q_spec(self):  # [B, S, H, D]
        return P(self.batch_entry, self.seq, self.heads, None)

    def rows_spec(self):  # [B, S, ...] arrays sharded like the queries
        return P(self.batch_entry, self.seq)

    def row_vectors_spec(self):  # [B, S, X] (logits, top-k indices, window keys)
        return P(self.batch_entry, self.seq, None)

    def head_stats_spec(self):  # [B, S, H]
        return P(self.batch_entry, self.seq, self.heads)

    def replicated_keys_spec(self):  # [B, S_kv] and [B, N, D]: the whole key sequence on every seq shard
        return P(self.batch_entry, None)

    @property
    def kl_rows_entry(self):
        """How the rows of the target/student/loss are split: over seq, then over heads within a seq shard (the head
        shards reduce-scatter the teacher's head sum, each keeps 1/n_heads of the rows)."""
        split = tuple(a for a in (self.seq, self.heads) if a is not None)
        return split if len(split) > 1 else (split[0] if split else None)

    def kl_spec(self):  # [B, S, X] student logits and target
        return P(self.batch_entry, self.kl_rows_entry, None)

    def loss_rows_spec(self):  # [B, S] per-row KL
        return P(self.batch_entry, self.kl_rows_entry)


def _axis_size(mesh: Mesh, name: Optional[str]) -> int:
    return 1 if name is None else mesh.shape[name]


def _mesh_axes(mesh, batch_axes, head_axis, seq_axis, problem: Problem) -> MeshAxes:
    """Checks the mesh and axis arguments against the problem; raises ValueError/TypeError naming the argument."""
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh (or the AbstractMesh of a traced input), got "
                        f"{type(mesh).__name__}")
    if batch_axes is None:
        batch_axes = ()
    elif isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    elif isinstance(batch_axes, (list, tuple)):
        batch_axes = tuple(batch_axes)
    else:
        raise TypeError(f"batch_axes: expected a mesh axis name or a list of names, got "
                        f"{type(batch_axes).__name__} {batch_axes!r}")
    names = [("batch_axes", a) for a in batch_axes] + [("head_axis", head_axis), ("seq_axis", seq_axis)]
    used = []
    for arg, name in names:
        if name is None:
            continue
        if not isinstance(name, str):
            raise TypeError(f"{arg}: expected a mesh axis name (str), got {type(name).__name__} {name!r}")
        if name not in mesh.shape:
            raise ValueError(f"{arg}: {name!r} is not an axis of the mesh, whose axes are {tuple(mesh.shape)}")
        if name in used:
            raise ValueError(f"{arg}: mesh axis {name!r} is used for two dimensions")
        if name in placement.manual_axes(mesh):
            raise ValueError(f"{arg}: mesh axis {name!r} is manual in the jax.shard_map the op is traced in (each "
                             f"device already holds its part of the arrays); name only the mesh's other axes")
        used.append(name)
    axes = MeshAxes(batch=batch_axes, heads=head_axis, seq=seq_axis)
    n_batch = math.prod(mesh.shape[a] for a in batch_axes)
    if problem.batch % n_batch:
        raise ValueError(f"batch_axes: the batch B={problem.batch} must be a multiple of the number of batch shards "
                         f"{n_batch} (mesh axes {batch_axes})")
    n_heads = _axis_size(mesh, head_axis)
    if problem.num_heads % n_heads:
        raise ValueError(f"head_axis: the number of heads H={problem.num_heads} must be a multiple of the mesh axis "
                         f"{head_axis!r} size {n_heads}")
    local_heads = problem.num_heads // n_heads
    if problem.head_chunk is not None and local_heads % problem.head_chunk:
        raise ValueError(f"head_chunk: expected a divisor of the heads per shard H/{n_heads}={local_heads}, got "
                         f"{problem.head_chunk}")
    n_seq = _axis_size(mesh, seq_axis)
    if problem.seq_len % n_seq:
        raise ValueError(f"seq_axis: the sequence length S={problem.seq_len} must be a multiple of the mesh axis "
                         f"{seq_axis!r} size {n_seq}")
    if n_seq > 1 and problem.kv_len != problem.seq_len:
        raise ValueError(f"seq_axis: sharding the sequence needs the key sequence to be the query sequence "
                         f"(S_kv == S), got S_kv={problem.kv_len}, S={problem.seq_len}")
    local_seq = problem.seq_len // n_seq
    if local_seq % n_heads:
        raise ValueError(f"head_axis: the head shards split the KL rows of a sequence shard, so the tokens per "
                         f"sequence shard S/{n_seq}={local_seq} must be a multiple of the mesh axis {head_axis!r} size "
                         f"{n_heads}")
    if n_seq > 1 and problem.window_kv is not None and local_seq < problem.window_size - 1:
        raise ValueError(f"seq_axis: each of the {n_seq} sequence shards holds {local_seq} tokens, fewer "
                         f"than the window halo W - 1 = {problem.window_size - 1}; use fewer sequence shards or pass "
                         f"noncompressed_lse")
    return axes


def _global_ids(problem: Problem, axes: MeshAxes):
    """Query/key ids to hand to the shards, or None when every shard can use the default (one document, positions
    0..S-1 on the unsharded sequence: the kernels then use their static causal schedule)."""
    if problem.default_ids and axes.seq is None:
        return None
    return dict(segment_ids=problem.segment_ids, positions=problem.positions,
                kv_segment_ids=problem.kv_segment_ids, kv_positions=problem.kv_positions)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cotangent_sharded_like(x, mesh, spec):
    """Identity whose cotangent is laid out as `spec` (the logits' layout, not the kernels' internal one) on Auto
    axes. On Explicit axes the cotangent keeps the input's own type, as JAX requires of a gradient."""
    return x


def _cotangent_sharded_like_fwd(x, mesh, spec):
    return x, None


def _cotangent_sharded_like_bwd(mesh, spec, _, cotangent):
    if AxisType.Explicit in set(mesh.axis_types):  # the cotangent has the input's type (a reshard's transpose)
        return (cotangent,)
    return (jax.lax.with_sharding_constraint(cotangent, NamedSharding(mesh, spec)),)


_cotangent_sharded_like.defvjp(_cotangent_sharded_like_fwd, _cotangent_sharded_like_bwd)


def _halo(x, axes: MeshAxes, num_seq_shards: int, width: int, fill=0):
    """The last `width` rows (axis 1) of the previous sequence shard, `fill` on the first shard."""
    tail = x[:, x.shape[1] - width:]
    moved = lax.ppermute(tail, axes.seq, perm=[(i, i + 1) for i in range(num_seq_shards - 1)])
    first = lax.axis_index(axes.seq) == 0
    return jnp.where(first, jnp.full_like(moved, fill), moved)


def _local_window_lse(local: dict, problem: Problem, axes: MeshAxes, num_seq_shards: int):
    """u for this shard's queries and heads, f32 [B_l, S_l, H_l] (window kernel + sinks)."""
    from csa_pallas import ops
    q, kv = local["q"], local["window_kv"]
    ids = local.get("ids")
    halo = problem.window_size - 1 if num_seq_shards > 1 else 0
    if halo == 0:
        kw = {} if ids is None else dict(segment_ids=ids["segment_ids"], positions=ids["positions"],
                                         kv_segment_ids=ids["kv_local_segment_ids"],
                                         kv_positions=ids["kv_local_positions"])
        window = validation.validate_window_args(
            q, kv, sinks=local.get("sinks"), window_size=problem.window_size, softmax_scale=problem.softmax_scale,
            head_chunk=problem.head_chunk, implementation="pallas", **{**_NO_IDS, **kw})
        return ops.noncompressed_lse(window)
    with_halo = lambda x, fill=0: jnp.concatenate([_halo(x, axes, num_seq_shards, halo, fill), x], axis=1)
    kv_seg, kv_pos = ids["kv_local_segment_ids"], ids["kv_local_positions"]
    key_valid = with_halo(jnp.ones(kv_seg.shape, bool), fill=False)  # the first shard has no previous keys
    window = validation.validate_window_args(
        q, with_halo(kv), sinks=local.get("sinks"), segment_ids=ids["segment_ids"], positions=ids["positions"],
        kv_segment_ids=with_halo(kv_seg), kv_positions=with_halo(kv_pos), window_size=problem.window_size,
        softmax_scale=problem.softmax_scale, head_chunk=problem.head_chunk, implementation="pallas")
    return ops.noncompressed_lse(window, key_offset=halo, key_valid=key_valid)


_NO_IDS = dict(segment_ids=None, positions=None, kv_segment_ids=None, kv_positions=None)


def _local_problem(local: dict, problem: Problem, axes: MeshAxes, num_seq_shards: int) -> Problem:
    """The teacher problem of one shard: local queries/heads, the whole key sequence, u computed locally."""
    ids = local.get("ids")
    stats = {}
    if problem.target == "joint":
        if problem.full_lse is not None:
            stats["full_lse"] = local["full_lse"]
        elif problem.noncompressed_lse is not None:
            stats["noncompressed_lse"] = local["noncompressed_lse"]
        else:
            stats["noncompressed_lse"] = _local_window_lse(local, problem, axes, num_seq_shards)
    id_args = _NO_IDS if ids is None else dict(
        segment_ids=ids["segment_ids"], positions=ids["positions"], kv_segment_ids=ids["kv_segment_ids"],
        kv_positions=ids["kv_positions"])
    shard = validation.validate(
        local["q"], local["compressed_kv"], topk_indices=local.get("topk_indices"), loss_mask=local.get("loss_mask"),
        compress_ratio=problem.compress_ratio, window_size=problem.window_size, softmax_scale=problem.softmax_scale,
        target=problem.target, head_chunk=problem.head_chunk, implementation="pallas", **stats, **id_args)
    return dataclasses.replace(shard, teacher_config=problem.teacher_config)  # the caller's config= on every shard


def _kl_rows_problem(shard: Problem, axes: MeshAxes, num_head_shards: int) -> Problem:
    """The rows this device takes the KL of when heads are sharded: its 1/n_heads slice of the shard's queries
    (only shapes and ids are read: the KL kernels need the support V(t) of each row)."""
    rows = shard.seq_len // num_head_shards
    start = lax.axis_index(axes.heads) * rows
    take = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, start, rows, axis=1)
    return validation.validate(
        take(shard.q), shard.compressed_kv, topk_indices=take(shard.topk_indices), segment_ids=take(shard.segment_ids),
        positions=take(shard.positions), kv_segment_ids=shard.kv_segment_ids, kv_positions=shard.kv_positions,
        loss_mask=take(shard.loss_mask), compress_ratio=shard.compress_ratio, window_size=shard.window_size,
        softmax_scale=shard.softmax_scale, target="per_head", head_chunk=shard.head_chunk, implementation="pallas")


def _local_target(local: dict, problem: Problem, axes: MeshAxes, num_seq_shards: int, num_head_shards: int):
    """The normalised target of the rows this device owns: (padded target, KL layout, plan, rows problem).

    Heads sharded: each head shard's teacher head sum over the shard's rows is reduce-scattered over the head axis
    (sum over heads, each device keeps 1/n_heads of the rows) and normalised there, so the KL runs once per row.
    """
    shard = _local_problem(local, problem, axes, num_seq_shards)
    plan = plans.plan_for(shard)
    layout = plan.layout(shard)
    if axes.heads is None:
        return plan.teacher(shard, layout), layout, plan, shard
    # sigma (the rows' shift of u, `ops.lse_blocks`) must be one number per row for all heads: min over shards.
    head_sum, rowmax = plan.teacher(shard, layout, normalize=False, reduce_low=lambda low: lax.pmin(low, axes.heads))
    head_sum, rowmax = head_sum[:, :shard.seq_len, :shard.width], rowmax[:, :shard.seq_len]
    # Each shard's sums are relative to its own row max M of the head weights (`kernels.rebase`): rescale them to
    # the max over all head shards before adding (a [B, S] collective), so nothing underflows whatever u - C is.
    top = lax.pmax(rowmax, axes.heads)
    factor = jnp.where(top == -jnp.inf, 1.0, jnp.exp2(rowmax - top))[..., None]
    head_sum = jnp.where(plan.valid_entries(head_sum), head_sum * factor, head_sum)
    mine = lax.psum_scatter(head_sum, axes.heads, scatter_dimension=1, tiled=True)
    rows_problem = _kl_rows_problem(shard, axes, num_head_shards)
    kl_layout = plan.layout(rows_problem)
    target = plans.finish_head_sum(plan, mine, kl_layout)
    return jax.lax.stop_gradient(target), kl_layout, plan, rows_problem


def _shard_inputs(problem: Problem, axes: MeshAxes, indexer_logits=None):
    """(arrays, in_specs): the pytree handed to shard_map."""
    arrays, specs = {"q": problem.q, "compressed_kv": problem.compressed_kv}, {
        "q": axes.q_spec(), "compressed_kv": P(axes.batch_entry, None, None)}
    if indexer_logits is not None:
        arrays["logits"], specs["logits"] = indexer_logits, axes.kl_spec()
    if problem.topk_indices is not None:
        arrays["topk_indices"], specs["topk_indices"] = problem.topk_indices, axes.row_vectors_spec()
    if problem.loss_mask is not None:
        arrays["loss_mask"], specs["loss_mask"] = problem.loss_mask, axes.rows_spec()
    for name in ("noncompressed_lse", "full_lse"):
        if getattr(problem, name) is not None:
            arrays[name], specs[name] = getattr(problem, name), axes.head_stats_spec()
    if problem.target == "joint" and problem.window_kv is not None:
        arrays["window_kv"], specs["window_kv"] = problem.window_kv, axes.row_vectors_spec()
        if problem.sinks is not None:
            arrays["sinks"], specs["sinks"] = problem.sinks, P(axes.heads)
    ids = _global_ids(problem, axes)
    if ids is not None:
        arrays["ids"] = dict(ids, kv_local_segment_ids=problem.kv_segment_ids,
                             kv_local_positions=problem.kv_positions)
        specs["ids"] = dict(segment_ids=axes.rows_spec(), positions=axes.rows_spec(),
                            kv_segment_ids=axes.replicated_keys_spec(), kv_positions=axes.replicated_keys_spec(),
                            kv_local_segment_ids=axes.rows_spec(), kv_local_positions=axes.rows_spec())
    return arrays, specs


def _validate_sharded(mesh, batch_axes, head_axis, seq_axis, q, compressed_kv, teacher: dict, config=None):
    """(mesh, problem, axes): the mesh the shard_map runs on (`placement.mesh_for_sharded_call`); config: the teacher
    kernels' variant (`config=`), kept on the problem for every shard's."""
    mesh = placement.mesh_for_sharded_call(mesh, q)
    problem = dataclasses.replace(validation.validate(q, compressed_kv, **teacher),
                                  teacher_config=validation.freeze_config(config))
    axes = _mesh_axes(mesh, batch_axes, head_axis, seq_axis, problem)
    return mesh, problem, axes


def _uses_pallas(problem: Problem) -> bool:
    return api.choose_implementation(problem) == "pallas"


AxisNames = Union[None, str, Sequence[str]]


@teacher_args.takes_teacher_args
def sharded_indexer_distill_loss(
    mesh: Mesh,
    indexer_logits: jax.Array,
    q: jax.Array,
    compressed_kv: jax.Array,
    *,
    teacher: dict,
    batch_axes: AxisNames = None,
    head_axis: Optional[str] = None,
    seq_axis: Optional[str] = None,
    reduction: str = "mean",
    scale=1.0,
    config=None,
) -> jax.Array:
    """`csa_pallas.indexer_distill_loss` with batch, heads and query sequence sharded over `mesh`.

    Args are the global arrays and arguments of `indexer_distill_loss` (any sharding; typically NamedShardings on
    `mesh`), plus:
      mesh: the jax.sharding.Mesh.
      batch_axes: mesh axis name(s) sharding B (data / fsdp). B must be a multiple of their total size.
      head_axis: mesh axis sharding the H attention heads (tensor parallelism). head_chunk must divide H / size.
      seq_axis: mesh axis sharding the query sequence (context parallelism): S a multiple of its size, S_kv == S,
        shards contiguous and in order, each of >= W - 1 tokens when window_kv is given.
      config: the teacher kernels' variant, as `indexer_distill_loss`'s, applied to every shard's problem (a forced
        field that cannot run on a shard's rows is a ValueError naming it); with head_axis it takes the teacher's
        head sums, and the KL of each device's owned rows runs its own default tiles.
    Returns the same value as the unsharded op (f32 scalar, or [B, S] for reduction="none"); differentiable wrt
    indexer_logits only, under jit and grad. Inside, the logits are split over rows by (seq_axis, head_axis); their
    gradient comes back sharded P(batch_axes, seq_axis, None), the layout of activations on this mesh (Auto axes;
    on Explicit axes, the logits' own type). Inside a jax.shard_map manual over some of the mesh's axes, it runs on
    the others (`placement.mesh_for_sharded_call`).
    """
    mesh, problem, axes = _validate_sharded(mesh, batch_axes, head_axis, seq_axis, q, compressed_kv, teacher, config)
    validation.validate_logits(indexer_logits, problem)
    validation.check_reduction_args(reduction, scale)
    if not _uses_pallas(problem) or api.trivial_result(problem, reduction, scale) is not None:
        return api.indexer_distill_loss(indexer_logits, q, compressed_kv, **teacher, reduction=reduction,
                                        scale=scale, config=config)
    num_seq_shards, num_head_shards = _axis_size(mesh, seq_axis), _axis_size(mesh, head_axis)
    indexer_logits = _cotangent_sharded_like(indexer_logits, mesh, axes.row_vectors_spec())
    arrays, specs = _shard_inputs(problem, axes, indexer_logits)
    arrays = placement.reshard_for_shard_map(arrays, specs, mesh)

    def per_shard(local):
        if axes.heads is None:  # every row's head sum is local: the fused teacher + KL kernel
            shard, logits = _local_problem(local, problem, axes, num_seq_shards), local["logits"]
            plan = plans.plan_for(shard)
            return plan.fused_kl_rows(logits, shard, plan.layout(shard, kl_logits_dtype=logits.dtype))
        target, layout, plan, _ = _local_target(local, problem, axes, num_seq_shards, num_head_shards)
        return plan.kl_rows(local["logits"], target, layout)

    rows, nonempty = placement.shard_map(per_shard, mesh, in_specs=(specs,),
                                         out_specs=(axes.loss_rows_spec(), axes.loss_rows_spec()))(arrays)
    return reference.reduce_rows(rows, nonempty, reduction, scale)


@teacher_args.takes_teacher_args
def sharded_teacher_distribution(
    mesh: Mesh,
    q: jax.Array,
    compressed_kv: jax.Array,
    *,
    teacher: dict,
    batch_axes: AxisNames = None,
    head_axis: Optional[str] = None,
    seq_axis: Optional[str] = None,
    config=None,
) -> jax.Array:
    """`csa_pallas.teacher_distribution` sharded like `sharded_indexer_distill_loss` (config= as there): f32
    [B, S, N] or [B, S, K], sharded over batch and over rows by (seq_axis, head_axis)."""
    mesh, problem, axes = _validate_sharded(mesh, batch_axes, head_axis, seq_axis, q, compressed_kv, teacher, config)
    if not _uses_pallas(problem) or not (problem.batch and problem.seq_len and problem.num_blocks):
        return api.teacher_distribution(q, compressed_kv, **teacher, config=config)
    num_seq_shards, num_head_shards = _axis_size(mesh, seq_axis), _axis_size(mesh, head_axis)
    arrays, specs = _shard_inputs(problem, axes)
    arrays = placement.reshard_for_shard_map(arrays, specs, mesh)

    def per_shard(local):
        target, _, _, rows_problem = _local_target(local, problem, axes, num_seq_shards, num_head_shards)
        return plans.positive_part(target[:, :rows_problem.seq_len, :problem.width])

    return placement.shard_map(per_shard, mesh, in_specs=(specs,), out_specs=axes.kl_spec())(arrays)


def sharded_noncompressed_lse(mesh, q, window_kv, *, batch_axes: AxisNames = None, head_axis: Optional[str] = None,
                              seq_axis: Optional[str] = None, sinks=None, segment_ids=None, positions=None,
                              kv_segment_ids=None, kv_positions=None, window_size: int = 128,
                              softmax_scale: Optional[float] = None, head_chunk: Optional[int] = None) -> jax.Array:
    """`csa_pallas.noncompressed_lse` (the window-LSE kernel, f32 [B, S, H]) sharded like the loss: batch, heads,
    and the query sequence with the W - 1 key halo from the previous shard. Pallas path only."""
    mesh = placement.mesh_for_sharded_call(mesh, q)
    problem = validation.validate_window_args(
        q, window_kv, sinks=sinks, segment_ids=segment_ids, positions=positions, kv_segment_ids=kv_segment_ids,
        kv_positions=kv_positions, window_size=window_size, softmax_scale=softmax_scale, head_chunk=head_chunk,
        implementation="pallas")
    axes = _mesh_axes(mesh, batch_axes, head_axis, seq_axis, problem)
    num_seq_shards = _axis_size(mesh, seq_axis)
    arrays = {"q": problem.q, "window_kv": problem.window_kv}
    specs = {"q": axes.q_spec(), "window_kv": axes.row_vectors_spec()}
    if problem.sinks is not None:
        arrays["sinks"], specs["sinks"] = problem.sinks, P(axes.heads)
    ids = _global_ids(problem, axes)
    if ids is not None:
        arrays["ids"] = dict(segment_ids=problem.segment_ids, positions=problem.positions,
                             kv_local_segment_ids=problem.kv_segment_ids, kv_local_positions=problem.kv_positions)
        specs["ids"] = {name: axes.rows_spec() for name in arrays["ids"]}
    arrays = placement.reshard_for_shard_map(arrays, specs, mesh)
    run = lambda local: _local_window_lse(local, problem, axes, num_seq_shards)
    return placement.shard_map(run, mesh, in_specs=(specs,), out_specs=axes.head_stats_spec())(arrays)
