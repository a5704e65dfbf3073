"""Train only the lightning indexer of the example DeepSeek-V4 CSA layer, both stages, on synthetic tokens.

Everything except the indexer is frozen at its random initialisation (as in DeepSeek's warm-up, where only the
indexer learns); the only training signal is the layer's sown `indexer_loss` (KL of the indexer against the
attention's own block distribution, SPEC §3-§4), collected with `nnx.capture` the way a model collects every
layer's loss. Stage "dense" (warm-up): attention and loss over all visible blocks. Stage "sparse": the layer
attends to the indexer's top-K blocks and the loss covers those K slots. By default each stage trains the same
fresh indexer (so each stage's effect shows on its own); --sparse-from-warmup continues the sparse stage from the
warmed-up indexer, DeepSeek's order. The frozen layer is random, so its block distribution is arbitrary but
fixed: the run shows the indexer learning to imitate the attention it serves, not finding meaningful blocks.

Reported on a fixed held-out batch at every evaluation:
  * KL: the stage's own objective (dense: over all visible blocks; sparse: over the indexer's K slots).
  * recall@K: |teacher top-K ∩ indexer top-K| / K over the rows with more than K visible blocks, where the
    teacher is the layer's dense joint distribution P over every visible block (rows with <= K visible blocks
    select them all and are left out, they would count as trivially perfect).

    python examples/train_indexer.py                       # both stages, plot under results/
    python examples/train_indexer.py --sparse-from-warmup     # DeepSeek's order: warm-up, then sparse
    python examples/train_indexer.py --stage sparse --steps 200 --implementation xla

Runs on CPU (JAX_PLATFORMS defaults to cpu here); the default run takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import csa_pallas  # noqa: E402
from csa_pallas.nn import collect_indexer_losses  # noqa: E402
from examples.deepseek_v4_csa import DeepSeekV4CSAAttention, DeepSeekV4CSAConfig, numpy_normal  # noqa: E402

# What the optimiser may touch: the indexer's parameters, nothing else.
INDEXER = nnx.All(nnx.Param, nnx.PathContains("indexer"))


class TinyCSAModel(nnx.Module):
    """Token embedding (frozen) + one CSA attention layer: tokens int32 [B, S] -> f32 [B, S, emb_dim]."""

    def __init__(self, cfg: DeepSeekV4CSAConfig, vocab_size: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, cfg.emb_dim, embedding_init=numpy_normal(1.0), rngs=rngs)
        self.attn = DeepSeekV4CSAAttention(cfg, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, sparse: bool) -> jax.Array:
        return self.attn(self.embed(tokens), sparse=sparse)


def synthetic_tokens(rng: np.random.Generator, batch: int, seq_len: int, vocab_size: int) -> np.ndarray:
    """int32 [batch, seq_len]: Zipf-like unigram tokens with copied spans, so that content recurs at long range."""
    ranks = np.arange(1, vocab_size + 1)
    probs = ranks ** -1.1 / np.sum(ranks ** -1.1)
    tokens = rng.choice(vocab_size, size=(batch, seq_len), p=probs)
    for row in tokens:  # a few copies of earlier spans (what a sparse long-range attention is for)
        for _ in range(seq_len // 64):
            length = int(rng.integers(8, 24))
            src = int(rng.integers(0, seq_len - 2 * length))
            dst = int(rng.integers(src + length, seq_len - length + 1))
            row[dst:dst + length] = row[src:src + length]
    return tokens.astype(np.int32)


def _train_step(model: TinyCSAModel, optimizer: nnx.Optimizer, tokens: jax.Array, sparse: bool):
    """One Adam step on the indexer parameters; tokens int32 [B, S]. Returns the loss f32 [] before the update."""
    def loss_fn(model):
        _, inter = nnx.capture(lambda m, t: m(t, sparse=sparse), nnx.Intermediate)(model, tokens)
        return jnp.mean(collect_indexer_losses(inter))  # mean over layers, as MaxText's train loop does

    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, INDEXER))(model)
    optimizer.update(model, grads)
    return loss


train_step = nnx.jit(_train_step, static_argnames="sparse")


def _evaluate(model: TinyCSAModel, tokens: jax.Array, sparse: bool):
    """(KL f32 [], recall@K f32 []) on tokens int32 [B, S]; KL is the stage's loss divided by its scale."""
    cfg = model.attn.cfg
    x = model.embed(tokens)
    # Under nnx.capture the sown loss goes to the returned intermediates, not onto the module: a module that
    # changed structure would make every later jitted call retrace.
    (_, aux), _ = nnx.capture(lambda attn: attn.forward(x, sparse=sparse), nnx.Intermediate)(model.attn)
    # The dense joint teacher over every visible block, on the layer's own tensors.
    p = csa_pallas.teacher_distribution(aux.q, aux.compressed_kv, window_kv=aux.window_kv, sinks=aux.sinks,
                                        compress_ratio=cfg.compress_ratio, window_size=cfg.sliding_window_size,
                                        target=cfg.indexer_loss_target, implementation=cfg.implementation)
    k = cfg.indexer_topk
    n = p.shape[-1]
    kk = min(k, n)
    teacher_top = jax.lax.top_k(jnp.where(aux.visible, p, -1.0), kk)[1]
    student_top = jax.lax.top_k(jnp.where(aux.visible, aux.indexer_scores, -jnp.inf), kk)[1]
    hits = jnp.sum(teacher_top[..., :, None] == student_top[..., None, :], axis=(-1, -2))
    rows = jnp.sum(aux.visible, axis=-1) > k
    recall = jnp.sum(jnp.where(rows, hits, 0)) / jnp.maximum(1, jnp.sum(rows) * kk)
    return aux.loss / cfg.indexer_loss_scaling_factor, recall


