"""benchmarks.sweep: shapes, config enumeration + filters, table format/parse round trip, plot writer, the mesh
rows, and one end-to-end `--shape tiny --quick` run (in-process, interpret-mode checks; AOT rows with libtpu)."""

import csv
import dataclasses
import json
import os

import pytest

from benchmarks import harness, sweep, sweep_mesh, sweep_report


def test_shapes():
    flash, pro, tiny = (harness.SHAPES[k] for k in ("deepseek-v4-flash", "deepseek-v4-pro", "tiny"))
    assert (flash.heads, flash.head_dim, flash.ratio, flash.window, flash.topk) == (64, 512, 4, 128, 512)
    assert (pro.heads, pro.head_dim, pro.ratio, pro.window, pro.topk) == (128, 512, 4, 128, 1024)
    assert (tiny.heads, tiny.head_dim, tiny.ratio, tiny.window, tiny.topk) == (4, 32, 4, 32, 16)
    assert tiny.seqs == (128, 256)
    assert flash.head_chunks == (1, 2, 4, 8, 16, 32, 64)
    assert pro.head_chunks[-1] == 128 and len(pro.head_chunks) == 8
    assert tiny.head_chunks == (1, 2, 4)
    assert flash.quick_head_chunk == 8 and tiny.quick_head_chunk == 4


def test_enumerate_all_and_quick():
    tiny = harness.SHAPES["tiny"]
    full = sweep.enumerate_configs(tiny)
    # per S: pallas 2 modes x 2 targets x 3 chunks; xla baseline (dense per_head) 3 chunks; reference 3 combos x 1
    assert len(full) == 2 * (12 + 3 + 3)
    assert {c.seq for c in full} == {128, 256} and {c.ids for c in full} == {"default"}
    assert len(set(full)) == len(full)
    ref = [c for c in full if c.impl == "xla" and not sweep.uses_baseline(c.mode, c.target)]
    assert {c.head_chunk for c in ref} == {None}  # the reference has no head chunk
    quick = sweep.enumerate_configs(tiny, quick=True)
    assert {c.seq for c in quick} == {128} and {c.head_chunk for c in quick} == {4, None}
    assert len(quick) == 8  # 2 modes x 2 targets x 2 impls
    auto = sweep.enumerate_configs(tiny, seqs=[128], head_chunks=[None, 2], modes=["dense"], targets=["per_head"],
                                   ids="packed")
    assert [(c.impl, c.head_chunk) for c in auto] == [("pallas", None), ("pallas", 2), ("xla", 2)]  # baseline: ints
    assert sweep.arg_names(auto[0]) == ["logits", "q", "compressed_kv", "segment_ids"]


def test_enumerate_filters():
    flash = harness.FLASH
    cfgs = sweep.enumerate_configs(flash, seqs=[8192, 4096], head_chunks=[8, 1], modes=["dense"],
                                   targets=["per_head"], impls=["pallas"])
    assert [(c.seq, c.head_chunk) for c in cfgs] == [(4096, 1), (4096, 8), (8192, 1), (8192, 8)]
    assert all((c.mode, c.target, c.impl) == ("dense", "per_head", "pallas") for c in cfgs)
    sparse = sweep.enumerate_configs(flash, quick=True, modes=["sparse"], impls=["xla"])
    assert [c.mode for c in sparse] == ["sparse", "sparse"] and {c.target for c in sparse} == {"per_head", "joint"}
    with pytest.raises(ValueError, match="divisor"):
        sweep.enumerate_configs(flash, head_chunks=[3])
    with pytest.raises(ValueError, match="multiple"):
        sweep.enumerate_configs(flash, seqs=[4097])


def test_cli_filters_parse():
    a = sweep.build_parser().parse_args(["--shape", "tiny", "--seq", "128", "--head-chunk", "auto", "2", "--mode",
                                         "sparse", "--target", "joint", "--impl", "pallas", "--quick"])
    assert (a.seq, a.head_chunk, a.mode, a.target, a.impl, a.quick) == ([128], [None, 2], ["sparse"], ["joint"],
                                                                        ["pallas"], True)


