"""Sparse (top-k) mode at the DeepSeek-V4-Flash shape: Pallas vs the XLA gather baseline, compiled for v5p.

    python -m benchmarks.sparse_memory                    # S = 4096, 32768, 131072: compile status and HBM
    python -m benchmarks.sparse_memory --seq 4096 --estimate   # + tpu_estimate static run-time estimates

Memory comes from `compiled.memory_analysis()` of an AOT compile for v5p on this host (exact for the compiled
program, no TPU needed). Estimates come from ../shared/tools/tpu_estimate.py (static bundle counts at an assumed
1.75 GHz; not measurements). On a TPU backend the script also times forward+backward (median of 10 after warm-up).
Baseline: `xla_baseline.sparse_loss`, the Primus eager approach (gathers [B, 512, K, D] blocks per query chunk).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import csa_pallas
from csa_pallas import aot
from csa_pallas.kernels import runtime
from benchmarks import xla_baseline

MiB = 1 << 20
B, H, D, M, W, K = 1, 64, 512, 4, 128, 512


def structs(seq):
    n = seq // M
    return (aot.struct((B, seq, K), jnp.float32), aot.struct((B, seq, H, D), jnp.bfloat16),
            aot.struct((B, n, D), jnp.bfloat16), aot.struct((B, seq, K), jnp.int32),
            aot.struct((B, seq, D), jnp.bfloat16), aot.struct((H,), jnp.float32))


def programs():
    """name -> fn(logits, q, kv, topk, window_kv, sinks) returning (loss, dI)."""
    def pallas(target):
        def fn(logits, q, kv, topk, window_kv, sinks):
            kw = dict(window_kv=window_kv, sinks=sinks) if target == "joint" else {}
            with runtime.compiling_for_tpu() if jax.default_backend() != "tpu" else _nullcontext():
                return jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
                    x, q, kv, topk_indices=topk, target=target, window_size=W, implementation="pallas", **kw))(
                    logits)
        return fn

    def baseline(logits, q, kv, topk, window_kv, sinks):
        return jax.value_and_grad(lambda x: xla_baseline.sparse_loss(x, q, kv, topk))(logits)

    return {"pallas per_head": pallas("per_head"), "pallas joint": pallas("joint"),
            "xla gather baseline (per_head)": baseline}


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def memory_rows(seqs, topology):
    print(f"AOT compile for {topology} on a '{jax.default_backend()}' host; HBM bytes from memory_analysis(); "
          f"forward+backward; B={B} H={H} D={D} m={M} W={W} K={K}, bf16 q/kv")
    print(f"{'program':<32} {'S':>7} {'status':<8} {'temp MiB':>10} {'peak MiB':>10} {'[B,S,K] f32 MiB':>16}")
    for seq in seqs:
        for name, fn in programs().items():
            try:
                r = aot.compile_memory(fn, *structs(seq), topology=topology)
                cols = f"{'ok':<8} {r.temp_bytes / MiB:10.1f} {r.peak_bytes / MiB:10.1f}"
            except Exception as e:  # the compiler's verdict, e.g. HBM overflow
                cols = f"{'FAIL':<8} {str(e).splitlines()[0][:70]}"
            print(f"{name:<32} {seq:>7} {cols} {B * seq * K * 4 / MiB:16.1f}", flush=True)


def estimate_rows(seq, topology, only=None):
    tools = os.environ.get("CSA_PALLAS_TPU_ESTIMATE_DIR",
                           os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tools"))
    sys.path.insert(0, os.path.abspath(tools))
    import tpu_estimate as te
    args = [f"{'f32' if s.dtype == jnp.float32 else 'bf16' if s.dtype == jnp.bfloat16 else 's32'}"
            f"[{','.join(map(str, s.shape))}]" for s in structs(seq)]
    print(f"tpu_estimate.py static estimates (v5p, libtpu profile off; NOT measurements), S={seq}, fwd+bwd")
    for name, fn in programs().items():
        if only and only not in name:
            continue
        rep = te.estimate(fn, *args, topology=topology, libtpu_profile="off", timeout=1800)
        best = rep["summary"].get("best_estimate_us")
        if best is None:  # a loop whose trip count the tool could not determine: print its report instead
            print(f"{name:<32} BEST ESTIMATE undetermined; report:\n{te.format_report(rep)}", flush=True)
        else:
            print(f"{name:<32} BEST ESTIMATE {best:10.1f} us", flush=True)


def timing_rows(seq):
    rng = np.random.default_rng(0)
    n = seq // M
    args = (jnp.asarray(rng.standard_normal((B, seq, K)), jnp.float32),
            jnp.asarray(rng.standard_normal((B, seq, H, D)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((B, n, D)), jnp.bfloat16),
            jnp.asarray(rng.integers(-1, n, (B, seq, K)), jnp.int32),
            jnp.asarray(rng.standard_normal((B, seq, D)), jnp.bfloat16),
            jnp.zeros((H,), jnp.float32))
    print(f"wall clock on {jax.devices()[0].device_kind}: forward+backward, median of 10 after warm-up")
    for name, fn in programs().items():
        f = jax.jit(fn)
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(1e3 * (time.perf_counter() - t0))
        print(f"{name:<32} {statistics.median(times):10.3f} ms (min {min(times):.3f}, max {max(times):.3f})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="*", default=[4096, 32768, 131072])
    parser.add_argument("--topology", default=aot.DEFAULT_TOPOLOGY)
    parser.add_argument("--estimate", action="store_true", help="static run-time estimates at the first --seq")
    parser.add_argument("--only", default=None, help="estimate only the programs whose name contains this")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args(argv)
    if not args.no_memory:
        memory_rows(args.seq, args.topology)
    if args.estimate:
        estimate_rows(args.seq[0], args.topology, args.only)
    if jax.default_backend() == "tpu":
        timing_rows(args.seq[0])


if __name__ == "__main__":
    main()
