"""Flax wrappers of the CSA indexer distillation loss: one module per layer that computes and records the loss.

`CSAIndexerLoss` (flax.nnx) and `CSAIndexerLossLinen` (flax.linen) hold the loss configuration and call
`csa_pallas.indexer_distill_loss` (SPEC.md). Each call returns the scaled loss and also *sows* it under the name
"indexer_loss" so model code can collect every layer's loss without threading it through return values, the way
MaxText's train loop collects `indexer_loss` intermediates:

    # NNX: capture the intermediates of one forward pass.
    out, inter = nnx.capture(model, nnx.Intermediate)(x)
    aux = jnp.mean(collect_indexer_losses(inter))          # mean over layers, like MaxText train.py

    # Linen: make "intermediates" mutable.
    out, state = model.apply(variables, x, mutable=["intermediates"])
    aux = jnp.mean(collect_indexer_losses(state["intermediates"]))

Called outside `nnx.capture`, `Module.sow` falls back to flax's deprecated behaviour (what MaxText's NNX layers
rely on): it stores the value on the module as an `nnx.Intermediate` attribute, appending one entry per call,
and `nnx.pop(model, nnx.Intermediate)` takes it back out. Prefer `nnx.capture` around every call, evaluation
included: a module whose attributes changed has a new graph structure, so the next `nnx.jit` call retraces.

Configuration: the constructors take the fields of `IndexerLossConfig`, or a MaxText config object (or dict) with
`indexer_loss_scaling_factor`, `indexer_sparse_training`, `mla_qk_head_chunk_size`, `sliding_window_size`
(see `IndexerLossConfig.from_maxtext_config`). A bad value raises a ValueError that starts with the field's name
("scale: ...", "mla_qk_head_chunk_size: ...") at construction time, not deep inside a traced computation.
Problems only the arrays can reveal (a head_chunk that does not divide H, a missing window_kv for the joint
target, ...) are reported by `csa_pallas.indexer_distill_loss` at the first call, naming the argument.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh

from csa_pallas import api
from csa_pallas import sharded_student
from csa_pallas import sharding
from csa_pallas import teacher_args
from csa_pallas import validation
from csa_pallas.validation import IMPLEMENTATIONS, REDUCTIONS, TARGETS

__all__ = [
    "SOW_NAME", "IndexerLossConfig", "CSAIndexerLoss", "CSAIndexerLossLinen", "collect_indexer_losses",
]

SOW_NAME = "indexer_loss"  # MaxText's intermediate name; its train loop collects it by this suffix

# MaxText field -> our field.
MAXTEXT_FIELDS = {
    "indexer_loss_scaling_factor": "scale",
    "indexer_sparse_training": "sparse_training",
    "mla_qk_head_chunk_size": "head_chunk",
    "sliding_window_size": "window_size",
}


class _Unset:
    """Default of the nnx constructor's keywords: tells "not given" from an explicit None."""

    def __repr__(self):
        return "<unset>"


