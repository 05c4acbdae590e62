"""A pipeline's records shaped in Spark: the decoded records as the view ``records``, the
transform (Spark SQL over the view, or a Python function DataFrame -> DataFrame), and one verdict
column per expectation, ready for the ``oncemore_delta`` sink.

Checked on Spark's own analysis of the query, before a record is read: it must parse and resolve
(Spark's error, named as the transform's); it must keep ``_kafka_topic``, ``_kafka_partition`` and
``_kafka_offset`` as they were read (the coordinates every row is counted by); and it must map a
record to at most one row: no aggregation, generator (explode), join, set operation, distinct,
limit or sample. The sink's accounting refuses a commit where a partition has more rows than
records all the same (partcommit.py), so a transform that slips past these checks still cannot
duplicate a record.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import threading
from typing import Callable

from .config import Pipeline, PythonTransform
from .errors import OncemoreError

COORDINATES = ("_kafka_topic", "_kafka_partition", "_kafka_offset")
VERDICT_PREFIX = "_oncemore_expect_"
# Logical plan nodes that make several rows of one, or one of several.
_MULTIPLYING = {
    "Aggregate": "aggregates", "Generate": "explodes records into rows (a generator)", "Join": "joins",
    "Union": "unions", "Intersect": "intersects", "Except": "subtracts", "Distinct": "removes duplicates",
    "Deduplicate": "removes duplicates", "DeduplicateWithinWatermark": "removes duplicates",
    "GlobalLimit": "limits", "LocalLimit": "limits", "Offset": "skips rows (OFFSET)", "Tail": "limits",
    "Sample": "samples", "Expand": "expands rows (GROUPING SETS, CUBE, ROLLUP, UNPIVOT)",
    "MapPartitions": "maps partitions", "MapInPandas": "maps partitions", "MapInArrow": "maps partitions",
    "FlatMapGroupsInPandas": "maps groups", "FlatMapGroupsInArrow": "maps groups", "CoGroup": "cogroups",
}
_VIEW = threading.Lock()
_NODE = re.compile(r"^[\s:|+-]*([A-Z][A-Za-z]+)")
_COORDINATE = re.compile(r"\b(_kafka_topic|_kafka_partition|_kafka_offset)#(\d+)")


class TransformRefused(OncemoreError):
    """The transform cannot be run as part of an exactly-once ingestion (or does not resolve)."""


def shape(session, records, pipeline: Pipeline):
    """``records`` (a DataFrame of the records schema) transformed, checked, and with a verdict
    column per expectation (TRUE when the row satisfies it; FALSE or NULL fails it)."""
    where = f"pipeline {pipeline.name}: transform"
    try:
        shaped = _transformed(session, records, pipeline.transform)
        missing = [c for c in COORDINATES if c not in shaped.columns]
    except TransformRefused:
        raise
    except Exception as exc:  # Spark's own error: a query that does not parse or resolve
        raise TransformRefused(f"{where}: {_first_line(exc)}") from None
    if missing:
        raise TransformRefused(f"{where}: drops {', '.join(missing)}; every row must keep the coordinates of its "
                               "record (select them, or SELECT *)", missing=missing)
    plan = _analyzed(shaped)
    for line in plan.splitlines()[1:]:
        node = _NODE.match(line)
        if node and node.group(1) in _MULTIPLYING:
            raise TransformRefused(f"{where}: {_MULTIPLYING[node.group(1)]} ({node.group(1)} in Spark's plan); a "
                                   "record must map to at most one row", node=node.group(1))
    coordinates = _analyzed(shaped.select(*COORDINATES)).splitlines()
    kept, read = dict(_COORDINATE.findall(coordinates[1])), dict(_COORDINATE.findall(coordinates[-1]))
    changed = [c for c in COORDINATES if kept.get(c) != read.get(c)]
    if changed:
        raise TransformRefused(f"{where}: computes {', '.join(changed)} anew; every row must keep the coordinates of "
                               "its record as they were read", changed=changed)
    from pyspark.sql import functions as F

    for i, expectation in enumerate(pipeline.expectations):
        try:
            verdict = F.coalesce(F.expr(f"({expectation.check})").cast("boolean"), F.lit(False))
            shaped.select(verdict).schema  # resolves the predicate against the transformed rows
        except Exception as exc:
            raise TransformRefused(f"pipeline {pipeline.name}: expectation {expectation.name}: "
                                   f"{_first_line(exc)}", expectation=expectation.name) from None
        shaped = shaped.withColumn(f"{VERDICT_PREFIX}{i}", verdict)
    return shaped


def _transformed(session, records, transform):
    if transform is None:
        return records
    if isinstance(transform, PythonTransform):
        return _function(transform.python)(records)
    # The view is the session's: runs sharing one (threads of one application) take turns, and
    # the query resolves it at once (a Spark Connect session is the client's own).
    with _VIEW:
        records.createOrReplaceTempView("records")
        shaped = session.sql(transform)
        shaped.schema
        return shaped


def _function(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise TransformRefused(f"transform python {spec}: {type(exc).__name__}: {exc}", python=spec) from None


def _analyzed(frame) -> str:
    """The analyzed logical plan of ``frame``, as Spark prints it (classic and Spark Connect alike)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        frame.explain(mode="extended")
    text = out.getvalue()
    return text[text.index("== Analyzed Logical Plan ==") + len("== Analyzed Logical Plan ==\n"):
                text.index("== Optimized Logical Plan ==")].strip()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
