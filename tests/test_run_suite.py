"""tests/run_suite.py, the README's test command: two shards along the v5p_compile and sharded markers, one exit
status."""

import subprocess
import sys
from pathlib import Path

import pytest

import run_suite

ROOT = Path(__file__).resolve().parent.parent


def _run(*args):
    return subprocess.run([sys.executable, "tests/run_suite.py", *args], cwd=ROOT, capture_output=True, text=True)


def test_two_shards_partition_the_suite_by_marker_on_a_cpu_host_and_one_process_holds_the_chips():
    assert [marker for _, marker in run_suite.shards("cpu")] == ["v5p_compile or sharded",
                                                                 "not (v5p_compile or sharded)"]
    assert [marker for _, marker in run_suite.shards("tpu")] == [None]


def test_a_passing_selection_exits_0_with_each_shard_reported():
    # test_build.py has no v5p compile or mesh: the first shard collects nothing, which is not a failure
    done = _run("tests/test_build.py", "-k", "missing_file")
    assert done.returncode == 0, done.stdout
    assert "[interpret] 1 passed" in done.stdout
    assert "[compile+mesh] exit 5" in done.stdout and "[interpret] exit 0" in done.stdout
    assert "suite: passed" in done.stdout


def test_a_failing_shard_fails_the_suite(tmp_path):
    # a file outside tests/ gets no marker from conftest: the interpret shard runs (and fails) it, the other is empty
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert False\n")
    done = _run(str(failing))
    assert done.returncode == 1, done.stdout
    assert "[interpret] exit 1" in done.stdout and "[compile+mesh] exit 5" in done.stdout
    assert "suite: FAILED" in done.stdout


def test_nothing_collected_in_either_shard_fails_the_suite():
    done = _run("tests/test_build.py", "-k", "no_such_test_anywhere")
    assert done.returncode == 1 and "suite: FAILED" in done.stdout


@pytest.mark.parametrize("marker_arg", [["-m", "sharded"], ["-msharded"]])
def test_a_marker_selection_is_refused_with_the_reason(marker_arg):
    done = _run(*marker_arg)
    assert done.returncode != 0 and "the shards are chosen by -m" in done.stderr