evaluate = nnx.jit(_evaluate, static_argnames="sparse")


def run(*, stages=("dense", "sparse"), sparse_from_warmup: bool = False, steps: int = 400, batch: int = 8,
        seq_len: int = 256, vocab_size: int = 512, lr: float = 5e-3, eval_every: int = 25, seed: int = 0,
        implementation: Optional[str] = "xla", cfg: Optional[DeepSeekV4CSAConfig] = None, fused_student: bool = False,
        log=print) -> dict:
    """Trains the indexer for `steps` steps per stage; returns {stage: {"step", "kl", "recall"}} (eval history).

    Each stage starts from the same fresh indexer (same seed, same frozen backbone, same batches), so each
    stage's effect shows on its own; `sparse_from_warmup=True` instead continues the sparse stage from the
    warmed-up indexer, DeepSeek's order. Deterministic for a given seed: the model init, the training batches and
    the held-out batch all derive from it.
    """
    cfg = dataclasses.replace(cfg or DeepSeekV4CSAConfig(), implementation=implementation,
                              indexer_fused_student=fused_student)
    if cfg.indexer_loss_scaling_factor <= 0:
        raise ValueError("indexer_loss_scaling_factor: must be > 0 here, it is the indexer's only training signal")
    eval_tokens = jnp.asarray(synthetic_tokens(np.random.default_rng(seed + 10_000), batch, seq_len, vocab_size))
    history = {}
    model = optimizer = None
    for i, stage in enumerate(stages):
        sparse = stage == "sparse"
        chained = sparse and sparse_from_warmup and model is not None
        if not chained:
            model = TinyCSAModel(cfg, vocab_size, rngs=nnx.Rngs(seed))
            optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=INDEXER)
        # Fresh stages replay the same batches; a chained stage gets new ones.
        data_rng = np.random.default_rng([seed, i] if chained else seed)
        hist = {"step": [], "kl": [], "recall": [], "chained": chained}
        history[stage] = hist
        start = time.perf_counter()
        for step in range(steps + 1):
            if step % eval_every == 0 or step == steps:
                kl, recall = jax.device_get(evaluate(model, eval_tokens, sparse=sparse))
                hist["step"].append(step)
                hist["kl"].append(float(kl))
                hist["recall"].append(float(recall))
                log(f"[{stage:6s}] step {step:4d}  KL {float(kl):.5f}  recall@{cfg.indexer_topk} {float(recall):.3f}"
                    f"  ({time.perf_counter() - start:.1f}s)")
            if step < steps:
                tokens = jnp.asarray(synthetic_tokens(data_rng, batch, seq_len, vocab_size))
                train_step(model, optimizer, tokens, sparse=sparse)
    return history


