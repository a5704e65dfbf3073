"""The whole suite in two pytest processes at once: the README's test command and what `.ci/run` runs.

    python tests/run_suite.py [pytest arguments, e.g. -x or -k sparse]

Why two processes: a v5p compile through libtpu keeps one core busy (measured: 101% CPU for the Flash-shape
compile) and an interpreter run mostly one, so one pytest process leaves the second core of a 2-core host idle for
most of the run. The suite splits along the `v5p_compile` and `sharded` markers (`tests/conftest.py`): the AOT
compiles and the mesh tests in one process, the single-device interpreter runs in the other. Each process prints
its own 30 slowest tests (`pytest.ini`); each line of its output is prefixed with its shard's name. The exit
status is 0 only when both shards pass (a shard that a `-k` leaves empty counts as passed if the other ran tests).
`python -m pytest -q` still runs the same tests in one process. On a TPU host (`platform_select`: the suite runs
on the chips, which one process holds) it runs that one process.
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import platform_select

ROOT = Path(__file__).resolve().parent.parent
# Compiles and meshes in one process, single-device interpreter runs in the other. With the v5p compiles alone the
# first shard took 843 s and the second 2,021 s of a 2,043 s run (2-core CI host); with the mesh tests (63) moved
# to the first: 1,247 s and 1,821 s.
SHARDS = (("compile+mesh", "v5p_compile or sharded"), ("interpret", "not (v5p_compile or sharded)"))
ONE_PROCESS = (("all", None),)
NO_TESTS_COLLECTED = 5  # pytest's exit code


def _forward(name, stream, out_lock, finished):
    for line in iter(stream.readline, ""):
        with out_lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
    finished[name] = time.time()  # the shard's output closed: it has exited


def shards(platform: str):
    """(name, marker expression or None) per pytest process: two on a CPU host, one on the chips."""
    return SHARDS if platform == "cpu" else ONE_PROCESS


def main(pytest_args):
    if any(a == "-m" or a.startswith("-m") and not a.startswith("--") for a in pytest_args):
        raise SystemExit("tests/run_suite.py: the shards are chosen by -m; run `python -m pytest -m ...` to select "
                         f"by marker yourself (got {pytest_args})")
    out_lock, started, runs, finished = threading.Lock(), time.time(), [], {}
    for name, marker in shards(platform_select.chosen_platform()):
        cmd = [sys.executable, "-m", "pytest", "-q", *(["-m", marker] if marker else []), *pytest_args]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        reader = threading.Thread(target=_forward, args=(name, proc.stdout, out_lock, finished))
        reader.start()
        runs.append((name, proc, reader))
    codes = {}
    for name, proc, reader in runs:
        codes[name] = proc.wait()
        reader.join()
        print(f"[{name}] exit {codes[name]} after {finished[name] - started:.0f} s", flush=True)
    ran = [c for c in codes.values() if c != NO_TESTS_COLLECTED]
    ok = bool(ran) and all(c == 0 for c in ran)
    print(f"suite: {'passed' if ok else 'FAILED'} in {time.time() - started:.0f} s ({codes})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
