"""``oncemore check --sample N``: the latest N offsets of each partition read through the pipeline's
formats, transform and expectations as a run reads them, writing nothing: what a run would write,
quarantine (grouped by reason: how many, where, the first record) and filter, and whether a batch
like it passes the pipeline's ``quarantine`` limit (commit/share.py).

Invariant: nothing is written anywhere, and both table locations stay as they are. The records are
read by a consumer that joins no group and commits nothing, decoded in this process by the run's
own decoder (run/tasks.py's sample_ranges keeps the quarantine rows instead of writing them); a
pipeline that shapes records in Spark has the same ranges read again by the run's reading tasks
without a staging area, which then write no file (run/kafkasource.RecordsTasks), and its rows are
judged by the sink's own rules (run/deltasink.py's classified).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from oncemore.commit.share import QuarantineLimit, commonest, reason_kind, share_text, value_head
from oncemore.config.model import Pipeline
from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN, QUARANTINE_TAG, TOPIC_COLUMN
from oncemore.core.coordinates import KafkaPartition, OffsetRange
from oncemore.core.errors import OncemoreError
from oncemore.decode.resolve import registries, resolve
from oncemore.kafka import clients
from oncemore.kafka.batches import RangeRecords
from oncemore.ops.check import Check
from oncemore.ops.check import _cause as cause  # one way to say a failed check's cause
from oncemore.run.prepare import Prepared, PreparedTable, table_schema
from oncemore.run.tasks import sample_ranges

# Offset runs shown per kind of reason.
RUNS_SHOWN = 4


@dataclass
class Sample:
    """What a run would make of the sampled ranges."""

    ranges: dict[KafkaPartition, tuple[int, int]]
    records: int = 0
    written: int = 0
    filtered: int = 0
    unrouted: int = 0  # no route took them, and the pipeline skips those
    quarantined: list[tuple[str, str, int, int]] = field(default_factory=list)  # (reason, topic, partition, offset)
    values: dict[tuple[str, int, int], bytes | None] = field(default_factory=dict)  # the records' bytes, by coordinates
    run_fails: str | None = None  # why a run would fail on these records (an expectation with on_fail: fail, ...)
    ahead: list[str] = field(default_factory=list)  # records whose writer schema the reader lacks: read up to them


def sample_checks(pipeline: Pipeline, count: int, spark_factory: Callable[[], object]) -> list[Check]:
    """The sample of ``count`` offsets per partition as check lines: the verdict, then one line per
    kind of reason, commonest first."""
    try:
        found = sample(pipeline, count, spark_factory)
    except Exception as exc:  # Kafka, the registry, a transform: the cause, as every check says it
        return [Check(pipeline.name, "sample", cause(exc))]
    return _lines(pipeline, count, found)


def sample(pipeline: Pipeline, count: int, spark_factory: Callable[[], object]) -> Sample:
    """Reads and judges the latest ``count`` offsets of each partition (module docstring)."""
    admin = clients.admin_client(pipeline)
    source = clients.describe_source(admin, pipeline)
    bounds = clients.log_bounds(admin, pipeline, source.partitions)
    ranges = {p: (max(b.earliest, b.latest - count), b.latest) for p, b in sorted(bounds.items())
              if b.latest > b.earliest}
    found = Sample(ranges)
    if not ranges:
        return found
    settings = registries(pipeline)
    tables = {}
    for table in pipeline.tables:  # with routes, each route's records as its own format reads them
        records = resolve(pipeline, sorted(source.identities), table)
        tables[table.tag] = PreparedTable(records, table_schema(pipeline, records, settings, spark_factory, table))
    prepared = Prepared(tables, settings)
    # Floors 0: every row kept here, none taken for held by a table.
    spec = prepared.task_spec(pipeline, {tag: {p: 0 for p in ranges} for tag in [*tables, QUARANTINE_TAG]})
    stall = pipeline.source.stall_timeout_seconds
    with clients.range_consumer(clients.consumer_config(pipeline), pipeline.name) as consumer:
        read = (RangeRecords(consumer, p.topic, p.partition, start, end, stall, f"pipeline {pipeline.name}: {p}",
                             headers=spec.reads_headers) for p, (start, end) in ranges.items())
        results, good, bad = sample_ranges(read, spec, spec.decoders(), not pipeline.shapes_in_spark)
    found.records = sum(r.records for r in results)
    found.unrouted = sum(r.unrouted for r in results)
    found.ahead = [r.schema_ahead for r in results if r.schema_ahead is not None]
    _quarantine(found, bad.column("error").to_pylist(), bad)
    found.values = {(t, p, o): v for t, p, o, v in zip(*(bad.column(c).to_pylist() for c in (
        TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN, "value")))}
    decoded = sum(t.num_rows for _, t in good)
    if not pipeline.shapes_in_spark or not decoded:
        found.written = decoded
        return found
    shaped = _shaped(pipeline, spark_factory(), spec, ranges)
    if shaped is None:  # Spark proved the transform keeps no row
        found.filtered = decoded
        return found
    found.filtered = decoded - shaped.num_rows
    from oncemore.run.deltasink import classified

    expectations = [{"name": e.name, "on_fail": e.on_fail} for e in pipeline.expectations]
    try:
        rows, errors = classified(shaped, pipeline.name, expectations, pipeline.upsert and pipeline.upsert.keys, spec.table_schema,
                                  pipeline.sink.partition_by, Counter())
    except OncemoreError as exc:  # ExpectationFailed, TruncateRefused: what a run would fail on
        found.run_fails = str(exc)
        return found
    failing = sorted(errors)
    _quarantine(found, [errors[i] for i in failing], rows.take(failing))
    found.written = rows.num_rows - len(failing)
    return found


def _shaped(pipeline: Pipeline, spark, spec, ranges: dict[KafkaPartition, tuple[int, int]]) -> pa.Table | None:
    """The ranges' good records shaped by the transform (with the expectations' verdicts), read by
    the run's reading tasks writing nothing; None when Spark proves the transform keeps no row."""
    from oncemore.run.jobs import reading_options
    from oncemore.run.kafkasource import records_frame, records_schema
    from oncemore.shape.transform import reads_records, shape

    groups = [[OffsetRange(p.topic, p.partition, start, end)] for p, (start, end) in ranges.items()]
    records = records_frame(spark, reading_options(pipeline, spec, groups, 1 << 62), records_schema(spec))
    shaped = shape(spark, records, pipeline)
    return shaped.toArrow() if reads_records(shaped) else None