def plot(history: dict, path: str, title: str = "") -> None:
    """Two panels (KL, recall) against the global step, one colour per stage; writes a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_rec) = plt.subplots(1, 2, figsize=(10, 3.8))
    offset = 0
    for stage, hist in history.items():
        offset = offset if hist.get("chained") else 0  # independent stages share the step axis
        steps = np.asarray(hist["step"]) + offset
        over = "the K slots" if stage == "sparse" else "all visible blocks"
        ax_kl.plot(steps, hist["kl"], marker=".", label=f"{stage} (KL over {over})")
        ax_rec.plot(steps, hist["recall"], marker=".", label=stage)
        if offset:
            for ax in (ax_kl, ax_rec):
                ax.axvline(offset, color="grey", lw=0.8, ls="--")
        offset = steps[-1]
    ax_kl.set_yscale("log")
    ax_kl.set_xlabel("step")
    ax_kl.set_ylabel("KL(teacher ‖ indexer)")
    ax_kl.legend(fontsize=8)
    ax_rec.set_xlabel("step")
    ax_rec.set_ylabel("recall of teacher top-K by indexer top-K")
    ax_rec.set_ylim(0, 1)
    ax_rec.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=("both", "dense", "sparse"), default="both",
                        help="both = the dense warm-up and the sparse stage, each from the same fresh indexer")
    parser.add_argument("--sparse-from-warmup", action="store_true",
                        help="continue the sparse stage from the warmed-up indexer (DeepSeek's order) instead of "
                             "training it from the same fresh init")
    parser.add_argument("--steps", type=int, default=400, help="training steps per stage")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--implementation", choices=("xla", "pallas", "auto"), default="xla",
                        help="csa_pallas implementation of the loss; auto = pallas where the kernels cover the "
                             "configuration, else xla (sparse mode has no Pallas kernel yet: 'pallas' raises there)")
    parser.add_argument("--fused-student", action="store_true",
                        help="the loss takes the indexer's inputs (csa_pallas.fused_indexer_distill_loss, SPEC §8) "
                             "instead of its scores")
    parser.add_argument("--output", default=os.path.join("results", "train_indexer.png"), help="PNG path")
    args = parser.parse_args(argv)

    stages = ("dense", "sparse") if args.stage == "both" else (args.stage,)
    implementation = None if args.implementation == "auto" else args.implementation
    start = time.perf_counter()
    history = run(stages=stages, sparse_from_warmup=args.sparse_from_warmup, steps=args.steps, batch=args.batch,
                  seq_len=args.seq_len, lr=args.lr, eval_every=args.eval_every, seed=args.seed,
                  implementation=implementation, fused_student=args.fused_student)
    elapsed = time.perf_counter() - start
    print(f"\nsummary (seed {args.seed}, {args.steps} steps/stage, batch {args.batch} x {args.seq_len} tokens, "
          f"{elapsed:.0f}s)")
    for stage, hist in history.items():
        if hist["chained"]:
            print("  (sparse continues from the warmed-up indexer)")
        print(f"  {stage:6s}: KL {hist['kl'][0]:.4f} -> {hist['kl'][-1]:.4f} "
              f"({hist['kl'][0] / max(hist['kl'][-1], 1e-12):.1f}x lower), "
              f"recall@K {hist['recall'][0]:.3f} -> {hist['recall'][-1]:.3f}")
    plot(history, args.output, title=f"indexer training, deepseek4-tiny widths, seed {args.seed}, "
                                     f"implementation={args.implementation}")
    print(f"plot: {args.output}")
    return history


if __name__ == "__main__":
    main()
