"""Static v5p run-time estimates of dense mode at the DeepSeek-V4-Flash shape: the Pallas programs and the XLA
baseline, teacher alone and the whole forward+backward.

    python -m benchmarks.estimates                          # S=4096, every case, ~25 min on 2 cores
    python -m benchmarks.estimates --only "fwd+bwd"         # the loss rows only
    python -m benchmarks.estimates --record                 # also rewrite benchmarks/recorded/dense.json

Every number is `../shared/tools/tpu_estimate.py`'s BEST ESTIMATE of the compiled bundles (libtpu profile off by
default), not a measurement. Default ids (one document, no ids passed): the kernels' causal schedule is computed
from the grid, so the estimator sees the real trip counts. The `packed ids` row passes segment ids: the kernels
then read their schedule from SMEM tables, which the estimator cannot evaluate (it assumes every table-driven
branch is taken and counts every (query tile, kv tile) step), so that row is an upper bound for one document and
the right order of magnitude for packed batches. Rows: `est_us`, `bundle_us`, `no_floor_us` (no HBM floor: the
tool over-counts a scan body's dynamic slices of q), `hbm_bytes` (declared traffic) and `best_us` =
max(estimate, bytes / 2.46 TB/s).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time

from benchmarks import harness  # noqa: E402  (sets ALLOW_MULTIPLE_LIBTPU_LOAD before jax loads libtpu)

import jax  # noqa: E402

SHAPE = harness.FLASH
RECORDED = os.path.join(harness.REPO, "benchmarks", "recorded", "dense.json")
COLUMNS = [("program", "program", "s"), ("seq", "S", "i"), ("status", "status", "s"), ("est_us", "est us", "f1"),
           ("bundle_us", "bundle us", "f1"), ("no_floor_us", "no-floor us", "f1"), ("bw_floor_us", "bw floor", "f1"),
           ("best_us", "best us", "f1"), ("temp_mib", "temp MiB", "f1")]


def cases(seq: int, chunks, index_chunks=()) -> list:
    """(program label, pass, fn, input names); every fn takes the inputs of `harness.input_structs`."""
    import csa_pallas
    from csa_pallas.kernels import selection, student_gather
    from benchmarks import xla_baseline
    m, w = SHAPE.ratio, SHAPE.window

    def loss(names, remat_policy=None, **kw):
        """The loss + gradient; remat_policy: the loss under `jax.checkpoint(policy=...)` (one rematted layer)."""
        def fn(logits, *vals):
            a = dict(zip(names[1:], vals))

            def one(y, a):
                return csa_pallas.indexer_distill_loss(
                    y, a["q"], a["compressed_kv"], compress_ratio=m, window_size=w, implementation="pallas",
                    **{k: v for k, v in a.items() if k not in ("q", "compressed_kv")}, **kw)
            if remat_policy is not None:
                one = jax.checkpoint(one, policy=remat_policy)
            return jax.value_and_grad(one)(logits, a)
        return fn

    out = [
        ("teacher pallas per_head, default config", "teacher",
         lambda q, kv: csa_pallas.teacher_distribution(q, kv, compress_ratio=m, target="per_head",
                                                       implementation="pallas"), ["q", "compressed_kv"]),
        ("teacher pallas per_head, two passes (config cache_scores=False)", "teacher",
         lambda q, kv: csa_pallas.teacher_distribution(q, kv, compress_ratio=m, target="per_head",
                                                       implementation="pallas", config={"cache_scores": False}),
         ["q", "compressed_kv"]),
        ("teacher pallas joint, full_lse (pass 2 only)", "teacher",
         lambda q, kv, full: csa_pallas.teacher_distribution(q, kv, full_lse=full, compress_ratio=m, target="joint",
                                                             implementation="pallas"),
         ["q", "compressed_kv", "full_lse"]),
    ]
    for c in chunks:
        out.append((f"teacher xla baseline, head chunk {c}", "teacher",
                    lambda q, kv, c=c: xla_baseline.teacher_per_head(q, kv, compress_ratio=m, head_chunk=c),
                    ["q", "compressed_kv"]))
    for label, names, kw in [
            ("per_head", ["logits", "q", "compressed_kv"], dict(target="per_head")),
            ("joint (window_kv + sinks)", ["logits", "q", "compressed_kv", "window_kv", "sinks"], dict(target="joint")),
            ("joint, full_lse", ["logits", "q", "compressed_kv", "full_lse"], dict(target="joint")),
            ("per_head, packed ids (segment ids passed: every tile counted)",
             ["logits", "q", "compressed_kv", "segment_ids"], dict(target="per_head"))]:
        out.append((f"fwd+bwd pallas {label}", "fwd+bwd", loss(names, **kw), names))
    joint = ["logits", "q", "compressed_kv", "window_kv", "sinks"]
    # One rematted layer: the loss's kernels relaunched in the backward, or its residuals kept by name.
    remat_policies = [("nothing saveable", jax.checkpoint_policies.nothing_saveable),
                      ("csa_pallas.RESIDUAL_NAME saved",
                       jax.checkpoint_policies.save_only_these_names(csa_pallas.RESIDUAL_NAME))]
    for label, policy in remat_policies:
        out.append((f"fwd+bwd pallas joint (window_kv + sinks), rematted: {label}", "fwd+bwd",
                    loss(joint, remat_policy=policy, target="joint"), joint))
    student_names = ["index_q", "index_k", "index_weights", "q", "compressed_kv"]
    if index_chunks:
        def one_chunk(iq, ik, iw, q, kv, remat_policy=None):
            fused = lambda *x: csa_pallas.fused_indexer_distill_loss(  # noqa: E731
                *x, q, kv, compress_ratio=m, target="per_head", query_chunk=seq)
            if remat_policy is not None:
                fused = jax.checkpoint(fused, policy=remat_policy)
            return jax.value_and_grad(fused, argnums=(0, 1, 2))(iq, ik, iw)
        out.append((FUSED_ONE_CHUNK, "fwd+bwd", one_chunk, student_names))
        for label, policy in remat_policies:
            out.append((f"{FUSED_ONE_CHUNK}, rematted: {label}", "fwd+bwd",
                        lambda *a, policy=policy: one_chunk(*a, remat_policy=policy), student_names))
        out.append((STUDENT_KERNELS, "fwd+bwd", student_kernels_loss, ["index_q", "index_k", "index_weights",
                                                                          "logits"]))
    if index_chunks:
        # the default config's VMEM limit (sized for the shape's N), with the two-kernel route forced
        two_kernels = student_gather.default_config(num_blocks=SHAPE.blocks(seq), heads=SHAPE.index_heads,
                                                    head_dim=SHAPE.index_dim, width=SPARSE_K)
        two_kernels = dataclasses.replace(two_kernels or student_gather.StudentGatherConfig(), fuse_kl=False)
        gather = dataclasses.replace(two_kernels, fuse_kl=True)
        for label, student, exact in ((SPARSE_FUSED, "auto", True), (SPARSE_DISTINCT, "auto", False),
                                      (SPARSE_GATHER, gather, True), (SPARSE_TWO_KERNELS, two_kernels, True)):
            def sparse_fused(iq, ik, iw, q, kv, topk, student=student, exact=exact):
                # topk_indices come as [B, S, N] (every case's inputs share one width); the loss reads K = 512.
                selection._EXACT_COUNTS_BRANCH = exact  # traced here: the switch holds while this traces
                try:
                    return jax.value_and_grad(lambda *x: csa_pallas.fused_indexer_distill_loss(
                        *x, q, kv, topk_indices=topk[:, :, :SPARSE_K], compress_ratio=m, target="per_head",
                        student=student), argnums=(0, 1, 2))(iq, ik, iw)
                finally:
                    selection._EXACT_COUNTS_BRANCH = True
            out.append((label, "fwd+bwd", sparse_fused, student_names + ["topk_indices"]))
    for c in index_chunks:
        def fused_student(iq, ik, iw, q, kv, c=c):
            return jax.value_and_grad(lambda *x: csa_pallas.fused_indexer_distill_loss(
                *x, q, kv, compress_ratio=m, target="per_head", index_head_chunk=c, student="xla"),
                argnums=(0, 1, 2))(iq, ik, iw)
        out.append((f"fwd+bwd fused_indexer_distill_loss per_head, student='xla' (query-chunked, index head chunk "
                    f"{c})", "fwd+bwd", fused_student, student_names))

        for matmul, name in (("native", "xla indexer baseline (MaxText bf16 numerics"),
                             ("exact", "exact xla student (split bf16 passes")):
            def indexer(iq, ik, iw, q, kv, c=c, matmul=matmul):
                return jax.value_and_grad(lambda *x: xla_student_loss(*x, q, kv, c, matmul),
                                          argnums=(0, 1, 2))(iq, ik, iw)
            out.append((f"fwd+bwd {name}, index head chunk {c}) + pallas per_head loss", "fwd+bwd", indexer,
                        student_names))
    for c in chunks:
        def base(logits, q, kv, c=c):
            return jax.value_and_grad(lambda y: xla_baseline.dense_loss(y, q, kv, compress_ratio=m,
                                                                        head_chunk=c))(logits)
        out.append((f"fwd+bwd xla baseline, head chunk {c}", "fwd+bwd", base, ["logits", "q", "compressed_kv"]))
    return out


SPARSE_K = 512
SPARSE_FUSED = (f"fwd+bwd fused_indexer_distill_loss per_head, sparse K={SPARSE_K} (default student: the visit "
                f"student where the sparse teacher takes its visit path, else the gather kernels; default query "
                f"chunks, topk_indices sliced from [B, S, N])")
SPARSE_DISTINCT = (f"fwd+bwd fused_indexer_distill_loss per_head, sparse K={SPARSE_K}, default student, the "
                   f"duplicate-count branches compiled out (what runs when no row repeats an index, as top-k gives)")
SPARSE_GATHER = (f"fwd+bwd fused_indexer_distill_loss per_head, sparse K={SPARSE_K}, the student gather kernels "
                 f"forced (the default StudentGatherConfig)")
SPARSE_TWO_KERNELS = (f"fwd+bwd fused_indexer_distill_loss per_head, sparse K={SPARSE_K}, the student's two-kernel "
                      f"route (the default StudentGatherConfig with fuse_kl=False: scores kernel, the teacher's fused "
                      f"KL, gradient kernel)")
FUSED_ONE_CHUNK = "fwd+bwd fused_indexer_distill_loss per_head (student kernels, one query chunk)"
STUDENT_KERNELS = "fwd+bwd student kernels alone (default ids: causal schedule from the grid)"


def student_kernels_loss(index_q, index_k, index_weights, cotangent):
    """The student kernels' forward and backward alone: sum(I * cotangent) and its three gradients, default ids
    (the skipped tiles from the grid, so the estimator sees the causal trip counts)."""
    import jax.numpy as jnp
    from csa_pallas.kernels import student_scores
    seq, n = index_q.shape[1], index_k.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    block_end = (jnp.arange(n, dtype=jnp.int32) * SHAPE.ratio + SHAPE.ratio - 1)[None]
    run = lambda *x: jnp.sum(student_scores.scores(*x, positions, block_end, causal_ratio=SHAPE.ratio) * cotangent)
    return jax.value_and_grad(run, argnums=(0, 1, 2))(index_q, index_k, index_weights)


def xla_student_loss(index_q, index_k, index_weights, q, kv, index_head_chunk: int, matmul: str):
    """An XLA indexer (einsum -> ReLU -> weighted head sum, head-chunked scan under jax.checkpoint, PR #5116)
    feeding `csa_pallas.indexer_distill_loss` with the whole [B, S, N] scores. matmul "native": issue 17's
    MaxText-style baseline (bf16 at the MXU's default precision, f32 accumulation); "exact": csa_pallas's student
    (`student.scores`)."""
    import csa_pallas
    from csa_pallas import student, validation
    problem = validation.validate(q, kv, compress_ratio=SHAPE.ratio, target="per_head")
    st = student.validate_student(index_q, index_k, index_weights, index_head_chunk=index_head_chunk)
    logits = student.scores(st, problem, matmul=matmul)
    return csa_pallas.indexer_distill_loss(logits, q, kv, compress_ratio=SHAPE.ratio, target="per_head")


def run(seq: int, chunks, only=None, libtpu_profile: str = "off", topology: str = "v5p:2x2x1",
        timeout: float = 3600.0, estimator=None, index_chunks=()) -> list:
    """One estimate row per case (dicts), printed as they finish."""
    rows = []
    for label, which, fn, names in cases(seq, chunks, index_chunks):
        if only and not any(o in label for o in only):
            continue
        t0 = time.time()
        row = harness.Row(bench="estimates", shape=SHAPE.name, program=label, mode="dense", seq=seq,
                          impl="xla" if "xla baseline" in label else "pallas",
                          heads=SHAPE.heads, batch=SHAPE.batch, ids="packed" if "segment_ids" in names else "default",
                          pass_=which, package_fingerprint=harness.package_fingerprint())
        harness.estimate(row, fn, harness.input_structs(SHAPE, names, seq, SHAPE.blocks(seq)), topology=topology,
                         libtpu_profile=libtpu_profile, timeout=timeout, estimator=estimator)
        rows.append(dataclasses.asdict(row))
        print(f"  [{label}: {row.status} {row.est_us} us, {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.estimates", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 8, 64], help="the XLA baseline's head chunks")
    p.add_argument("--index-chunks", type=int, nargs="*", default=[],
                   help="also the fused student (SPEC §8): one query chunk with the student kernels, the "
                        "kernels alone and sparse mode (K=512, default chunks); then student='xla' and the "
                        "MaxText-style XLA indexer baseline at these indexer head chunks (H_I=64, d_I=128)")
    p.add_argument("--only", nargs="+", default=None, help="substrings of the program labels to run")
    p.add_argument("--libtpu-profile", default="off", choices=["auto", "on", "off"])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--out", default=os.path.join("results", "estimates"))
    p.add_argument("--record", action="store_true", help=f"also write {os.path.relpath(RECORDED, harness.REPO)}")
    a = p.parse_args(argv)
    rows = run(a.seq, a.chunks, a.only, a.libtpu_profile, a.topology, index_chunks=a.index_chunks)
    header = [f"# static v5p estimates (tpu_estimate BEST ESTIMATE, libtpu profile {a.libtpu_profile}; NOT "
              f"measurements), dense mode, {SHAPE.name} B={SHAPE.batch} H={SHAPE.heads} D={SHAPE.head_dim} "
              f"m={SHAPE.ratio} W={SHAPE.window}, bf16 q/kv, f32 logits, S={a.seq}, default ids unless named"]
    print(harness.format_table(rows, COLUMNS, header))
    meta = dict(what="static v5p run-time estimates of dense mode, DeepSeek-V4-Flash shape", header=header,
                how="../shared/tools/tpu_estimate.py BEST ESTIMATE on the v5p AOT compile; estimates, not measurements",
                command="python -m benchmarks.estimates " + " ".join(argv if argv is not None else sys.argv[1:]),
                recorded=datetime.date.today().isoformat())
    paths = harness.write_rows(rows, a.out, f"dense_S{a.seq}", meta)
    if a.record:
        harness.write_rows(rows, os.path.dirname(RECORDED), "dense", meta)
        paths += (RECORDED,)
    print("wrote " + ", ".join(paths))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
