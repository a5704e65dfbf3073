"""The suite's split into pytest processes (`tests/run_suite.py`), balanced by recorded test durations.

The unit is a test file: its tests stay in one process, so what they share per process (jit caches, a compiled
program, module fixtures) is paid once, as in a one-process run. A file weighs the recorded seconds of its
collected tests (`tests/durations.json`, setup + call + teardown; a test without a record weighs the median
record); the files go, heaviest first, to the process with the least weight so far (longest-processing-time
first), ties to the lower index and between equal weights by file name, so every process computes the same split
from the same collection. `--suite-shard I/N` keeps the I-th of N parts (after -m / -k deselection);
`--record-durations PATH` writes this run's durations. `python tests/run_suite.py --record-durations` refreshes
`tests/durations.json` from a whole-suite run.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--suite-shard: expected I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"--suite-shard: expected 0 <= I < N, got {text!r}")
    return index, count


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """{test node id: seconds}; empty when the file does not exist."""
    return json.loads(path.read_text()) if path.exists() else {}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def file_weights(nodeids, durations: dict[str, float]) -> dict[str, float]:
    """{test file: recorded seconds of its tests among nodeids}; an unrecorded test weighs the median record
    (1 s when nothing is recorded)."""
    default = statistics.median(durations.values()) if durations else 1.0
    weights: dict[str, float] = {}
    for nodeid in nodeids:
        weights[file_of(nodeid)] = weights.get(file_of(nodeid), 0.0) + durations.get(nodeid, default)
    return weights


def assign(nodeids, durations: dict[str, float], count: int) -> tuple[list[int], list[float]]:
    """(the part of each node id, each part's expected seconds): whole files, heaviest first, to the lightest
    part."""
    weights = file_weights(nodeids, durations)
    loads, part_of = [0.0] * count, {}
    for name in sorted(weights, key=lambda f: (-weights[f], f)):
        part = min(range(count), key=lambda p: (loads[p], p))
        part_of[name] = part
        loads[part] += weights[name]
    return [part_of[file_of(n)] for n in nodeids], loads


class ShardPlugin:
    """Keeps one part of the collection (`--suite-shard`) and records durations (`--record-durations`)."""

    def __init__(self, shard: str | None, record: str | None):
        self.shard = parse_shard(shard) if shard else None
        self.record = record
        self.durations: dict[str, float] = {}

    @pytest.hookimpl(trylast=True)  # after the markers are set and -m / -k have deselected
    def pytest_collection_modifyitems(self, config, items):
        if self.shard is None:
            return
        index, count = self.shard
        parts, loads = assign([item.nodeid for item in items], load_durations(), count)
        kept = [item for item, part in zip(items, parts) if part == index]
        config.hook.pytest_deselected(items=[item for item, part in zip(items, parts) if part != index])
        items[:] = kept
        print(f"\nsuite shard {index}/{count}: {len(kept)} of {len(parts)} tests, expected "
              f"{loads[index]:.0f} s (recorded durations; parts {', '.join(f'{x:.0f}' for x in loads)} s)")

    def pytest_runtest_logreport(self, report):
        if self.record:
            self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        if self.record:
            Path(self.record).write_text(json.dumps(self.durations, indent=0, sort_keys=True))


def pytest_addoption(parser):
    parser.addoption("--suite-shard", default=None, metavar="I/N",
                     help="run only the I-th (from 0) of N parts of the collected test files, balanced by "
                          "tests/durations.json (tests/suite_shards.py; tests/run_suite.py passes it)")
    parser.addoption("--record-durations", default=None, metavar="PATH",
                     help="write each test's setup + call + teardown seconds to PATH as JSON")


def pytest_configure(config):
    config.pluginmanager.register(ShardPlugin(config.getoption("--suite-shard"),
                                              config.getoption("--record-durations")), "csa_suite_shards")
