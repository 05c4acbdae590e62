"""Rows counted by the hour of their Kafka timestamp, [written, quarantined] per hour: what a commit
records (``CommitInfo.hours``), so the oncemore page charts records by when they were produced, as
Airflow users read data intervals, not by when a (catch-up) run committed them.

Hours are keyed by their start as ISO-8601 text (``2026-11-25T10:00:00Z``). A row without a
timestamp (null, or a transform that dropped ``_kafka_timestamp``) or with one outside the years 1 to
9999 that ISO text holds (a producer stamping microseconds as milliseconds) is not counted: the page
places what a commit's hours leave out at the commit's own time, so every record is charted once.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from functools import lru_cache
from typing import Mapping

import pyarrow as pa
import pyarrow.compute as pc

WRITTEN, QUARANTINED = 0, 1
_HOUR_US = 3_600_000_000
# A commit whose records span more hours than this keeps no hours (its record stays small): the page
# charts it at its commit time.
MAX_HOURS = 24 * 31
# The hours ISO-8601 text (Python's datetime) can name: 0001-01-01T00 to 9999-12-31T23.
_FIRST_HOUR = int(datetime(1, 1, 1, tzinfo=timezone.utc).timestamp()) // 3600
_LAST_HOUR = int(datetime(9999, 12, 31, 23, tzinfo=timezone.utc).timestamp()) // 3600

Hours = dict[str, list[int]]  # {hour: [written, quarantined]}


def hour_text(epoch_hour: int) -> str:
    return datetime.fromtimestamp(epoch_hour * 3600, tz=timezone.utc).isoformat().replace("+00:00", "Z")


@lru_cache(maxsize=4096)  # the page reads the same hours from many commits
def hour_ms(text: str) -> int:
    """The hour's start in epoch milliseconds."""
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def count(into: Hours, timestamps: pa.Array | pa.ChunkedArray | None, slot: int) -> None:
    """Adds each row of ``timestamps`` to its hour's ``slot`` (WRITTEN or QUARANTINED) in ``into``;
    a column that is not a timestamp counts nothing."""
    if timestamps is None or not pa.types.is_timestamp(timestamps.type) or len(timestamps) == 0:
        return
    micros = timestamps.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
    bounds = pc.min_max(micros).as_py()
    if bounds["min"] is None:
        return
    first, last = bounds["min"] // _HOUR_US, bounds["max"] // _HOUR_US
    if first == last and _FIRST_HOUR <= first <= _LAST_HOUR:  # the common case: a batch within one hour
        into.setdefault(hour_text(first), [0, 0])[slot] += len(micros) - micros.null_count
        return
    # Arrow's integer division truncates towards zero: an hour before 1970 starts one lower.
    hours = pc.divide(pc.subtract(micros, pc.if_else(pc.less(micros, 0), _HOUR_US - 1, 0)), _HOUR_US)
    hours = pc.filter(hours, pc.and_(pc.greater_equal(hours, _FIRST_HOUR), pc.less_equal(hours, _LAST_HOUR)))
    for found in pc.value_counts(pc.drop_null(hours)).to_pylist():
        into.setdefault(hour_text(found["values"]), [0, 0])[slot] += found["counts"]


def merged(*counts: Mapping[str, list[int]]) -> Hours:
    """The sum of several ``Hours``; {} when they span more than MAX_HOURS hours."""
    total: dict[str, Counter] = {}
    for hours in counts:
        for hour, figures in hours.items():
            total.setdefault(hour, Counter()).update(dict(enumerate(figures)))
    if len(total) > MAX_HOURS:
        return {}
    return {hour: [total[hour][WRITTEN], total[hour][QUARANTINED]] for hour in sorted(total)}
