"""A pipeline's records shaped in Spark: the decoded records as the view ``records``, the
transform (Spark SQL over the view, or a Python function DataFrame -> DataFrame), and one verdict
column per expectation, ready for the sink's tasks.

Checked on Spark's own analysis of the query, before a record is read: it must parse and resolve
(Spark's error, named as the transform's); it must keep ``_kafka_topic``, ``_kafka_partition`` and
``_kafka_offset`` as they were read (the coordinates every row is counted by), and make no column
named like an expectation's verdict (``_oncemore_expect_...``); and each row must
come from one record: the plan from the output down to its one source, the records, is made only
of nodes that keep or drop rows one by one (projections, filters, windows, sorts, repartitions,
aliases, views, common table expressions). Anything else (an aggregate, a generator, any join or
set operation, distinct, limit, sample, an RDD's rows, ``mapInPandas``) is refused by name.
Subqueries in expressions may read anything: they compute values, never rows. The sink's
accounting refuses a commit where a partition has more rows than records all the same
(commit/part.py).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import threading
from dataclasses import dataclass, field
from typing import Callable

from oncemore.config.model import Pipeline, PythonTransform
from oncemore.core.columns import VERDICT_PREFIX
from oncemore.core.errors import OncemoreError
from oncemore.shape.changes import change_rows

COORDINATES = ("_kafka_topic", "_kafka_partition", "_kafka_offset")
# Logical plan nodes that keep or drop rows one by one (on the way from the output to the records).
_ROW_BY_ROW = {"Project", "Filter", "SubqueryAlias", "View", "Sort", "Repartition", "RepartitionByExpression",
               "RebalancePartitions", "Window", "ResolvedHint", "WithCTE", "CTERelationDef"}
# Why common others are refused.
_REFUSED = {
    "LateralJoin": "joins (LATERAL)", "LogicalRDD": "reads an RDD's rows, not the records",
    "LocalRelation": "reads rows of its own, not the records", "Aggregate": "aggregates",
    "Generate": "explodes records into rows (a generator)", "Join": "joins",
    "Union": "unions", "Intersect": "intersects", "Except": "subtracts", "Distinct": "removes duplicates",
    "Deduplicate": "removes duplicates", "DeduplicateWithinWatermark": "removes duplicates",
    "GlobalLimit": "limits", "LocalLimit": "limits", "Offset": "skips rows (OFFSET)", "Tail": "limits",
    "Sample": "samples", "Expand": "expands rows (GROUPING SETS, CUBE, ROLLUP, UNPIVOT)",
    "MapPartitions": "maps partitions", "MapInPandas": "maps partitions", "MapInArrow": "maps partitions",
    "FlatMapGroupsInPandas": "maps groups", "FlatMapGroupsInArrow": "maps groups", "CoGroup": "cogroups",
}
_VIEW = threading.Lock()
_NODE = re.compile(r"^((?:[ :][ ] |[+:]- )*)([A-Z][A-Za-z0-9]+)(.*)$")
_CTE = re.compile(r"^(?:CTERelationDef|CTERelationRef) (\d+)")
_COORDINATE = re.compile(r"\b(_kafka_topic|_kafka_partition|_kafka_offset)#(\d+)")
# How Spark's plan names the records: the function run/kafkasource.RecordsTasks over a range of task indexes.
RECORDS_NODE = "MapInArrow RecordsTasks("


class TransformRefused(OncemoreError):
    """The transform cannot be run as part of an exactly-once ingestion (or does not resolve)."""


def shape(session, records, pipeline: Pipeline):
    """``records`` (a DataFrame of the records schema) transformed, checked, and with a verdict
    column per expectation (TRUE when the row satisfies it; FALSE or NULL fails it); an upsert's
    records as change rows (changes.py)."""
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
    ours = [c for c in shaped.columns if c.lower().startswith(VERDICT_PREFIX)]
    if ours:  # an expectation's verdict would replace it, and the table would never have it
        raise TransformRefused(f"{where}: makes column {ours[0]}; names starting with {VERDICT_PREFIX} are "
                               "oncemore's (expectations' verdicts): rename it", column=ours[0])
    plan = _analyzed(shaped.select(*COORDINATES))
    source = _records_source(plan, where)
    kept, read = dict(_COORDINATE.findall(plan.splitlines()[1])), dict(_COORDINATE.findall(source.text))
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
    if pipeline.upsert is not None:
        shaped = change_rows(shaped, pipeline)
    return shaped


@dataclass
class _PlanNode:
    name: str
    text: str  # the node's line, without the tree drawing
    children: list["_PlanNode"] = field(default_factory=list)


def _plan_tree(plan: str) -> _PlanNode:
    """Spark's printed plan as a tree of its regular children. Spark draws a node's children one
    level deeper and the plans of its subquery expressions two levels deeper, before them: a line
    two levels under the last node with nothing in between is such a plan, which is left out."""
    root = None
    last_at: dict[int, _PlanNode | None] = {}  # the last node drawn at each depth; None: in a subquery's plan
    for line in plan.splitlines()[1:]:  # the first line is the output's schema
        found = _NODE.match(line)
        if not found:
            continue
        depth = len(found.group(1)) // 3
        node = _PlanNode(found.group(2), found.group(2) + found.group(3))
        if depth == 0:
            root = node
        elif last_at.get(depth - 1) is None:  # a subquery expression's plan, or a node inside one
            node = None
        else:
            last_at[depth - 1].children.append(node)
        last_at = {d: n for d, n in last_at.items() if d < depth}
        last_at[depth] = node
    return root


def _records_source(plan: str, where: str) -> _PlanNode:
    """The records' relation at the end of the plan's path from its output, every node on the way
    keeping rows one by one (module docstring); else TransformRefused naming the node."""
    definitions: dict[str, _PlanNode] = {}
    node = _plan_tree(plan)
    while True:
        if node.text.startswith(RECORDS_NODE) and [c.name for c in node.children] == ["Range"]:
            return node
        if node.name == "CTERelationRef":  # a common table expression: on through its definition
            node = definitions.get(_CTE.match(node.text).group(1), node)
        if node.name not in _ROW_BY_ROW or not node.children:
            why = _REFUSED.get(node.name, "is not one oncemore can count records through")
            raise TransformRefused(f"{where}: {why} ({node.name} in Spark's plan); each row must come from one "
                                   "record, through projections, filters, windows, sorts and repartitions",
                                   node=node.name)
        if node.name == "WithCTE":
            for definition in node.children[:-1]:
                definitions[_CTE.match(definition.text).group(1)] = definition
        node = node.children[-1]


def _transformed(session, records, transform):
    if transform is None:
        return records
    if isinstance(transform, PythonTransform):
        return _function(transform.python)(records)
    # The view is the session's: runs sharing a classic session (threads of one application) take
    # turns, and the query resolves it at once. A Spark Connect query resolves it only when it
    # runs, so a Connect session serves one run at a time (connectslots.py) and nothing shares it.
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


def reads_records(frame) -> bool:
    """Whether running ``frame`` reads the records: Spark's optimizer drops the scan of rows it
    proves are never kept (``WHERE 1 = 0``), and then no record would be read or accounted."""
    plan = _explained(frame, "Optimized Logical Plan", "Physical Plan")
    nodes = (_NODE.match(line) for line in plan.splitlines())
    return any(node and (node.group(2) + node.group(3)).startswith(RECORDS_NODE) for node in nodes)


def _analyzed(frame) -> str:
    return _explained(frame, "Analyzed Logical Plan", "Optimized Logical Plan")


def _explained(frame, section: str, following: str) -> str:
    """One section of the plans Spark prints for ``frame`` (classic and Spark Connect alike)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        frame.explain(mode="extended")
    text = out.getvalue()
    return text[text.index(f"== {section} ==") + len(f"== {section} ==\n"):text.index(f"== {following} ==")].strip()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