def test_mesh_option_parses_axes_and_rejects_bad_ones():
    a = sweep.build_parser().parse_args(["--mesh", "data=2,heads=4", "--mesh", "seq=8"])
    assert a.mesh == [{"data": 2, "heads": 4}, {"seq": 8}] and a.mesh_topology == "v5p:2x2x2"
    assert sweep_mesh.label({"data": 2, "seq": 4}) == "data=2,seq=4"
    assert sweep_mesh.global_shape(harness.SHAPES["tiny"], {"data": 4, "heads": 2}).batch == 4
    for bad in ("model=2", "data=0", "data=2,data=2", "heads"):
        with pytest.raises(ValueError, match="--mesh"):
            sweep_mesh.parse_mesh(bad)


def test_mesh_rows_compile_sharded_per_device(tmp_path):
    from csa_pallas import aot
    if not aot.libtpu_available():
        pytest.fail("libtpu is required for the sweep's AOT rows: pip install 'jax[tpu]==0.10.2'")
    cfg = sweep.Config(seq=256, head_chunk=2, mode="dense", target="joint", impl="pallas", ids="packed")
    row = sweep_mesh.aot_row("tiny", dataclasses.asdict(cfg), "fwd+bwd", "v5p:2x2x1", {"data": 2, "heads": 2})
    assert row["status"] == "ok", row["error"]
    assert row["mesh"] == "data=2,heads=2" and row["batch"] == 2 and row["temp_mib"] > 0


def _rows():
    base = dict(shape="tiny", mode="dense", target="per_head", impl="pallas", head_chunk=4, seq=128)
    r1 = dict(base, pass_="fwd+bwd", measure="aot", how="aot v5p:2x2x1 memory_analysis", status="ok", error="",
              argument_mib=0.125, temp_mib=12.3456, peak_mib=13.5, vmem_limit_mib=32.0, compile_s=2.25)
    r2 = dict(base, impl="xla", head_chunk=1, seq=256, pass_="fwd", measure="aot", how="aot v5p:2x2x1 memory_analysis",
              status="HBM overflow", error="RESOURCE_EXHAUSTED: Ran out of memory | in hbm")
    r3 = dict(base, mode="sparse", pass_="fwd+bwd", measure="check", how="interpret-mode CPU vs xla", status="ok",
              error="", loss_rel_err=1.5e-7, grad_abs_err=2e-9, grad_rel_err=3.25e-7, compile_s=8.0)
    r4 = dict(base, pass_="fwd+bwd", measure="wall", how="TPU wall clock TPU v5p", status="ok", error="",
              median_ms=1.2345, spread_pct=3.0, tflops=123.4, pct_peak=26.9)
    r5 = dict(base, pass_="fwd+bwd", measure="aot", how="aot v5p:2x2x2 sharded, per-device memory_analysis",
              status="ok", error="", mesh="data=2,heads=4", batch=2, temp_mib=16.7)
    return [r1, r2, r3, r4, r5]


def test_table_round_trip():
    rows = _rows()
    text = sweep_report.format_table(rows, ["# header line", "# another"])
    assert text.startswith("# header line")
    assert "RESOURCE_EXHAUSTED" in text  # notes carry the first message line
    parsed = sweep_report.parse_table("some preamble\n" + text + "\ntrailing text\n")
    assert len(parsed) == len(rows)
    for r, p in zip(sweep_report.table_rows(rows), parsed):
        for key, _, kind in sweep_report.COLUMNS:
            v = r.get(key)
            if v is None or v == "":
                assert p[key] is None, key
            elif kind == "s":
                assert p[key] == v, key
            elif kind == "i":
                assert p[key] == v, key
            else:
                assert p[key] == pytest.approx(v, rel=1e-2, abs=0.05), key
    assert parsed[0]["temp_mib"] == 12.3 and parsed[1]["status"] == "HBM overflow" and parsed[3]["median_ms"] == 1.234


