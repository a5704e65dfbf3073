"""benchmarks.harness: the one row type and its files, the estimator adapter (against a stand-in for
tpu_estimate's report), the child-process protocol, the table format."""

import json

import jax.numpy as jnp
import pytest

from benchmarks import harness


def test_input_structs_follow_the_shape():
    tiny = harness.SHAPES["tiny"]
    names = ["logits", "q", "compressed_kv", "segment_ids", "topk_indices", "window_kv", "sinks", "full_lse"]
    got = {n: (s.shape, s.dtype) for n, s in zip(names, harness.input_structs(tiny, names, 128, 16))}
    assert got == dict(logits=((1, 128, 16), jnp.float32), q=((1, 128, 4, 32), jnp.bfloat16),
                       compressed_kv=((1, 32, 32), jnp.bfloat16), segment_ids=((1, 128), jnp.int32),
                       topk_indices=((1, 128, 16), jnp.int32), window_kv=((1, 128, 32), jnp.bfloat16),
                       sinks=((4,), jnp.float32), full_lse=((1, 128, 4), jnp.float32))


def test_rows_round_trip_through_files(tmp_path):
    rows = [harness.Row(bench="unit", program="a", seq=128, est_us=1.5, status="ok"),
            harness.Row(bench="unit", program="b", seq=256, temp_mib=2.0, status="HBM overflow", error="x")]
    csv_path, json_path = harness.write_rows(rows, str(tmp_path), "unit", dict(what="test"))
    assert open(csv_path).readline().strip().split(",") == harness.ROW_FIELDS
    assert json.load(open(json_path))["what"] == "test"
    assert harness.read_rows(json_path) == rows
    # an older list-of-dicts record with NaN cells and a field this Row does not know
    old = tmp_path / "old.json"
    old.write_text(json.dumps([dict(seq=4096, program="visit", est_us=float("nan"), retired_field=1)]))
    assert harness.read_rows(str(old)) == [harness.Row(seq=4096, program="visit")]


def test_record_error_classifies_the_compilers_message():
    row = harness.Row()
    for text, status in [("Mosaic failed: scoped VMEM limit exceeded", "VMEM overflow"),
                         ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm", "HBM overflow"),
                         ("SMEM allocation exceeds the limit", "SMEM overflow"), ("something else", "error")]:
        assert harness.record_error(row, RuntimeError(text)).status == status
    assert harness.record_error(row, NotImplementedError("no")).status == "unsupported"
    assert row.error == "NotImplementedError: no"


class _FakeEstimator:
    """tpu_estimate's report, reduced to the keys the adapter reads."""

    def __init__(self, best_us, lower_us=None):
        self.best_us, self.lower_us, self.calls = best_us, lower_us, []

    def estimate(self, fn, *args, **options):
        self.calls.append(options)
        return dict(summary=dict(best_estimate_us=self.best_us, bundle_est_us=90.0,
                                 bundle_est_lower_bound_us=self.lower_us),
                    memory=dict(temp_bytes=3 << 20, peak_bytes=5 << 20), roofline=dict(bytes=2.46e8),
                    ops=[dict(bundle_est_cycles=1750.0, libtpu_profile_cycles=None, calls=2)],
                    totals=dict(tlp_overhead_bundles=0), assumptions=dict(clock_hz=1.75e9),
                    warnings=["k: trip count of loop 0x1 NOT determined", "unrelated"])


def test_estimate_adapter_fills_the_row():
    te = _FakeEstimator(best_us=80.0)
    row = harness.estimate(harness.Row(program="unit prog"), lambda x: x, [], estimator=te, path_budget=7)
    assert te.calls[0]["libtpu_profile"] == "off" and te.calls[0]["path_budget"] == 7
    assert te.calls[0]["name"] == "unit_prog"
    assert (row.status, row.measure, row.est_us, row.bundle_us) == ("ok", "estimate", 80.0, 90.0)
    assert row.hbm_bytes == 2.46e8 and row.bw_floor_us == pytest.approx(100.0)
    assert row.best_us == pytest.approx(100.0)  # max(estimate, bytes / 2.46 TB/s)
    assert row.no_floor_us == pytest.approx(2.0) and (row.temp_mib, row.peak_mib) == (3.0, 5.0)
    assert "NOT determined" in row.note and "unrelated" not in row.note
    # a data-dependent trip count: no estimate, the lower bound is said
    low = harness.estimate(harness.Row(), lambda x: x, [], estimator=_FakeEstimator(None, lower_us=1234.0))
    assert low.est_us is None and low.best_us is None and low.note.startswith("lower bound 1234 us")
    assert low.status == "lower bound"


def test_child_process_protocol():
    cfg = dict(seq=128, head_chunk=4, mode="dense", target="per_head", impl="pallas", ids="default")
    failed = harness.Row(program="failed")
    row = harness.run_isolated("benchmarks.sweep:aot_row", dict(shape_name="tiny", cfg=cfg, which="fwd+bwd",
                                                                topology="v5p:2x2x1", reason="said no"), 300, failed)
    assert (row["status"], row["error"], row["bench"], row["head_chunk"]) == ("unsupported", "said no", "sweep", 4)
    crashed = harness.run_isolated("benchmarks.no_such_module:f", {}, 300, failed)
    assert crashed["status"] == "error" and "ModuleNotFoundError" in crashed["error"]
    assert crashed["program"] == "failed" and crashed["compile_s"] > 0


def test_table_format_and_parse():
    cols = [("program", "program", "s"), ("seq", "S", "i"), ("est_us", "est us", "f1"), ("loss_rel_err", "rel", "e")]
    rows = [dict(program="a|b", seq=4096, est_us=12345.67, loss_rel_err=1.5e-7, status="ok", error=""),
            dict(program="c", seq=8, est_us=None, loss_rel_err=float("nan"), status="error", error="boom")]
    text = harness.format_table(rows, cols, ["# head"])
    assert "12,345.7" in text and "boom" in text and text.startswith("# head")
    parsed = harness.parse_table(text, cols)
    assert parsed == [dict(program="a/b", seq=4096, est_us=12345.7, loss_rel_err=1.5e-7),
                      dict(program="c", seq=8, est_us=None, loss_rel_err=None)]
