"""The README's main job (benchmarks/demo.py) end to end at S = 4096 (narrower heads): the kernels agree with the
reference, the v5p compiles give a memory row per program (csa_pallas below the baseline), the outputs and the
recorded estimates load."""

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `benchmarks`
from benchmarks import demo, harness  # noqa: E402
from aot_cases import require_libtpu  # noqa: E402


def test_main_job_quick(tmp_path, monkeypatch, capsys):
    require_libtpu()
    monkeypatch.setattr(demo, "BASELINE_CHUNKS", (8,))  # the baseline's best chunk at 4K; the others cost time
    # Narrower than the Flash shape (H=64, D=512; compiled by tests/test_aot_kernels.py) to keep CI short: this test
    # checks the job's mechanics, not its numbers.
    monkeypatch.setattr(demo, "FLASH", dataclasses.replace(demo.FLASH, heads=8, head_dim=128))
    assert demo.main(["--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "kernels == reference within 1e-5: OK" in printed and "x the XLA baseline's best head chunk" in printed
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert {r["program"] for r in rows} == {"csa_pallas per_head", "csa_pallas joint", "XLA baseline head chunk 8"}
    assert all(r["status"] == "ok" and r["seq"] == 4096 for r in rows)
    temp = {r["program"]: r["temp_mib"] for r in rows}
    assert temp["csa_pallas joint"] * 4 < temp["XLA baseline head chunk 8"]
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "memory.csv").exists()


def test_recorded_estimates_name_their_provenance():
    with open(os.path.join(demo.RECORDED, "dense.json")) as f:
        dense = json.load(f)
    assert "tpu_estimate" in dense["how"] and "estimates, not measurements" in dense["how"]
    assert dense["command"].startswith("python -m benchmarks.estimates")
    rows = harness.read_rows(os.path.join(demo.RECORDED, "dense.json"))
    assert all(r.measure == "estimate" and r.package_fingerprint for r in rows)
    assert all(r.status == "ok" for r in rows if r.ids == "default")
    packed = [r for r in rows if r.ids == "packed"]  # says what the estimator cannot see: SMEM-table trip counts
    assert packed and all(r.status == "lower bound" and "lower bound" in r.note for r in packed)
    sparse = harness.read_rows(os.path.join(demo.RECORDED, "sparse.json"))
    assert {r.program for r in sparse} >= {"visit", "gather", "dense mode", "xla gather baseline"}
    with pytest.raises(SystemExit):
        demo.main(["--help"])
