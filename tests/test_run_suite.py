"""tests/run_suite.py, the README's test command, and tests/suite_shards.py, its split: two pytest processes, each
keeping whole test files balanced by recorded durations, one exit status."""

import subprocess
import sys
from pathlib import Path

import pytest

import run_suite
import suite_shards

ROOT = Path(__file__).resolve().parent.parent


def _run(*args):
    return subprocess.run([sys.executable, "tests/run_suite.py", *args], cwd=ROOT, capture_output=True, text=True)


def test_two_parts_on_a_cpu_host_and_one_process_holds_the_chips():
    assert [shard for _, shard in run_suite.shards("cpu")] == ["0/2", "1/2"]
    assert [shard for _, shard in run_suite.shards("tpu")] == [None]


def test_the_split_keeps_files_whole_and_balances_them_heaviest_first():
    durations = {"a.py::x": 50.0, "a.py::y": 10.0, "b.py::x": 40.0, "c.py::x": 30.0, "d.py::x": 25.0,
                 "e.py::x": 5.0}
    nodeids = sorted(durations) + ["f.py::new"]  # unrecorded: the median record, 27.5 s
    parts, loads = suite_shards.assign(nodeids, durations, 2)
    part = dict(zip(nodeids, parts))
    assert part["a.py::x"] == part["a.py::y"]  # a file stays in one process
    # LPT: a 60 -> 0, b 40 -> 1, c 30 -> 1, f 27.5 -> 0, d 25 -> 0?  loads 87.5 / 70 -> d to 1, e to 0
    assert [part[f"{f}.py::x"] for f in "abcde"] == [0, 1, 1, 1, 0] and part["f.py::new"] == 0
    assert loads == [92.5, 95.0]
    assert suite_shards.assign(list(reversed(nodeids)), durations, 2)[1] == loads  # the order collected: no matter
    # nothing recorded: every test weighs 1 s
    assert suite_shards.assign(["a.py::x", "a.py::y", "b.py::x"], {}, 2) == ([0, 0, 1], [2.0, 1.0])


@pytest.mark.parametrize("text", ["2/2", "1", "a/b", "-1/2"])
def test_a_bad_part_is_refused_with_the_option_named(text):
    with pytest.raises(ValueError, match="--suite-shard"):
        suite_shards.parse_shard(text)


def test_the_parts_partition_the_collection():
    files = ["tests/test_build.py", "tests/test_run_suite.py", "tests/test_validation.py"]

    def collected(*extra):
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *files, *extra], cwd=ROOT,
                              capture_output=True, text=True)
        return {line for line in done.stdout.splitlines() if "::" in line}
    whole, first, second = collected(), collected("--suite-shard", "0/2"), collected("--suite-shard", "1/2")
    assert whole and first and second and not first & second and first | second == whole


def test_every_collected_test_file_has_recorded_durations():
    recorded = {suite_shards.file_of(n) for n in suite_shards.load_durations()}
    files = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    assert files - recorded == set(), "run `python tests/run_suite.py --record-durations` to record them"


def test_a_passing_selection_exits_0_with_each_part_reported():
    # one test: the first part takes its file, the second collects nothing, which is not a failure
    done = _run("tests/test_build.py", "-k", "missing_file", "-m", "not sharded")
    assert done.returncode == 0, done.stdout
    assert "[part 1/2] 1 passed" in done.stdout
    assert "[part 2/2] exit 5" in done.stdout and "[part 1/2] exit 0" in done.stdout
    assert "suite: passed" in done.stdout


def test_a_failing_part_fails_the_suite(tmp_path):
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert False\n")
    done = _run(str(failing))
    assert done.returncode == 1, done.stdout
    assert "[part 1/2] exit 1" in done.stdout and "[part 2/2] exit 5" in done.stdout
    assert "suite: FAILED" in done.stdout


def test_nothing_collected_in_either_part_fails_the_suite():
    done = _run("tests/test_build.py", "-k", "no_such_test_anywhere")
    assert done.returncode == 1 and "suite: FAILED" in done.stdout
