"""The README's main job: what csa_pallas is for, in about three minutes on a 2-core CPU with no TPU.

    python -m benchmarks.demo              # correctness, then v5p HBM vs the XLA baseline across S, estimates
    python -m benchmarks.demo --quick      # S = 4096 only (~1 minute)

1. Correctness: the loss and its gradient through the Pallas kernels (interpret mode on this CPU) against the pure-JAX
   reference, at MaxText's deepseek4-tiny widths, dense (both targets) and sparse top-k.
2. Memory: the forward+backward at the DeepSeek-V4-Flash shape (B=1, H=64, D=512, m=4, W=128, bf16 q/kv, f32
   logits) compiled for one TPU v5p chip on this host by the real XLA:TPU / Mosaic compilers; temp HBM from
   `compiled.memory_analysis()` (exact for the compiled program) for csa_pallas and for the MaxText-style XLA
   baseline at each of its head chunks (`benchmarks/xla_baseline.py`), S from 4K to 128K (256K with --seq).
3. Speed: static v5p estimates on record (`benchmarks/recorded/*.json`, from `../shared/tools/tpu_estimate.py`):
   estimates of the compiled bundles, not TPU timings; the commands that reproduce them are in the README.

Outputs under --out (default results/demo/): memory.csv / memory.json (every compiled row), memory.png (temp HBM
against S, log-log).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import harness  # noqa: E402  (sets ALLOW_MULTIPLE_LIBTPU_LOAD before jax loads libtpu)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import csa_pallas  # noqa: E402
from csa_pallas import aot, ops_sparse  # noqa: E402

RECORDED = os.path.join(harness.REPO, "benchmarks", "recorded")
FLASH = harness.FLASH
SEQS = (4096, 8192, 16384, 32768, 65536, 131072)
BASELINE_CHUNKS = (1, 8, 64)
V5P_HBM_MIB = 95 * 1024


# ------------------------------------------------------------------------------------------------ 1. correctness

def tiny_inputs(seed=0, batch=2, seq=256, heads=4, head_dim=32, ratio=4, topk=16):
    """deepseek4-tiny widths (H=4, D=32, m=4), two packed documents per row, K=16 random slots (-1 = empty)."""
    rng = np.random.default_rng(seed)
    n = seq // ratio
    seg = np.zeros((batch, seq), np.int32)
    pos = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
    cut = seq // 3
    seg[:, cut:] = 1
    pos[:, cut:] -= cut
    return dict(
        dense_logits=jnp.asarray(rng.standard_normal((batch, seq, n)), jnp.float32),
        sparse_logits=jnp.asarray(rng.standard_normal((batch, seq, topk)), jnp.float32),
        topk_indices=jnp.asarray(rng.integers(-1, n, size=(batch, seq, topk)), jnp.int32),
        q=jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), jnp.bfloat16),
        compressed_kv=jnp.asarray(rng.standard_normal((batch, n, head_dim)), jnp.bfloat16),
        window_kv=jnp.asarray(rng.standard_normal((batch, seq, head_dim)), jnp.bfloat16),
        sinks=jnp.asarray(rng.standard_normal(heads), jnp.float32),
        segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))


def check_against_reference() -> float:
    """Prints loss and gradient agreement per case; returns the worst relative gradient difference."""
    x = tiny_inputs()
    print("1) Correctness: loss and gradient through the Pallas kernels (interpret mode on this CPU) vs the pure-JAX "
          "reference\n   deepseek4-tiny shape B=2 S=256 H=4 D=32 m=4 W=32, bf16 q/kv, two packed documents per row")
    print(f"   {'case':<24} {'loss (kernels)':>15} {'loss (reference)':>17} {'max|dI-dI_ref|/max|dI_ref|':>27}")
    worst = 0.0
    for case, target, sparse in (("dense, per_head", "per_head", False), ("dense, joint", "joint", False),
                                 ("sparse K=16, joint", "joint", True)):
        logits = x["sparse_logits"] if sparse else x["dense_logits"]
        extra = dict(window_kv=x["window_kv"], sinks=x["sinks"]) if target == "joint" else {}
        if sparse:
            extra["topk_indices"] = x["topk_indices"]

        def run(implementation, extra=extra, target=target):
            loss = lambda y: csa_pallas.indexer_distill_loss(
                y, x["q"], x["compressed_kv"], segment_ids=x["segment_ids"], positions=x["positions"],
                window_size=32, target=target, implementation=implementation, **extra)
            return jax.jit(jax.value_and_grad(loss))(logits)
        (loss_k, grad_k), (loss_r, grad_r) = run("pallas"), run("xla")
        rel = float(jnp.max(jnp.abs(grad_k - grad_r)) / jnp.max(jnp.abs(grad_r)))
        worst = max(worst, rel, abs(float(loss_k) - float(loss_r)) / abs(float(loss_r)))
        print(f"   {case:<24} {float(loss_k):15.8f} {float(loss_r):17.8f} {rel:27.2e}")
    verdict = "OK" if worst < 1e-5 else "MISMATCH"
    print(f"   kernels == reference within 1e-5: {verdict}\n")
    return worst


# ------------------------------------------------------------------------------------------------ 2. memory

def flash_structs(seq: int):
    return harness.input_structs(FLASH, ["logits", "q", "compressed_kv", "window_kv", "sinks"], seq,
                                 FLASH.blocks(seq))


def programs():
    """(name, kind, head chunk, fn(logits, q, kv, window_kv, sinks) -> (loss, dI))."""
    from benchmarks import xla_baseline
    out = []
    for target in ("per_head", "joint"):
        def pallas(logits, q, kv, w, sinks, target=target):
            kw = dict(window_kv=w, sinks=sinks) if target == "joint" else {}
            return jax.value_and_grad(lambda y: csa_pallas.indexer_distill_loss(
                y, q, kv, target=target, window_size=FLASH.window, implementation="pallas", **kw))(logits)
        out.append((f"csa_pallas {target}", "pallas", None, pallas))
    for chunk in BASELINE_CHUNKS:
        def baseline(logits, q, kv, w, sinks, chunk=chunk):
            return jax.value_and_grad(lambda y: xla_baseline.dense_loss(y, q, kv, head_chunk=chunk))(logits)
        out.append((f"XLA baseline head chunk {chunk}", "xla", chunk, baseline))
    return out


def compile_rows(seqs, topology: str) -> list:
    rows = []
    for seq in seqs:
        for name, kind, chunk, fn in programs():
            row = harness.Row(bench="demo", shape=FLASH.name, program=name, mode="dense", impl=kind,
                              head_chunk=chunk, seq=seq, heads=FLASH.heads, batch=FLASH.batch, ids="default",
                              pass_="fwd+bwd", measure="aot", how=f"aot {topology} memory_analysis")
            rows.append(dataclasses.asdict(harness.compile_row(row, fn, flash_structs(seq), topology)))
    return rows


def best_baseline(rows, seq):
    fits = [r for r in rows if r["seq"] == seq and r["impl"] == "xla" and r["status"] == "ok"]
    return min(fits, key=lambda r: r["temp_mib"]) if fits else None


def print_memory(rows, seqs, topology):
    shape = f"B={FLASH.batch} H={FLASH.heads} D={FLASH.head_dim} m={FLASH.ratio} W={FLASH.window}"
    print(f"2) Memory: forward+backward at the DeepSeek-V4-Flash shape ({shape}, one document), compiled for one "
          f"v5p chip ({topology}) on this host;\n   temp HBM in MiB from compiled.memory_analysis() (exact for the "
          f"compiled program). XLA baseline: MaxText-style, best of head chunks {BASELINE_CHUNKS}.")
    print(f"   {'S':>8} {'csa_pallas per_head':>20} {'csa_pallas joint':>17} {'XLA baseline best (chunk)':>27} "
          f"{'baseline / csa_pallas':>22}")
    get = lambda seq, name: next(r for r in rows if r["seq"] == seq and r["program"] == name)
    for seq in seqs:
        per_head, joint = get(seq, "csa_pallas per_head"), get(seq, "csa_pallas joint")
        fmt = lambda r: f"{r['temp_mib']:,.1f}" if r["status"] == "ok" else r["status"]
        best = best_baseline(rows, seq)
        base = f"{best['temp_mib']:,.0f} ({best['head_chunk']})" if best else "HBM overflow (all)"
        ratio = f"{best['temp_mib'] / per_head['temp_mib']:,.0f}x" if best and per_head["status"] == "ok" else "-"
        print(f"   {seq:>8,} {fmt(per_head):>20} {fmt(joint):>17} {base:>27} {ratio:>22}")
    print("   (one [S, N] f32 array is S^2/4 * 4 bytes: 16 MiB at 4K, 16 GiB at 128K; csa_pallas keeps none)\n")


def plot_memory(rows, seqs, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("csa_pallas per_head", "C0", "-"), ("csa_pallas joint", "C2", "-")]
    for name, color, style in series:
        pts = [(r["seq"], r["temp_mib"]) for r in rows if r["program"] == name and r["status"] == "ok"]
        ax.plot(*zip(*pts), style, marker="o", color=color, label=name)
    best = [(s, b["temp_mib"]) for s in seqs if (b := best_baseline(rows, s))]
    if best:
        ax.plot(*zip(*best), "--", marker="s", color="C3", label="XLA baseline, best head chunk")
    ax.axhline(V5P_HBM_MIB, color="gray", lw=0.8, ls=":", label="v5p HBM (95 GB)")
    ax.set(xscale="log", yscale="log", xlabel="sequence length S", ylabel="temp HBM, MiB (v5p compile)",
           title="Indexer distillation loss, fwd+bwd, DeepSeek-V4-Flash shape, one v5p chip")
    ax.set_xticks(list(seqs), [f"{s // 1024}K" for s in seqs])
    ax.legend(fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ 3. estimates

def print_recorded_estimates() -> None:
    dense = [r for r in harness.read_rows(os.path.join(RECORDED, "dense.json")) if r.pass_ == "fwd+bwd"]
    sparse = [r for r in harness.read_rows(os.path.join(RECORDED, "sparse.json")) if r.width == FLASH.topk
              and r.heads == FLASH.heads]
    print("3) Speed: static v5p estimates on record (tpu_estimate BEST ESTIMATE of the compiled bundles; estimates, "
          "not TPU timings; see the README for the commands)")
    ours = {r.program: r for r in dense if r.impl != "xla" and r.ids == "default" and "full_lse" not in r.program}
    base = min((r for r in dense if "xla baseline" in r.program), key=lambda r: r.est_us)
    for r in list(ours.values()) + [base]:
        name = r.program.replace("fwd+bwd ", "") + (" (its best)" if r is base else "")
        print(f"   dense mode, S={r.seq:,}, fwd+bwd: {name:<44} {r.est_us:>9,.1f} us")
    per_head = next(r for r in ours.values() if r.program.endswith("per_head"))
    print(f"   -> {base.est_us / per_head.est_us:.2f}x the XLA baseline's best head chunk")
    print(f"   sparse top-K=512, fwd+bwd per_head, uniform selection (ms): {'S':>8} {'csa_pallas':>11} "
          f"{'dense mode':>11} {'XLA gather baseline':>20}")
    for seq in sorted({r.seq for r in sparse}):
        pick = lambda prog, pat: next((r for r in sparse if r.seq == seq and r.program == prog
                                       and r.pattern == pat), None)
        gather = FLASH.blocks(seq) * FLASH.heads >= ops_sparse.GATHER_HEAD_BLOCKS_PER_SLOT * FLASH.topk
        path = "gather" if gather else "visit"  # the rule of ops_sparse.choose_path
        mine = pick(path, "any" if path == "gather" else "uniform")
        dense_row, xla = pick("dense mode", "all blocks"), pick("xla gather baseline", "any")
        cell = lambda r, key: f"{getattr(r, key) / 1e3:,.2f}" if r and getattr(r, key) is not None else "-"
        print(f"   {'':<58} {seq:>8,} {cell(mine, 'best_us'):>11} {cell(dense_row, 'best_us'):>11} "
              f"{cell(xla, 'est_us'):>20}")
    print()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=list(SEQS), help="sequence lengths for the v5p table")
    parser.add_argument("--quick", action="store_true", help="S = 4096 only")
    parser.add_argument("--topology", default=aot.DEFAULT_TOPOLOGY)
    parser.add_argument("--out", default=os.path.join(harness.REPO, "results", "demo"))
    args = parser.parse_args(argv)
    seqs = [4096] if args.quick else args.seq
    worst = check_against_reference()
    if not aot.libtpu_available():
        print("libtpu is not installed: no v5p compile (pip install 'jax[tpu]==0.10.2', the bench extra)")
        return 0 if worst < 1e-5 else 1
    rows = compile_rows(seqs, args.topology)
    print_memory(rows, seqs, args.topology)
    harness.write_rows(rows, args.out, "memory", dict(topology=args.topology))
    plot_memory(rows, seqs, os.path.join(args.out, "memory.png"))
    print_recorded_estimates()
    print(f"Every compiled row: {os.path.join(args.out, 'memory.csv')} (.json); plot: "
          f"{os.path.join(args.out, 'memory.png')}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
