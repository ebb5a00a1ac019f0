"""Where the test suite's wall clock goes: each xdist worker's test files, when they ran and for how long.

pytest's ``--durations`` gives each test's own time but not which worker ran it or when, so it cannot
show how evenly ``--dist loadfile`` shares the files out, nor what the last worker was still doing
when the other had finished. This file is both a pytest plugin that records every test's start and end
per worker and the program that summarises the record:

    SUITE_TIMELINE_DIR=/tmp/tl PYTHONPATH=benchmarks python -m pytest -p suite_timeline
    python benchmarks/suite_timeline.py /tmp/tl [--min-seconds 3]

The record is one ``timeline-<worker>.tsv`` per worker (``start|end<TAB>unix time<TAB>node id``).
A file's span runs from the end of the test before its first one on that worker (its module
fixtures' set-up counts to it) to the end of its last one. Runs alone: timings of a busy machine mean
little.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "SUITE_TIMELINE_DIR"
_out = None


def _record(kind: str, nodeid: str) -> None:
    global _out
    folder = os.environ.get(ENV)
    if not folder:
        return
    if _out is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder).mkdir(parents=True, exist_ok=True)
        _out = open(Path(folder) / f"timeline-{worker}.tsv", "a", buffering=1)  # noqa: SIM115 (per process)
    _out.write(f"{kind}\t{time.time():.3f}\t{nodeid}\n")


_controller = False  # xdist's controller relays the workers' reports: recording them there would double


def pytest_configure(config: Any) -> None:
    global _controller
    _controller = not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", 0))


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    if not _controller:
        _record("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    if not _controller:
        _record("end", nodeid)


@dataclass(frozen=True)
class FileSpan:
    """One test file on one worker: seconds since the run's first start."""

    worker: str
    path: str
    begin: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.begin


def spans(folder: str | os.PathLike[str]) -> list[FileSpan]:
    """Every (worker, test file) of the record in ``folder``, in the order each worker ran them."""
    rows: dict[str, list[tuple[str, float, str]]] = {}
    for path in sorted(Path(folder).glob("timeline-*.tsv")):
        worker = path.stem.removeprefix("timeline-")
        for line in path.read_text().splitlines():
            kind, t, nodeid = line.split("\t", 2)
            if kind not in ("start", "end"):
                raise ValueError(f"{path}: a line of kind {kind!r}; the record has only start and end lines")
            rows.setdefault(worker, []).append((kind, float(t), nodeid))
    if not rows:
        raise ValueError(
            f"no timeline-*.tsv in {str(folder)!r}: run pytest with {ENV}={folder} -p suite_timeline"
        )
    t0 = min(t for lines in rows.values() for _, t, _ in lines)
    out: list[FileSpan] = []
    for worker, lines in rows.items():
        current: dict[str, list[float]] = {}  # path -> [begin, end], in first-seen order
        last_end: float | None = None
        for kind, t, nodeid in lines:
            path = nodeid.split("::", 1)[0]
            if kind == "start":
                span = current.setdefault(path, [last_end if last_end is not None else t, t])
                span[1] = max(span[1], t)
            else:
                current.setdefault(path, [t, t])[1] = t
                last_end = t
        out += [FileSpan(worker, p, b - t0, e - t0) for p, (b, e) in current.items()]
    return out


def summary(file_spans: Sequence[FileSpan], min_seconds: float = 0.0) -> str:
    """A Markdown table per worker (its files at least ``min_seconds`` long) and each worker's busy
    time and end, so that the gap between the workers' ends shows."""
    lines: list[str] = []
    workers = sorted({s.worker for s in file_spans})
    for w in workers:
        mine = [s for s in file_spans if s.worker == w]
        busy = sum(s.seconds for s in mine)
        lines += [f"### {w}: busy {busy:.1f} s, ends at {max(s.end for s in mine):.1f} s", ""]
        lines += ["| from (s) | to (s) | seconds | file |", "| ---: | ---: | ---: | --- |"]
        lines += [
            f"| {s.begin:.1f} | {s.end:.1f} | {s.seconds:.1f} | {s.path} |"
            for s in mine
            if s.seconds >= min_seconds
        ]
        lines.append("")
    ends = [max(s.end for s in file_spans if s.worker == w) for w in workers]
    lines.append(f"Last worker ends at {max(ends):.1f} s, the first at {min(ends):.1f} s.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help=f"the folder {ENV} named")
    parser.add_argument("--min-seconds", type=float, default=3.0, help="list files at least this long")
    args = parser.parse_args(argv)
    print(summary(spans(args.folder), args.min_seconds))


if __name__ == "__main__":
    main()
