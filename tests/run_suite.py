"""The whole suite in two pytest processes at once: the README's test command and what `.ci/run` runs.

    python tests/run_suite.py [--record-durations] [pytest arguments, e.g. -x, -k sparse, -m "not sharded"]

Why two processes: a v5p compile through libtpu keeps one core busy (measured: 101% CPU for the Flash-shape
compile) and an interpreter run mostly one, so one pytest process leaves the second core of a 2-core host idle for
most of the run. Each process keeps one part of the collected test files (`--suite-shard I/2`,
`tests/suite_shards.py`: whole files, balanced by the durations recorded in `tests/durations.json`). Each prints
its own 30 slowest tests (`pytest.ini`) and its expected seconds; each line of its output is prefixed with its
part. The exit status is 0 only when both parts pass (a part that a selection leaves empty counts as passed if the
other ran tests). `--record-durations` rewrites `tests/durations.json` from this run (run it on the whole suite
after adding or reshaping tests). `python -m pytest -q` still runs the same tests in one process. On a TPU host
(`platform_select`: the suite runs on the chips, which one process holds) it runs that one process.
"""

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import platform_select
import suite_shards

ROOT = Path(__file__).resolve().parent.parent
CPU_PROCESSES = 2  # the CI host's cores
NO_TESTS_COLLECTED = 5  # pytest's exit code


def _forward(name, stream, out_lock, finished):
    for line in iter(stream.readline, ""):
        with out_lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
    finished[name] = time.time()  # the part's output closed: it has exited


def shards(platform: str):
    """(name, --suite-shard value or None) per pytest process: two on a CPU host, one on the chips."""
    if platform != "cpu":
        return (("all", None),)
    return tuple((f"part {i + 1}/{CPU_PROCESSES}", f"{i}/{CPU_PROCESSES}") for i in range(CPU_PROCESSES))


def main(args):
    record = "--record-durations" in args
    pytest_args = [a for a in args if a != "--record-durations"]
    with tempfile.TemporaryDirectory() as records:
        return _run(pytest_args, Path(records) if record else None)


def _run(pytest_args, records):
    """Runs the parts; records: a directory for their durations (then merged into tests/durations.json) or None."""
    out_lock, started, runs, finished = threading.Lock(), time.time(), [], {}
    for number, (name, shard) in enumerate(shards(platform_select.chosen_platform())):
        # -c: this repository's settings (and the --suite-shard option) also for test files outside it
        cmd = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pytest.ini"), "-q",
               *(["--suite-shard", shard] if shard else []), *pytest_args]
        if records:
            cmd += ["--record-durations", str(records / f"{number}.json")]
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
    if records:
        fresh = {}
        for path in sorted(records.glob("*.json")):
            fresh.update(json.loads(path.read_text()))
        # this run's tests replace their records; the others stay unless their file is gone
        kept = {k: v for k, v in suite_shards.load_durations().items() if (ROOT / suite_shards.file_of(k)).exists()}
        merged = {k: round(v, 2) for k, v in sorted({**kept, **fresh}.items())}
        suite_shards.DURATIONS.write_text(json.dumps(merged, indent=0) + "\n")
        print(f"suite: recorded {len(fresh)} durations ({len(merged)} in all) in "
              f"{suite_shards.DURATIONS.relative_to(ROOT)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
