"""A scanned, rematted two-layer Flax model whose layers each take the CSA indexer loss, compiled for a TPU v5p
slice from a CPU host the way MaxText's `train_compile` does it: a plain `jax.jit(step).lower(<structs on the
topology's devices>).compile()` on MaxText's mesh (data, fsdp, tensor) with MaxText's logical axis rules active,
and no csa_pallas mesh argument or context. The loss module (`CSAIndexerLossLinen`, no `mesh=`) reads the layout
from the rules (`csa_pallas.placement`) and runs its Pallas kernels under shard_map, so the TPU program has Mosaic
kernels and XLA partitions the rest of the model.

    python -m examples.sharded_aot            # v5p:2x2x2, B=8 S=2048 H=16 D=128 (prints memory per device)
    python -m examples.sharded_aot --remat-policy offload_proj   # the projections offloaded to host memory

Each layer (`Layer`): q = x W_q [B, S, H, D]; per-token keys kv = x W_kv [B, S, D], pooled over m = 4 tokens into
compressed_kv [B, N, D]; the student logits I = (x W_iq)(compressed_kv W_ik)^T [B, S, N]; the joint-target loss
with window keys kv and per-head sinks, sown by the module; the layer's output x + (mean_h q) W_o. q and kv carry
MaxText's checkpoint names ("query_proj", "key_proj"), which its remat policies save or offload by name
(`REMAT_POLICIES`), as they can the loss's residuals (`csa_pallas.RESIDUAL_NAME`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import csa_pallas  # noqa: E402
from csa_pallas import aot  # noqa: E402
from csa_pallas.nn import CSAIndexerLossLinen, collect_indexer_losses  # noqa: E402

# MaxText's activation rules (a subset): batch over data and fsdp, heads over tensor, the sequence unsharded.
LOGICAL_AXIS_RULES = [("activation_batch", ("data", "fsdp")), ("activation_heads", ("tensor",)),
                      ("activation_length", ("context",)), ("activation_embed", None)]
MESH_AXES = {"data": 2, "fsdp": 2, "tensor": 2}
# The layer's remat policy, by MaxText's names: "full" saves nothing (the layer, its loss kernels included,
# recomputed in the backward pass; MaxText's remat_policy "full"); "save_proj" keeps the named projections and the
# loss's residuals (`csa_pallas.RESIDUAL_NAME`) in HBM, so the backward launches no loss kernel of the forward
# again; "offload_proj" moves the same to pinned host memory between the passes (MaxText's remat_policy "custom"
# with those names set to "offload").
PROJECTIONS = ("query_proj", "key_proj", csa_pallas.RESIDUAL_NAME)
REMAT_POLICIES = {
    "full": lambda: None,
    "save_proj": lambda: jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),
    "offload_proj": lambda: jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(PROJECTIONS), offload_src="device",
        offload_dst="pinned_host"),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int = 8
    seq: int = 2048
    embed: int = 256
    heads: int = 16
    head_dim: int = 128
    indexer_dim: int = 64
    compress_ratio: int = 4
    window: int = 128
    layers: int = 2


class Layer(nn.Module):
    shape: Shape

    @nn.compact
    def __call__(self, x, _):
        s = self.shape
        b, t, _ = x.shape
        n = t // s.compress_ratio
        q = nn.DenseGeneral((s.heads, s.head_dim), use_bias=False, name="w_q")(x)  # [B, S, H, D]
        q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", None))
        q = checkpoint_name(q, "query_proj")
        kv = checkpoint_name(nn.Dense(s.head_dim, use_bias=False, name="w_kv")(x), "key_proj")  # [B, S, D]
        compressed = kv.reshape(b, n, s.compress_ratio, s.head_dim).mean(axis=2)  # [B, N, D]
        index_q = nn.Dense(s.indexer_dim, use_bias=False, name="w_iq")(x)
        index_k = nn.Dense(s.indexer_dim, use_bias=False, name="w_ik")(compressed)
        logits = jnp.einsum("bsd,bnd->bsn", index_q, index_k).astype(jnp.float32)  # [B, S, N]
        sinks = self.param("sinks", nn.initializers.zeros, (s.heads,), jnp.float32)
        detach = jax.lax.stop_gradient  # the teacher side is detached (SPEC §5): the loss trains the indexer only
        CSAIndexerLossLinen(compress_ratio=s.compress_ratio, window_size=s.window, target="joint",
                            name="indexer_loss")(logits, detach(q), detach(compressed), window_kv=detach(kv),
                                                 sinks=detach(sinks))
        out = nn.Dense(x.shape[-1], use_bias=False, name="w_o")(q.mean(axis=2).astype(x.dtype))
        return (x + out).astype(x.dtype), None


class Model(nn.Module):
    shape: Shape
    remat_policy: str = "full"  # a key of REMAT_POLICIES

    @nn.compact
    def __call__(self, x):
        layer = nn.remat(Layer, policy=REMAT_POLICIES[self.remat_policy]())
        stack = nn.scan(layer, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                        length=self.shape.layers)
        x, _ = stack(self.shape, name="layers")(x, None)
        return x


def train_step(model: Model, params, x):
    """(loss, grads): the mean over layers of the sown indexer losses plus a stand-in LM loss mean(y^2)."""
    def loss_fn(params):
        with nn.logical_axis_rules(LOGICAL_AXIS_RULES):
            y, state = model.apply({"params": params}, x, mutable=["intermediates"])
        return jnp.mean(collect_indexer_losses(state["intermediates"])) + jnp.mean(jnp.square(y.astype(jnp.float32)))
    return jax.value_and_grad(loss_fn)(params)


def compile_for_slice(shape: Shape = Shape(), topology: str = "v5p:2x2x2", dtype=jnp.bfloat16,
                      remat_policy: str = "full"):
    """AOT-compiles `train_step` for `topology` by the plain jit path; returns the compiled program."""
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy: expected one of {sorted(REMAT_POLICIES)}, got {remat_policy!r}")
    mesh = aot.tpu_mesh(topology, MESH_AXES)
    model = Model(shape, remat_policy)
    x_struct = jax.ShapeDtypeStruct((shape.batch, shape.seq, shape.embed), dtype)
    params = jax.eval_shape(lambda x: model.init(jax.random.key(0), x)["params"], x_struct)
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated), params)
    x = jax.ShapeDtypeStruct(x_struct.shape, dtype, sharding=NamedSharding(mesh, P(("data", "fsdp"), None, None)))
    return jax.jit(lambda p, x: train_step(model, p, x)).lower(params, x).compile()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remat-policy", choices=sorted(REMAT_POLICIES), default="full")
    args = parser.parse_args(argv)
    compiled = compile_for_slice(remat_policy=args.remat_policy)
    report = aot.memory_report(compiled)
    mosaic = compiled.as_text().count("tpu_custom_call")
    print(f"compiled for v5p:2x2x2 (mesh {MESH_AXES}, remat policy {args.remat_policy}) by plain "
          f"jax.jit(...).lower(...).compile(): {mosaic} Mosaic kernel calls; per device: temp "
          f"{report.temp_bytes / 2**20:.1f} MiB, arguments {report.argument_bytes / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