_MISSING = _Unset()


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _positive_int(name: str, value) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class IndexerLossConfig:
    """Static configuration of the indexer loss (hashable: it lives in the module's static structure).

    Attributes:
      compress_ratio: m, key tokens per compressed block (4 for CSA).
      window_size: W, keys of the sliding-window branch including the query itself (joint target only).
      target: "joint" (the layer's single softmax over window ‖ compressed ‖ sink; needs window_kv or an LSE)
        or "per_head" (each head normalised over the compressed blocks alone, MaxText PR #5033).
      reduction: "mean" (over rows with a visible block), "mean_all" (over B*S), "sum", or "none" ([B, S]).
      scale: the loss coefficient (MaxText `indexer_loss_scaling_factor`), a Python float >= 0.
      head_chunk: heads of q processed together; None = all heads (MaxText `mla_qk_head_chunk_size`, 0 = all).
      softmax_scale: tau of the teacher logits; None = D**-0.5. Pass 1.0 if q is already multiplied by tau.
      sparse_training: True = every call must pass topk_indices (sparse stage), False = none may (dense warm-up),
        None = decided per call by whether topk_indices is given (MaxText `indexer_sparse_training`).
      implementation: None (auto), "xla" or "pallas"; passed through to `csa_pallas.indexer_distill_loss`.
      mesh, batch_axes, head_axis, seq_axis: run sharded (`csa_pallas.sharded_indexer_distill_loss`) on this
        jax.sharding.Mesh, batch over `batch_axes` (a tuple of names), heads over `head_axis`, the query sequence
        over `seq_axis` (e.g. MaxText's ("data", "fsdp"), "tensor", "context"). mesh=None: unsharded call.
      padding_segment_id: a call that passes segment_ids but no loss_mask masks the rows of this segment id out of
        the loss (loss_mask = segment_ids != padding_segment_id); None (the default) masks nothing.
        `from_maxtext_config` sets 0, MaxText's padding id (`decoder_segment_ids == 0`); override with None.
      kernel_config: the teacher kernels' variant, the ops' `config=` (a `TeacherConfig` or a dict of its fields,
        e.g. {"path": "visit", "tile_list": True}; sharded too); None: the heuristics.
    """

    compress_ratio: int = 4
    window_size: int = 128
    target: str = "joint"
    reduction: str = "mean"
    scale: float = 1.0
    head_chunk: Optional[int] = None
    softmax_scale: Optional[float] = None
    sparse_training: Optional[bool] = None
    implementation: Optional[str] = None
    mesh: Optional[Mesh] = None
    batch_axes: tuple = ()
    head_axis: Optional[str] = None
    seq_axis: Optional[str] = None
    padding_segment_id: Optional[int] = None
    kernel_config: Any = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: canonicalise in place
        try:  # hashable: a dict is kept as its sorted items (which dataclasses.replace hands back)
            set_("kernel_config", validation.freeze_config(validation.thaw_config(self.kernel_config)))
        except (TypeError, ValueError):
            raise TypeError(f"kernel_config: expected None, a TeacherConfig or a dict of its fields, got "
                            f"{type(self.kernel_config).__name__}") from None
        if self.padding_segment_id is not None and not _is_int(self.padding_segment_id):
            raise ValueError(f"padding_segment_id: expected None or an int, got {self.padding_segment_id!r}")
        set_("compress_ratio", _positive_int("compress_ratio", self.compress_ratio))
        set_("window_size", _positive_int("window_size", self.window_size))
        if self.target not in TARGETS:
            raise ValueError(f"target: expected one of {TARGETS}, got {self.target!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {self.reduction!r}")
        # scale must be a concrete Python number: it is static module configuration, not a traced value.
        if not _is_real(self.scale) or not math.isfinite(self.scale) or self.scale < 0:
            raise ValueError(f"scale: expected a finite Python float >= 0, got {self.scale!r}")
        set_("scale", float(self.scale))
        if self.head_chunk is not None:
            set_("head_chunk", _positive_int("head_chunk", self.head_chunk))
        if self.softmax_scale is not None:
            if not _is_real(self.softmax_scale) or not math.isfinite(self.softmax_scale) or self.softmax_scale <= 0:
                raise ValueError(f"softmax_scale: expected None or a finite Python float > 0, got "
                                 f"{self.softmax_scale!r}")
            set_("softmax_scale", float(self.softmax_scale))
        if self.sparse_training is not None and not isinstance(self.sparse_training, (bool, np.bool_)):
            raise ValueError(f"sparse_training: expected None, True or False, got {self.sparse_training!r}")
        if self.sparse_training is not None:
            set_("sparse_training", bool(self.sparse_training))
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation: expected one of {IMPLEMENTATIONS}, got {self.implementation!r}")
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise ValueError(f"mesh: expected None or a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        set_("batch_axes", (self.batch_axes,) if isinstance(self.batch_axes, str) else tuple(self.batch_axes))
        if self.mesh is None and (self.batch_axes or self.head_axis or self.seq_axis):
            raise ValueError("mesh: batch_axes/head_axis/seq_axis name mesh axes, so they need mesh= as well")

    @classmethod
    def from_maxtext_config(cls, cfg, **overrides) -> "IndexerLossConfig":
        """Builds the configuration from a MaxText config (any object with the attributes, or a Mapping).

        Mapping (MaxText field -> ours):
          indexer_loss_scaling_factor -> scale (>= 0; 0 makes the loss and its gradient exactly 0)
          indexer_sparse_training     -> sparse_training (True: the sparse stage, calls pass topk_indices)
          mla_qk_head_chunk_size      -> head_chunk (0 -> None = all heads)
          sliding_window_size         -> window_size (must be >= 1: the CSA window branch always exists)
        and padding_segment_id = 0: rows whose segment id is 0 (MaxText's padding) are masked out of the loss
        when a call passes segment_ids and no loss_mask.
        A MaxText field may be absent only when its counterpart is given in `overrides`. `overrides` takes our
        field names (compress_ratio, target, reduction, implementation, softmax_scale, padding_segment_id, ...)
        and wins over `cfg`.
        MaxText's per-layer `compress_ratios` list is not read: pass this layer's `compress_ratio` (default 4).
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown IndexerLossConfig field; expected some of {sorted(fields)}")

        def get(name):
            if isinstance(cfg, Mapping):
                return cfg[name] if name in cfg else _MISSING
            return getattr(cfg, name, _MISSING)

        values = {}
        for mt_name, ours in MAXTEXT_FIELDS.items():
            if ours in overrides:
                continue
            value = get(mt_name)
            if value is _MISSING:
                raise ValueError(f"{mt_name}: missing from the MaxText config {type(cfg).__name__}; set it or pass "
                                 f"{ours}= as an override")
            values[ours] = _from_maxtext_value(mt_name, value)
        values["padding_segment_id"] = 0
        values.update(overrides)
        return cls(**values)


def _from_maxtext_value(mt_name: str, value):
    """Converts one MaxText value, so a bad value is reported under MaxText's field name."""
    if mt_name == "indexer_loss_scaling_factor":
        if not _is_real(value) or not math.isfinite(value) or value < 0:
            raise ValueError(f"indexer_loss_scaling_factor: expected a finite float >= 0, got {value!r}")
        return float(value)
    if mt_name == "indexer_sparse_training":
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"indexer_sparse_training: expected True or False, got {value!r}")
        return bool(value)
    if mt_name == "mla_qk_head_chunk_size":
        if not _is_int(value) or value < 0:
            raise ValueError(f"mla_qk_head_chunk_size: expected an int >= 0 (0 = all heads), got {value!r}")
        return None if value == 0 else int(value)
    if mt_name == "sliding_window_size":
        if not _is_int(value) or value < 1:
            raise ValueError(f"sliding_window_size: expected an int >= 1 (the CSA sliding window W), got {value!r}")
        return int(value)
    raise AssertionError(mt_name)


