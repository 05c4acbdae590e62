"""The Spark job of an upsert part's MERGE on the cluster (``upsert.merge: cluster``): one Spark
task per rewrite task commit/copyonwrite.py planned, each running write/rewrite.py on an executor.

Only the run's own program starts it: the sink's driver-side ``commit`` runs in a Python worker
that cannot start a Spark job, so on this path the sink leaves the part's commits to the run
(deltasink.py). A job over ``spark.range`` with one row per partition and ``mapInArrow`` runs on a
classic session and on Spark Connect alike; the tasks' inputs are their JSON (the change rows are
staged files, not rows sent through Spark), their results one JSON row each. A failed job fails
the part before its commit, naming the part's ranges; the files its finished tasks wrote are in
no commit (vacuum removes them).
"""

from __future__ import annotations

from typing import Callable, Mapping

import pyarrow as pa

from oncemore.commit.copyonwrite import ClusterRewrite
from oncemore.commit.part import Part
from oncemore.core.errors import TaskFailed, root_cause
from oncemore.run.session import slots
from oncemore.write.rewrite import RewriteResult, RewriteTask


def cluster_rewrite(spark, part: Part, storage_options: Mapping[str, str] | None) -> ClusterRewrite:
    """How ``part``'s MERGE rewrites its touched files on ``spark``'s cluster; its change rows are
    staged beside the part's own (the staging area, removed with the part)."""
    return ClusterRewrite(_job(spark, part, dict(storage_options or {})), f"{part.changes_uri}-rewrite", storage_options,
                          slots(spark))


def _job(spark, part: Part, storage_options: dict[str, str]) -> Callable[[list[RewriteTask]], list[RewriteResult]]:
    def run(tasks: list[RewriteTask]) -> list[RewriteResult]:
        texts = [t.to_json() for t in tasks]

        def rewrite_tasks(batches):
            from oncemore.write.rewrite import RewriteTask, rewrite

            for batch in batches:
                done = [rewrite(RewriteTask.from_json(texts[i]), storage_options).to_json()
                        for i in batch.column("id").to_pylist()]
                yield pa.RecordBatch.from_arrays([pa.array(done, pa.string())], names=["result"])

        try:
            rows = spark.range(0, len(tasks), 1, len(tasks)).mapInArrow(rewrite_tasks, "result string").collect()
        except Exception as exc:
            ranges = ", ".join(f"{p} from {s}" for p, s in sorted(part.starts.items()))
            raise TaskFailed(f"pipeline {part.pipeline}: batch {part.batch_seq} ({ranges}): the Spark task rewriting "
                             f"the table's files for its upserts failed: {root_cause(exc)}; nothing was committed",
                             ranges=[str(p) for p in part.starts]) from exc
        return [RewriteResult.from_json(row["result"]) for row in rows]

    return run


__all__ = ["cluster_rewrite"]
