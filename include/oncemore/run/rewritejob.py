"""The Spark jobs of an upsert part's MERGE on the cluster (``upsert.merge: cluster``): one Spark
task per task commit/copyonwrite.py planned, each running on an executor: the key scan
(write/keyscan.py) the classification and the copy-on-write start from, then the rewrite
(write/rewrite.py).

Only the run's own program starts it: the sink's driver-side ``commit`` runs in a Python worker
that cannot start a Spark job, so on this path the sink leaves the part's commits to the run
(deltasink.py). A job over ``spark.range`` with one row per partition and ``mapInArrow`` runs on a
classic session and on Spark Connect alike; the tasks' inputs are their JSON (the part's keys and
change rows, and the scan's matches, are staged files, not rows sent through Spark), their results
one JSON row each. A failed job fails the part before its commit, naming the part's ranges; the
files its finished tasks wrote are in no commit (vacuum removes them).
"""

from __future__ import annotations

from typing import Callable, Mapping

import pyarrow as pa

from oncemore.commit.copyonwrite import ClusterRewrite
from oncemore.commit.part import Part
from oncemore.core.errors import TaskFailed, root_cause
from oncemore.run.session import slots
from oncemore.write.keyscan import ScanResult, ScanTask
from oncemore.write.rewrite import RewriteResult, RewriteTask


def cluster_rewrite(spark, part: Part, storage_options: Mapping[str, str] | None) -> ClusterRewrite:
    """How ``part``'s MERGE scans the table's keys and rewrites its touched files on ``spark``'s
    cluster; its keys and change rows are staged beside the part's own (the staging area, removed
    with the part)."""
    options = dict(storage_options or {})

    def rewrite_tasks(tasks: list[RewriteTask]) -> list[RewriteResult]:
        texts = [t.to_json() for t in tasks]

        def rewrite_each(batches):
            from oncemore.write.rewrite import RewriteTask, rewrite  # noqa: F811 (on the executor)

            for batch in batches:
                done = [rewrite(RewriteTask.from_json(texts[i]), options).to_json() for i in batch.column("id").to_pylist()]
                yield pa.RecordBatch.from_arrays([pa.array(done, pa.string())], names=["result"])

        return [RewriteResult.from_json(r) for r in _collect(spark, part, len(texts), rewrite_each,
                                                              "rewriting the table's files for its upserts")]

    def scan_tasks(tasks: list[ScanTask]) -> list[ScanResult]:
        texts = [t.to_json() for t in tasks]

        def scan_each(batches):
            from oncemore.write.keyscan import ScanTask, scan  # noqa: F811 (on the executor)

            for batch in batches:
                done = [scan(ScanTask.from_json(texts[i]), options).to_json() for i in batch.column("id").to_pylist()]
                yield pa.RecordBatch.from_arrays([pa.array(done, pa.string())], names=["result"])

        return [ScanResult.from_json(r) for r in _collect(spark, part, len(texts), scan_each,
                                                           "scanning the table's keys for its upserts")]

    return ClusterRewrite(rewrite_tasks, scan_tasks, f"{part.changes_uri}-rewrite", storage_options, slots(spark))


def _collect(spark, part: Part, count: int, work: Callable, doing: str) -> list[str]:
    """``work`` (it imports what it runs: the closure travels, not this module) run over ``count``
    tasks, one a Spark task; their results' JSON, in the tasks' order."""
    try:
        rows = spark.range(0, count, 1, count).mapInArrow(work, "result string").collect()
    except Exception as exc:
        ranges = ", ".join(f"{p} from {s}" for p, s in sorted(part.starts.items()))
        raise TaskFailed(f"pipeline {part.pipeline}: batch {part.batch_seq} ({ranges}): the Spark task {doing} failed: "
                         f"{root_cause(exc)}; nothing was committed", ranges=[str(p) for p in part.starts]) from exc
    return [row["result"] for row in rows]


__all__ = ["cluster_rewrite"]