def _resolve_config(config, explicit: dict) -> IndexerLossConfig:
    """config: None, an IndexerLossConfig, or a MaxText config (object or Mapping); explicit kwargs override it."""
    if config is None:
        return IndexerLossConfig(**explicit)
    if isinstance(config, IndexerLossConfig):
        return dataclasses.replace(config, **explicit)
    return IndexerLossConfig.from_maxtext_config(config, **explicit)


def _compute_loss(cfg: IndexerLossConfig, student: tuple, q, compressed_kv, *, topk_indices, window_kv, sinks,
                  noncompressed_lse, full_lse, segment_ids, positions, kv_segment_ids, kv_positions, loss_mask):
    """student: (indexer_logits,) or the indexer's (index_q, index_k, index_weights) (SPEC §8, the fused op)."""
    if cfg.sparse_training is True and topk_indices is None:
        raise ValueError("topk_indices: required because sparse_training=True (MaxText indexer_sparse_training); "
                         "the sparse stage's loss is over the K selected slots")
    if cfg.sparse_training is False and topk_indices is not None:
        raise ValueError("topk_indices: given but sparse_training=False (MaxText indexer_sparse_training, the dense "
                         "warm-up computes the loss over all visible blocks); drop it or set sparse_training")
    if loss_mask is None and cfg.padding_segment_id is not None and segment_ids is not None:
        loss_mask = jnp.asarray(segment_ids) != cfg.padding_segment_id
    fused = len(student) == 3
    if cfg.mesh is not None:
        sharded = sharded_student.sharded_fused_indexer_distill_loss if fused else (
            sharding.sharded_indexer_distill_loss)
        run = functools.partial(sharded, cfg.mesh, batch_axes=cfg.batch_axes, head_axis=cfg.head_axis,
                                seq_axis=cfg.seq_axis)
    else:
        run = api.fused_indexer_distill_loss if fused else api.indexer_distill_loss
    return run(
        *student, q, compressed_kv, topk_indices=topk_indices, window_kv=window_kv, sinks=sinks,
        noncompressed_lse=noncompressed_lse, full_lse=full_lse, segment_ids=segment_ids, positions=positions,
        kv_segment_ids=kv_segment_ids, kv_positions=kv_positions, loss_mask=loss_mask,
        compress_ratio=cfg.compress_ratio, window_size=cfg.window_size, softmax_scale=cfg.softmax_scale,
        target=cfg.target, reduction=cfg.reduction, scale=cfg.scale, head_chunk=cfg.head_chunk,
        implementation=cfg.implementation, config=validation.thaw_config(cfg.kernel_config))