def test_plot_writer(tmp_path):
    rows = []
    for impl in ("pallas", "xla"):
        for c in (1, 4):
            for s in (128, 256, 512):
                rows.append(dict(mode="dense", target="per_head", impl=impl, head_chunk=c, seq=s, pass_="fwd+bwd",
                                 measure="aot", status="ok", temp_mib=s / 100 * c + (5 if impl == "xla" else 0)))
    rows.append(dict(rows[0], status="VMEM overflow", temp_mib=None))
    paths = sweep_report.write_plots(rows, str(tmp_path), "unit", "v5p:2x2x1")
    assert paths == [str(tmp_path / "memory_unit.png")]  # no wall rows: no time plot
    assert os.path.getsize(paths[0]) > 0
    assert sweep_report.plot_metric([], str(tmp_path / "none.png"), measure="aot", key="temp_mib", ylabel="",
                                    title="") is None


def test_end_to_end_tiny_quick(tmp_path, capsys):
    from csa_pallas import aot

    rc = sweep.main(["--shape", "tiny", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "compiled.memory_analysis()" in out and "interpret mode" in out
    with open(tmp_path / "sweep_tiny_quick.json") as f:
        data = json.load(f)
    rows = data["rows"]
    with open(tmp_path / "sweep_tiny_quick.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows) > 0
    assert all(r["how"] for r in rows) and all(r["how"] for r in csv_rows)
    checks = [r for r in rows if r["measure"] == "check"]
    assert {(r["mode"], r["target"]) for r in checks} == {(m, t) for m in sweep.MODES for t in sweep.TARGETS}
    for r in checks:
        assert r["status"] in ("ok", "unsupported"), r
        if r["status"] == "ok":
            assert r["grad_rel_err"] <= sweep.CHECK_TOL and r["loss_rel_err"] <= sweep.CHECK_TOL
    assert any(r["status"] == "ok" for r in checks if r["mode"] == "dense")
    parsed = sweep_report.parse_table(out)
    assert len(parsed) == len(rows)
    assert [p["status"] for p in parsed] == [r["status"] for r in rows]
    if aot.libtpu_available():
        aot_rows = [r for r in rows if r["measure"] == "aot"]
        assert len(aot_rows) == 8  # 8 configs x fwd+bwd
        dense_ok = [r for r in aot_rows if r["mode"] == "dense" and r["status"] == "ok"]
        assert len(dense_ok) == 4 and all(r["temp_mib"] is not None and r["peak_mib"] > 0 for r in dense_ok)
        assert all(r["vmem_limit_mib"] for r in dense_ok if r["impl"] == "pallas")
        png = tmp_path / "memory_tiny_quick.png"
        assert png.exists() and png.stat().st_size > 0


def test_isolated_compile_timeout(tmp_path, capsys):
    """--isolate on: the AOT row runs in a child; a compile timeout kills it and records a 'timeout' row."""
    rc = sweep.main(["--shape", "tiny", "--quick", "--no-check", "--isolate", "on", "--mode", "dense", "--target",
                     "per_head", "--impl", "pallas", "--compile-timeout", "0.2", "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "sweep_tiny_quick.json") as f:
        rows = json.load(f)["rows"]
    from csa_pallas import aot
    if aot.libtpu_available():
        assert [(r["measure"], r["status"]) for r in rows] == [("aot", "timeout")]
        assert "timeout" in rows[0]["error"] and rows[0]["how"]
    printed = capsys.readouterr().out
    assert sweep_report.parse_table(printed) == sweep_report.parse_table(sweep_report.format_table(rows))
    assert set(rows[0]) == set(harness.ROW_FIELDS)  # the child's row is a harness.Row
