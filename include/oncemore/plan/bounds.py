"""Where ranges start and end: ``earliest``, ``latest``, per-partition offsets, or a record
timestamp, resolved to one offset per partition. No Spark.

A timestamp T ends a partition's range at the first *data record* stamped at or after T (the
offsetsForTimes rule of Kafka and of Spark's Kafka source). Records after it that carry older
timestamps (out of order) go with the next range: the attribution depends on the log alone, so
every rerun resolves the same offset. Kafka's ListOffsets counts transaction markers too, and
markers carry the broker's clock, so when backdated records were produced inside transactions
its answer can be a marker long before the real boundary; it is therefore only where reading
starts: the boundary is the first data record at or after it (and at or after the range start)
whose timestamp is >= T, or the last stable offset if there is none.

The one way a timestamp bound could stop a partition for good is a record stamped after the
wall clock sitting at the position with older records behind it: no scheduled bound passes it
until the clock does. That fails the run (BoundStalled), naming the offsets.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

from confluent_kafka.admin import AdminClient

from oncemore.config.model import Pipeline
from oncemore.config.values import OffsetBound, format_timestamp_ms
from oncemore.core.coordinates import KafkaPartition, describe
from oncemore.core.errors import BoundStalled, PlanError
from oncemore.kafka import clients
from oncemore.kafka.clients import PartitionBounds

# How far past a future-stamped record the stall check looks for older ones.
STALL_LOOKAHEAD_RECORDS = 10_000
_SCAN_THREADS = 8


def resolve(
    admin: AdminClient,
    pipeline: Pipeline,
    bound: OffsetBound,
    bounds: Mapping[KafkaPartition, PartitionBounds],
    range_starts: Mapping[KafkaPartition, int | None],
    default: Mapping[KafkaPartition, int | None],
) -> dict[KafkaPartition, int | None]:
    """``bound`` as an offset per partition.

    ``range_starts``: where each partition's range begins (None: not known yet); a timestamp is
    resolved at or after it. ``default`` serves partitions that explicit offsets do not name.
    """
    if bound.kind == "earliest":
        return {p: b.earliest for p, b in bounds.items()}
    if bound.kind == "latest":
        return {p: b.latest for p, b in bounds.items()}
    if bound.kind == "timestamp":
        return _resolve_timestamp(admin, pipeline, bound.timestamp_ms, bounds, range_starts)
    try:
        offsets = bound.for_topics({p.topic for p in bounds})
    except ValueError as exc:
        raise PlanError(f"pipeline {pipeline.name}: {exc}", pipeline=pipeline.name) from None
    unknown = sorted(set(offsets) - set(bounds))
    if unknown:
        raise PlanError(
            f"pipeline {pipeline.name}: {unknown[0]}: no such partition among the pipeline's ({describe(bounds)})",
            pipeline=pipeline.name, topic=unknown[0].topic, partition=unknown[0].partition,
        )
    return {p: offsets.get(p, default[p]) for p in bounds}


def _resolve_timestamp(
    admin: AdminClient,
    pipeline: Pipeline,
    timestamp_ms: int,
    bounds: Mapping[KafkaPartition, PartitionBounds],
    range_starts: Mapping[KafkaPartition, int | None],
) -> dict[KafkaPartition, int]:
    candidates = clients.offsets_for_timestamp(admin, pipeline, timestamp_ms, bounds)
    resolved: dict[KafkaPartition, int] = {}
    scans: dict[KafkaPartition, tuple[int, int]] = {}
    for p, log in bounds.items():
        floor = min(max(range_starts.get(p) or log.earliest, log.earliest), log.latest)
        if candidates[p] is None:  # nothing at or after the bound below the last stable offset
            resolved[p] = log.latest
        elif max(candidates[p], floor) >= log.latest:
            resolved[p] = log.latest
        else:
            scans[p] = (max(candidates[p], floor), log.latest)
    at_or_after = lambda stamp: stamp >= timestamp_ms  # noqa: E731
    found = first_matching(pipeline, scans, at_or_after)
    for p, (begin, end) in scans.items():
        resolved[p] = found[p][0] if found[p] is not None else end
    _check_not_stalled(pipeline, timestamp_ms, bounds, range_starts, resolved, found)
    return resolved


def _check_not_stalled(pipeline, timestamp_ms, bounds, range_starts, resolved, found) -> None:
    """Fails when a partition would stay at its position behind a record stamped in the future
    while records older than the bound wait after it (see the module docstring)."""
    now_ms = int(time.time() * 1000)
    blocked = {
        p: found[p] for p, position in range_starts.items()
        if position is not None and resolved.get(p) == position < bounds[p].latest
        and found.get(p) is not None and found[p][1] > now_ms
    }
    older = first_matching(
        pipeline, {p: (offset + 1, bounds[p].latest) for p, (offset, _) in blocked.items()},
        lambda stamp: stamp < timestamp_ms, limit=STALL_LOOKAHEAD_RECORDS,
    )
    for p, hit in sorted(older.items()):
        if hit is None:
            continue
        (offset, stamp), (older_offset, older_stamp) = blocked[p], hit
        raise BoundStalled(
            f"pipeline {pipeline.name}: {p}: the record at offset {offset} (the position) is stamped "
            f"{format_timestamp_ms(stamp)}, after the bound {format_timestamp_ms(timestamp_ms)} and after now, "
            f"while offset {older_offset} behind it is stamped {format_timestamp_ms(older_stamp)}: no timestamp "
            f"bound passes it before that time. Ingest past it with an offset bound, e.g. "
            f"`oncemore run {pipeline.name} --until latest`.",
            pipeline=pipeline.name, topic=p.topic, partition=p.partition, position=offset, blocking_timestamp=stamp,
            older_offset=older_offset, older_timestamp=older_stamp, bound=timestamp_ms,
        )


def first_matching(
    pipeline: Pipeline, ranges: Mapping[KafkaPartition, tuple[int, int]], predicate: Callable[[int], bool],
    limit: int | None = None,
) -> dict[KafkaPartition, tuple[int, int] | None]:
    """Per partition, (offset, timestamp ms) of the first data record in [begin, end) whose
    timestamp satisfies ``predicate``; None if there is none (within ``limit`` records)."""
    if not ranges:
        return {}
    config = clients.consumer_config(pipeline)

    def scan(item):
        partition, (begin, end) = item
        where = f"pipeline {pipeline.name}: {partition}"
        seen = 0
        with clients.range_consumer(config, pipeline.name) as consumer:
            for messages in clients.read_messages(consumer, partition.topic, partition.partition, begin, end,
                                                pipeline.source.stall_timeout_seconds, where):
                for message in messages:
                    stamp = message.timestamp()[1]
                    if predicate(stamp):
                        return partition, (message.offset(), stamp)
                seen += len(messages)
                if limit is not None and seen >= limit:
                    break
        return partition, None

    # librdkafka works outside the GIL: partitions are scanned side by side.
    with ThreadPoolExecutor(max_workers=min(_SCAN_THREADS, len(ranges))) as pool:
        return dict(pool.map(scan, ranges.items()))