# The keyword arrays of a module call (every one optional): the op's teacher arguments that are not config fields.
_NO_ARRAYS = dict.fromkeys(name for name in teacher_args.NAMES
                           if name not in {f.name for f in dataclasses.fields(IndexerLossConfig)})


def _arrays(arguments: dict) -> dict:
    """The module call's keyword arrays, picked by name (a misspelt one is a TypeError naming it)."""
    unknown = sorted(set(arguments) - set(_NO_ARRAYS) - {"self", "indexer_logits", "q", "compressed_kv",
                                                          "__class__"})
    if unknown:
        raise TypeError(f"{unknown[0]}: not an argument of the indexer loss module (expected some of "
                        f"{tuple(_NO_ARRAYS)})")
    return {name: arguments[name] for name in _NO_ARRAYS}


_CALL_DOC = """Computes the loss, records it (sow, name "indexer_loss") and returns it.

    Args:
      indexer_logits: the student scores I, float [B, S, N] (dense) or [B, S, K] (sparse, slot k belongs to
        topk_indices[..., k]). The only input that receives a gradient.
      q: the layer's attention queries after RoPE, float [B, S, H, D] (bf16 or f32); gets a zero gradient.
      compressed_kv: the layer's CSA compressed KV blocks, float [B, N, D]; gets a zero gradient.
      topk_indices: int32 [B, S, K] selected blocks, -1 = empty slot (sparse stage); None = dense.
      window_kv: float [B, S_kv, D] keys of the sliding-window branch (joint target; ignored for per_head).
      sinks: f32 [H] per-head sink logits (joint target, with window_kv).
      noncompressed_lse / full_lse: f32 [B, S, H] alternatives to window_kv for the joint target (SPEC §3);
        pass at most one of window_kv, noncompressed_lse, full_lse.
      segment_ids, positions: int32 [B, S] packing; kv_segment_ids, kv_positions: int32 [B, S_kv] key side.
      loss_mask: bool [B, S], False = the row takes no part in the loss (default: from padding_segment_id).

    Returns:
      f32 scalar (scale * KL), or f32 [B, S] rows for reduction="none". The same value is sown.
    """


