"""Where a run's time goes: milliseconds per phase, kept by the run (its log line, ``oncemore run
--profile``) and by each commit record (``CommitInfo.profile``).

The phases, in the order they happen:
- ``plan``: Kafka's offsets and the Delta log read, the batches planned;
- ``spark_start``: the Spark session (JVM start, or a Spark Connect session);
- ``prepare``: formats resolved (the registry asked), the tables made ready, a transform analysed;
- ``spark_job``: each part's Spark job, wall clock from its submission to its commit:
  scheduling, Python workers and the tasks, whose own work is the next three phases;
- ``read``, ``decode``, ``write``: task time (summed over tasks, which run side by side): Kafka
  fetches, records decoded to Arrow, Parquet files written (both tables');
- ``validate``: the written files checked against the table and the ranges;
- ``commit``: the Delta commits (quarantine, then main), positions re-checked;
- ``mirror``: the positions mirrored to the consumer group;
- ``catalog``: the tables registered in the catalog (``sink.catalog``), once at the run's end.

Invariant: the phases of a run are counted once. The run-level ones (plan, spark_start, prepare)
go into the record of the run's first commit that lands, no other; a record holds what happened
before its commits (their own time is in the run's profile, the sum of its parts' and its own).
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Mapping

PHASES = ("plan", "spark_start", "prepare", "spark_job", "read", "decode", "write", "validate", "commit", "mirror",
          "catalog")
TASK_PHASES = ("read", "decode", "write")
RUN_PHASES = ("plan", "spark_start", "prepare")


class Stopwatch:
    """Seconds per phase, added up over every time a phase is timed."""

    def __init__(self) -> None:
        self.seconds: Counter = Counter()

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - started

    def add_ms(self, profile: Mapping[str, int]) -> None:
        for phase, ms in profile.items():
            self.seconds[phase] += ms / 1000

    def ms(self, phases: tuple[str, ...] = PHASES) -> dict[str, int]:
        """Milliseconds per phase of ``phases`` that were timed, in the order phases happen."""
        return {p: round(self.seconds[p] * 1000) for p in phases if p in self.seconds}


def one_line(profile: Mapping[str, int]) -> str:
    """``plan 0.12s, spark_start 8.31s, ...`` for a log line."""
    return ", ".join(f"{p} {profile[p] / 1000:.2f}s" for p in PHASES if p in profile)


def as_table(profile: Mapping[str, int], total_seconds: float) -> str:
    """The profile as ``oncemore run --profile`` prints it: a line per phase, the task phases
    indented under the Spark job they ran in."""
    lines = [f"{'phase':<16} {'seconds':>8}"]
    for phase in PHASES:
        if phase in profile:
            name = f"  {phase} (tasks)" if phase in TASK_PHASES else phase
            lines.append(f"{name:<16} {profile[phase] / 1000:>8.2f}")
    lines.append(f"{'run (wall)':<16} {total_seconds:>8.2f}")
    return "\n".join(lines)
