"""The README's main job: a small DeepSeek-V4-shaped loss + gradient through the Pallas kernels, checked against the
pure-JAX reference, then a v5p memory table compiled ahead of time on this host.

    python -m benchmarks.demo            # ~1-2 minutes on a 2-core CPU

Every number printed says how it was obtained: CPU interpret-mode wall clock (not a TPU timing), or HBM bytes from
the v5p compiler's memory_analysis() (exact for the compiled program, no TPU needed).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import csa_pallas
from csa_pallas import aot

MiB = 1 << 20


def tiny_inputs(seed=0, batch=2, seq=256, heads=4, head_dim=32, ratio=4):
    """deepseek4-tiny widths (H=4, D=32, m=4), two packed documents per row."""
    rng = np.random.default_rng(seed)
    n = seq // ratio
    seg = np.zeros((batch, seq), np.int32)
    pos = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
    cut = seq // 3
    seg[:, cut:] = 1
    pos[:, cut:] -= cut
    return dict(
        logits=jnp.asarray(rng.standard_normal((batch, seq, n)), jnp.float32),
        q=jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), jnp.bfloat16),
        compressed_kv=jnp.asarray(rng.standard_normal((batch, n, head_dim)), jnp.bfloat16),
        window_kv=jnp.asarray(rng.standard_normal((batch, seq, head_dim)), jnp.bfloat16),
        sinks=jnp.asarray(rng.standard_normal(heads), jnp.float32),
        segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos),
    )


def loss_fn(target, implementation, window=32):
    def f(logits, q, compressed_kv, window_kv, sinks, segment_ids, positions):
        kwargs = dict(window_kv=window_kv, sinks=sinks) if target == "joint" else {}
        return csa_pallas.indexer_distill_loss(logits, q, compressed_kv, segment_ids=segment_ids,
                                               positions=positions, window_size=window, target=target,
                                               implementation=implementation, **kwargs)
    return f


def check_against_reference():
    x = tiny_inputs()
    args = (x["logits"], x["q"], x["compressed_kv"], x["window_kv"], x["sinks"], x["segment_ids"], x["positions"])
    print("== loss + gradient, deepseek4-tiny shape B=2 S=256 H=4 D=32 m=4 W=32, bf16 q/kv, 2 packed documents ==")
    print(f"{'target':<9} {'impl':<7} {'loss':>12} {'|dI|max':>10} {'max|dI-dI_ref|':>15} {'CPU wall ms':>12}")
    worst = 0.0
    for target in ("per_head", "joint"):
        results = {}
        for impl in ("xla", "pallas"):
            f = jax.jit(jax.value_and_grad(loss_fn(target, impl)))
            jax.block_until_ready(f(*args))  # compile
            t0 = time.perf_counter()
            loss, grad = jax.block_until_ready(f(*args))
            results[impl] = (float(loss), np.asarray(grad), 1e3 * (time.perf_counter() - t0))
        ref_grad = results["xla"][1]
        for impl, (loss, grad, ms) in results.items():
            err = float(np.max(np.abs(grad - ref_grad)))
            worst = max(worst, err / max(np.abs(ref_grad).max(), 1e-30))
            print(f"{target:<9} {impl:<7} {loss:12.8f} {np.abs(grad).max():10.3e} {err:15.3e} {ms:12.1f}")
        rel = abs(results["pallas"][0] - results["xla"][0]) / max(abs(results["xla"][0]), 1e-30)
        assert rel < 1e-5, f"{target}: Pallas loss differs from the reference by {rel:.2e} (relative)"
    assert worst < 1e-5, f"gradient differs from the reference by {worst:.2e} (relative to max)"
    print("(CPU wall clock of the Pallas kernels in interpret mode and of the XLA reference on this host; "
          "not TPU timings.)  Pallas == reference within 1e-5: OK\n")


def memory_table(seqs, topology):
    print("== v5p HBM of forward+backward, DeepSeek-V4-Flash shape (B=1 H=64 D=512 m=4 W=128 bf16) ==")
    print("(xla baseline = MaxText-style per-head softmax with a lax.scan over head chunks, benchmarks/xla_baseline.py)")
    print(f"(AOT compile for {topology} on a '{jax.default_backend()}' host; bytes from compiled.memory_analysis())")
    print(f"{'impl':<22} {'S':>7} {'status':<8} {'temp MiB':>10} {'args MiB':>10} {'out MiB':>9} {'compile s':>10}")
    from benchmarks import xla_baseline
    for seq in seqs:
        n = seq // 4
        structs = (aot.struct((1, seq, n), jnp.float32), aot.struct((1, seq, 64, 512), jnp.bfloat16),
                   aot.struct((1, n, 512), jnp.bfloat16), aot.struct((1, seq, 512), jnp.bfloat16),
                   aot.struct((64,), jnp.float32))
        rows = []
        for target in ("per_head", "joint"):
            def program(logits, q, kv, w, sinks, target=target):
                kw = dict(window_kv=w, sinks=sinks) if target == "joint" else {}
                return jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
                    x, q, kv, target=target, window_size=128, implementation="pallas", **kw))(logits)
            rows.append((f"pallas {target}", program))
        for chunk in (1, 8):
            def baseline(logits, q, kv, w, sinks, chunk=chunk):
                return jax.value_and_grad(lambda x: xla_baseline.dense_loss(x, q, kv, head_chunk=chunk))(logits)
            rows.append((f"xla baseline hc={chunk}", baseline))
        for name, program in rows:
            t0 = time.perf_counter()
            try:
                report = aot.compile_memory(program, *structs, topology=topology)
                status = "ok"
                cols = f"{report.temp_bytes / MiB:10.1f} {report.argument_bytes / MiB:10.1f} " \
                       f"{report.output_bytes / MiB:9.1f}"
            except Exception as e:  # report the compiler's verdict (e.g. HBM overflow) instead of dying
                status, cols = "FAIL", f"{str(e).splitlines()[0][:60]}"
            print(f"{name:<22} {seq:>7} {status:<8} {cols} {time.perf_counter() - t0:10.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="*", default=[4096], help="sequence lengths for the v5p table")
    parser.add_argument("--topology", default=aot.DEFAULT_TOPOLOGY)
    args = parser.parse_args()
    check_against_reference()
    if aot.libtpu_available():
        memory_table(args.seq, args.topology)
    else:
        print("libtpu not installed: skipping the v5p AOT table (pip install 'jax[tpu]==0.10.2')")


if __name__ == "__main__":
    main()