class CSAIndexerLoss(nnx.Module):
    """flax.nnx module computing and sowing the CSA indexer distillation loss (no parameters).

    Construct with keyword fields of `IndexerLossConfig` and/or `config=` (an IndexerLossConfig, or a MaxText
    config object / dict, see `IndexerLossConfig.from_maxtext_config`); explicit keywords win over `config`.
    """

    def __init__(self, config=None, *, compress_ratio=_MISSING, window_size=_MISSING, target=_MISSING,
                 reduction=_MISSING, scale=_MISSING, head_chunk=_MISSING, softmax_scale=_MISSING,
                 sparse_training=_MISSING, implementation=_MISSING, mesh=_MISSING, batch_axes=_MISSING,
                 head_axis=_MISSING, seq_axis=_MISSING, padding_segment_id=_MISSING, kernel_config=_MISSING):
        explicit = {k: v for k, v in dict(
            compress_ratio=compress_ratio, window_size=window_size, target=target, reduction=reduction,
            scale=scale, head_chunk=head_chunk, softmax_scale=softmax_scale, sparse_training=sparse_training,
            implementation=implementation, mesh=mesh, batch_axes=batch_axes, head_axis=head_axis,
            seq_axis=seq_axis, padding_segment_id=padding_segment_id, kernel_config=kernel_config).items()
            if v is not _MISSING}
        self.config = _resolve_config(config, explicit)

    @classmethod
    def from_maxtext_config(cls, cfg, **overrides) -> "CSAIndexerLoss":
        """`CSAIndexerLoss` from a MaxText config; see `IndexerLossConfig.from_maxtext_config`."""
        return cls(IndexerLossConfig.from_maxtext_config(cfg, **overrides))

    def __call__(self, indexer_logits: jax.Array, q: jax.Array, compressed_kv: jax.Array, *, topk_indices=None,
                 window_kv=None, sinks=None, noncompressed_lse=None, full_lse=None, segment_ids=None,
                 positions=None, kv_segment_ids=None, kv_positions=None, loss_mask=None) -> jax.Array:
        loss = _compute_loss(self.config, (indexer_logits,), q, compressed_kv, **_arrays(locals()))
        self.sow(nnx.Intermediate, SOW_NAME, loss)
        return loss

    __call__.__doc__ = _CALL_DOC

    def fused(self, index_q: jax.Array, index_k: jax.Array, index_weights: jax.Array, q: jax.Array,
              compressed_kv: jax.Array, **arrays) -> jax.Array:
        """The same loss with the student given by the indexer's inputs (`csa_pallas.fused_indexer_distill_loss`,
        SPEC §8): index_q [B, S, H_I, d_I], index_k [B, N, d_I], index_weights [B, S, H_I] get the gradients;
        `arrays`: the keyword arrays of `__call__`. Sown like `__call__`."""
        loss = _compute_loss(self.config, (index_q, index_k, index_weights), q, compressed_kv,
                             **_arrays(dict(_NO_ARRAYS, **arrays)))
        self.sow(nnx.Intermediate, SOW_NAME, loss)
        return loss


