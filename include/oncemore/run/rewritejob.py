"""The Spark jobs of an upsert part's MERGE on the cluster (``upsert.merge: cluster``): one Spark
task per task commit/copyonwrite.py planned, each running on an executor: the key scan
(write/keyscan.py) the classification and the copy-on-write start from, then the rewrite
(write/rewrite.py).

The run's own program starts it, after the part's job and before its commits (jobs.py). A job
over ``spark.range`` with one row per partition and ``mapInArrow`` runs on a classic session and on
Spark Connect alike; the tasks' inputs are their JSON (the part's keys and
change rows, and the scan's matches, are staged files, not rows sent through Spark), their results
one JSON row each. A failed job fails the part before its commit, naming the part's ranges; the
files its finished tasks wrote are in no commit (vacuum removes them).

The tasks' function captures the table's storage options, credentials included, as its pickle
(cloudpickle) in the job's plan. That shows them nowhere Spark records a job: a plan names the
function only (``MapInArrow each(id)``: EXPLAIN, the SQL tab, the event log), Spark Connect's
statement text keeps 8 bytes of the pickle (its proto Abbreviator cuts every bytes field), and a
failed task reports its traceback, code without values. The one place that prints the pickle
whole, PySpark's Connect client at DEBUG, prints every data source option's value too: credentials
moved from the closure into options (``storage.*``, masked by Spark's redaction elsewhere) would
show there all the same, so that client logs at INFO in oncemore's runs (session.py).
"""

from __future__ import annotations

from typing import Callable, Mapping

import pyarrow as pa

from oncemore.commit.copyonwrite import ClusterRewrite
from oncemore.commit.inputs import Part
from oncemore.core.errors import TaskFailed, root_cause
from oncemore.run.session import slots
from oncemore.write.keyscan import ScanResult, ScanTask, scan
from oncemore.write.rewrite import RewriteResult, RewriteTask, rewrite


def cluster_rewrite(spark, part: Part, storage_options: Mapping[str, str] | None) -> ClusterRewrite:
    """How ``part``'s MERGE scans the table's keys and rewrites its touched files on ``spark``'s
    cluster; its keys and change rows are staged beside the part's own (the staging area, removed
    with the part)."""
    options = dict(storage_options or {})

    def on_cluster(tasks: list, kind: type, work: Callable, result: type, doing: str) -> list:
        texts = [t.to_json() for t in tasks]

        def each(batches):  # on the executor: ``work`` and ``kind`` travel by reference (oncemore is importable there)
            for batch in batches:
                done = [work(kind.from_json(texts[i]), options).to_json() for i in batch.column("id").to_pylist()]
                yield pa.RecordBatch.from_arrays([pa.array(done, pa.string())], names=["result"])

        return [result.from_json(r) for r in _collect(spark, part, len(texts), each, doing)]

    return ClusterRewrite(
        lambda tasks: on_cluster(tasks, RewriteTask, rewrite, RewriteResult, "rewriting the table's files for its upserts"),
        lambda tasks: on_cluster(tasks, ScanTask, scan, ScanResult, "scanning the table's keys for its upserts"),
        f"{part.changes_uri}-rewrite", storage_options, slots(spark))


def _collect(spark, part: Part, count: int, work: Callable, doing: str) -> list[str]:
    """``work`` run over ``count`` tasks, one a Spark task; their results' JSON, in the tasks' order."""
    try:
        rows = spark.range(0, count, 1, count).mapInArrow(work, "result string").collect()
    except Exception as exc:
        ranges = ", ".join(f"{p} from {s}" for p, s in sorted(part.starts.items()))
        raise TaskFailed(f"pipeline {part.pipeline}: batch {part.batch_seq} ({ranges}): the Spark task {doing} failed: "
                         f"{root_cause(exc)}; nothing was committed", ranges=[str(p) for p in part.starts]) from exc
    return [row["result"] for row in rows]


__all__ = ["cluster_rewrite"]