def _quarantine(found: Sample, reasons: list[str], rows: pa.Table) -> None:
    coordinates = zip(*(rows.column(c).to_pylist() for c in (TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN)))
    found.quarantined += [(reason, *where) for reason, where in zip(reasons, coordinates)]


def _lines(pipeline: Pipeline, count: int, found: Sample) -> list[Check]:
    name, what = pipeline.name, "sample"
    if not found.ranges:
        return [Check(name, what, None, "every partition is empty: nothing to read")]
    read = (f"the latest {count} offsets of {len(found.ranges)} partition(s) read, nothing written: "
            f"{found.records} records")
    if found.ahead:  # a run evolves the table for such a writer (or refuses it) and reads on
        read += f" (read up to the first record of a newer writer schema: {', '.join(found.ahead)})"
    if found.run_fails:
        return [Check(name, what, f"{read}; a run would fail on them: {found.run_fails}")] + _reasons(name, found, True)
    quarantined = len(found.quarantined)
    limit = QuarantineLimit(pipeline.quarantine.max_fraction, pipeline.quarantine.min_quarantined)
    figures = (f"{read}, {found.written} would be written, {share_text(quarantined, found.records)}, "
               f"{found.filtered} filtered" + (f", {found.unrouted} unrouted (skipped)" if found.unrouted else ""))
    if limit.exceeded(quarantined, found.records):
        verdict = Check(name, what, f"{figures}: more than the limit of {limit.max_fraction:.0%} "
                                    "(quarantine.max_fraction): a run would fail on a batch like this")
    else:
        verdict = Check(name, what, None, f"{figures}; within the quarantine limit of {limit.max_fraction:.0%}")
    return [verdict] + _reasons(name, found, verdict.ok)


def _reasons(name: str, found: Sample, ok: bool) -> list[Check]:
    """One line per kind of reason: how many, the offsets (runs per partition), the first record."""
    where: dict[str, dict[tuple[str, int], list[int]]] = {}
    for reason, topic, partition, offset in found.quarantined:
        where.setdefault(reason_kind(reason), {}).setdefault((topic, partition), []).append(offset)
    lines = []
    for reason in commonest(((r, t, p, o) for r, t, p, o in found.quarantined), shown=len(where)):
        runs = [f"{t}/{p} {_runs(sorted(offsets))}" for (t, p), offsets in sorted(where[reason.kind].items())]
        shown = "; ".join(runs[:RUNS_SHOWN]) + (f"; and {len(runs) - RUNS_SHOWN} more partitions"
                                                 if len(runs) > RUNS_SHOWN else "")
        first = min((t, p, o) for (t, p), offsets in where[reason.kind].items() for o in offsets)
        value = found.values.get(first)
        head = f", value {value_head(value)!r}" if first in found.values else ""
        problem = f"{reason.count} x {reason.kind} at {shown} (first: {reason.first}{head})"
        lines.append(Check(name, "would quarantine", None if ok else problem, problem))
    return lines


def _runs(offsets: list[int]) -> str:
    """Offsets as runs of consecutive ones: ``[0, 200)``, ``17``, ``[40, 42), 90``."""
    runs: list[list[int]] = []
    for offset in offsets:
        if runs and offset == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([offset, offset + 1])
    shown = [f"[{s}, {e})" if e - s > 1 else str(s) for s, e in runs[:RUNS_SHOWN]]
    return ", ".join(shown) + (f", ... ({len(runs) - RUNS_SHOWN} more runs)" if len(runs) > RUNS_SHOWN else "")