class CSAIndexerLossLinen(nn.Module):
    """flax.linen module computing the loss and sowing it into the "intermediates" collection (no parameters).

    Fields: `config` (None, an IndexerLossConfig, or a MaxText config object / dict, see
    `IndexerLossConfig.from_maxtext_config`) and the fields of `IndexerLossConfig`. A field left at None takes its
    value from `config`, else the IndexerLossConfig default; a non-None field overrides `config`. (To force a
    field to None against a config, use `from_maxtext_config(cfg, head_chunk=None, ...)`.)
    """

    config: Any = None
    compress_ratio: Optional[int] = None
    window_size: Optional[int] = None
    target: Optional[str] = None
    reduction: Optional[str] = None
    scale: Optional[float] = None
    head_chunk: Optional[int] = None
    softmax_scale: Optional[float] = None
    sparse_training: Optional[bool] = None
    implementation: Optional[str] = None
    mesh: Optional[Mesh] = None
    batch_axes: Optional[tuple] = None
    head_axis: Optional[str] = None
    seq_axis: Optional[str] = None
    padding_segment_id: Optional[int] = None
    kernel_config: Any = None

    def __post_init__(self):
        self.loss_config  # validate at construction, so a bad field raises here, naming it
        super().__post_init__()

    @property
    def loss_config(self) -> IndexerLossConfig:
        explicit = {f.name: getattr(self, f.name) for f in dataclasses.fields(IndexerLossConfig)}
        return _resolve_config(self.config, {k: v for k, v in explicit.items() if v is not None})

    @classmethod
    def from_maxtext_config(cls, cfg, **overrides) -> "CSAIndexerLossLinen":
        """`CSAIndexerLossLinen` from a MaxText config; see `IndexerLossConfig.from_maxtext_config`."""
        return cls(config=IndexerLossConfig.from_maxtext_config(cfg, **overrides))

    @nn.compact
    def __call__(self, indexer_logits: jax.Array, q: jax.Array, compressed_kv: jax.Array, *, topk_indices=None,
                 window_kv=None, sinks=None, noncompressed_lse=None, full_lse=None, segment_ids=None,
                 positions=None, kv_segment_ids=None, kv_positions=None, loss_mask=None) -> jax.Array:
        loss = _compute_loss(self.loss_config, (indexer_logits,), q, compressed_kv, **_arrays(locals()))
        self.sow("intermediates", SOW_NAME, loss)
        return loss

    __call__.__doc__ = _CALL_DOC

    def fused(self, index_q: jax.Array, index_k: jax.Array, index_weights: jax.Array, q: jax.Array,
              compressed_kv: jax.Array, **arrays) -> jax.Array:
        """`CSAIndexerLoss.fused` for linen (call it from a parent's compact method, or `apply(..., method=)`)."""
        loss = _compute_loss(self.loss_config, (index_q, index_k, index_weights), q, compressed_kv,
                             **_arrays(dict(_NO_ARRAYS, **arrays)))
        self.sow("intermediates", SOW_NAME, loss)
        return loss


def _natural_key(key) -> tuple:
    """Sort key that orders "layers_10" after "layers_9" (digit runs compare as numbers)."""
    parts = re.split(r"(\d+)", str(key))
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts if p)


def collect_indexer_losses(intermediates: Any, name: str = SOW_NAME) -> jax.Array:
    """Every value sown under `name`, in layer order, concatenated: f32 [L] (or [L, B, S] for reduction="none").

    Accepts what `nnx.capture(..., nnx.Intermediate)` returns (an nnx.State), the "intermediates" collection of a
    Linen `apply(..., mutable=["intermediates"])`, or any nested Mapping of them. Keys are ordered naturally
    (layer 10 after layer 9). A value sown inside `nn.scan` / `nnx.scan` arrives stacked over the scanned layers
    ([L_scan] or [L_scan, B, S]) and contributes all of them. MaxText's loss is the mean of this over layers;
    returns a zero-length array when nothing was sown.
    """
    if hasattr(intermediates, "to_pure_dict"):
        intermediates = intermediates.to_pure_dict()
    found = []

    def leaves(value):
        if isinstance(value, nnx.Variable):
            value = value.get_value()
        if isinstance(value, (tuple, list)):
            for v in value:
                yield from leaves(v)
        else:
            yield jnp.asarray(value)

    def walk(tree):
        if isinstance(tree, Mapping):
            for key in sorted(tree, key=_natural_key):  # a deterministic, layer-numbered order
                # A submodule may itself be called "indexer_loss" (the layer's loss module is): recurse into
                # mappings, collect only the sown leaves.
                if key == name and not isinstance(tree[key], Mapping):
                    found.extend(leaves(tree[key]))
                else:
                    walk(tree[key])

    walk(intermediates)
    if not found:
        return jnp.zeros((0,), jnp.float32)
    # One call sows a scalar (or a [B, S] array for reduction="none"); scan stacks them over a leading layer axis.
    call_ndim = 0 if min(x.ndim for x in found) <= 1 else 2
    return jnp.concatenate([x.reshape((-1,) + x.shape[x.ndim - call_ndim:]) if x.ndim > call_ndim else x[None]
                            for x in found], axis=0)
