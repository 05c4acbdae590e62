"""Progress of a run, per committed part of a batch: offsets done of those left, records, bytes,
rate and the time still to go.

On a terminal it is one line rewritten in place on stderr; anywhere else (a log file, Airflow's
task log, which captures spark-submit's output) every update is one JSON log line, so a log
pipeline can parse it. The figures are those of commits that landed, never of work in flight;
the rate counts from the run's first Spark job (``begin``), not from Spark's start-up. Batches
are numbered as the plan, the commit records and the run's log lines number them, from 0.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("oncemore.progress")


class Progress:
    def __init__(self, pipeline: str, batches: int, offsets: int, stream: TextIO | None = None):
        self.pipeline, self.batches, self.offsets = pipeline, batches, offsets
        self.stream = stream if stream is not None else sys.stderr
        self.started: float | None = None
        self.done = self.records = self.bytes = 0

    def begin(self) -> None:
        """The run's first Spark job starts now: the rate counts from here."""
        if self.started is None:
            self.started = time.monotonic()

    def advance(self, batch_seq: int, offsets: int, records: int, bytes_read: int) -> dict:
        """Counts one committed part of batch ``batch_seq`` and shows the totals so far."""
        self.done += offsets
        self.records += records
        self.bytes += bytes_read
        self.begin()
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.done / elapsed
        left = max(self.offsets - self.done, 0)
        figures = {
            "event": "progress", "pipeline": self.pipeline, "batch": batch_seq, "batches": self.batches,
            "offsets_done": self.done, "offsets_total": self.offsets, "records": self.records, "bytes": self.bytes,
            "records_per_second": round(rate, 1), "seconds": round(elapsed, 1),
            "eta_seconds": round(left / rate, 1) if rate > 0 else None,
        }
        if self.stream.isatty():
            end = "\n" if left == 0 else ""
            self.stream.write(f"\r{_line(figures)}\033[K{end}")
            self.stream.flush()
        else:
            log.info("%s", json.dumps(figures))
        return figures


def _line(f: dict) -> str:
    share = f["offsets_done"] / f["offsets_total"] if f["offsets_total"] else 1.0
    eta = f"{f['eta_seconds']:.0f}s" if f["eta_seconds"] is not None else "?"
    return (f"{f['pipeline']}: batch {f['batch']} (of {f['batches']}), {share:6.1%} of {f['offsets_total']:,} offsets, "
            f"{f['records']:,} records, {_size(f['bytes'])}, {f['records_per_second']:,.0f} records/s, ETA {eta}")


def _size(count: int) -> str:
    value, units = float(count), ["B", "KiB", "MiB", "GiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{value:.1f} {units[0]}"
