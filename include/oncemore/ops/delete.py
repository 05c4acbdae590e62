"""Deliberate deletions (``oncemore delete``): rows removed from a pipeline's tables by a predicate,
each table's commit recording the offsets of the rows it removed (commitinfo.Deletion), so
``oncemore verify`` accounts for them and still fails on a row that left a table without a record.

Invariant: a deletion's record names exactly the rows its commit removed. They are found on the
snapshot the deletion rewrites, and the deletion is pinned to them (the predicate AND their
offsets), so a row committed meanwhile is never removed unrecorded; a concurrent commit touching
the same files makes delta-rs refuse ours, and it is tried again on the new snapshot; one that
would remove a file delta-rs cannot remove (commit/removable.py) is refused. A deletion
moves no position and runs beside ingestion. The quarantine table is deleted from where the
predicate names its columns (``_kafka_*``, ``key``, ``error``); elsewhere it is left as it is, and
the result says so.
"""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, QueryBuilder
from deltalake.exceptions import CommitFailedError

from oncemore.commit.removable import SPELLED, WAY_OUT, UnremovableFile, holding, unremovable
from oncemore.config.model import Pipeline
from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN, QUARANTINE_TAG, TOPIC_COLUMN
from oncemore.core.coordinates import KafkaPartition, nested
from oncemore.core.errors import CommitConflict, OncemoreError
from oncemore.plan.commitinfo import METADATA_KEY, CommitInfo, Deletion
from oncemore.plan.ledger import open_table

ATTEMPTS = 3  # snapshots a deletion is tried on while concurrent commits rewrite its files
# Spans of consecutive offsets one deletion may pin (each is a term of its predicate).
MAX_SPANS = 10_000


class DeleteRefused(OncemoreError):
    """The predicate does not parse or resolve against the table, or matches rows too scattered to pin."""


def delete(pipeline: Pipeline, where: str, dry_run: bool = False) -> dict[str, Any]:
    """Deletes the rows of the pipeline's tables (the main table, or each route's, and the quarantine
    table) matching ``where`` (SQL as delta-rs evaluates it: DataFusion's dialect), each table in a
    commit of its own recording the offsets removed; ``dry_run``: what would be removed, nothing committed."""
    run_id = f"oncemore-delete-{uuid.uuid4().hex[:12]}"
    uris = {**{t.tag: t.table_uri for t in pipeline.tables}, QUARANTINE_TAG: pipeline.sink.quarantine_uri}
    opened = {role: open_table(uri, pipeline.sink.storage_options) for role, uri in uris.items()}
    for role, table in opened.items():  # refused before either table is touched
        if table is not None and table.metadata().configuration.get("delta.appendOnly", "false").lower() == "true":
            raise DeleteRefused(f"pipeline {pipeline.name}: delete --where {where!r}: table {uris[role]} is "
                                "append-only (delta.appendOnly): nothing was deleted",
                                pipeline=pipeline.name, table_uri=uris[role])
    tables = {}
    # Routed, each route's table has columns of its own: a predicate naming columns one lacks leaves it as it is.
    optional = {QUARANTINE_TAG} | ({t.tag for t in pipeline.tables} if pipeline.routes is not None else set())
    for role, uri in uris.items():
        try:
            tables[role] = _delete(pipeline, role in optional, uri, opened[role], where, run_id, dry_run)
        except OncemoreError as exc:
            done = [f"{tables[r]['table_uri']} ({tables[r]['rows']} rows, version {tables[r]['version']})"
                    for r in tables if tables[r].get("status") == "deleted"]
            if not done:
                raise
            raise type(exc)(f"{exc} (the deletion from {', '.join(done)} stands: run the command again for the "
                            "other tables)", **exc.evidence) from None
    if pipeline.routes is not None and all(t["status"].startswith("left as it is") or t["status"] == "no table yet"
                                           for role, t in tables.items() if role != QUARANTINE_TAG):
        raise DeleteRefused(f"pipeline {pipeline.name}: delete --where {where!r}: no route's table has the columns it "
                            "names; nothing was deleted", pipeline=pipeline.name)
    return {"pipeline": pipeline.name, "where": where, "run_id": run_id, "tables": tables}


def _delete(pipeline: Pipeline, optional: bool, uri: str, table: DeltaTable | None, where: str, run_id: str,
            dry_run: bool) -> dict[str, Any]:
    """Deletes from one table; an ``optional`` one whose columns the predicate does not all name is left as it is."""
    if table is None:
        return {"table_uri": uri, "status": "no table yet", "rows": 0}
    for _ in range(ATTEMPTS):
        try:
            matched = _matching(table, where)
        except Exception as exc:  # DataFusion's error: the predicate does not parse or resolve
            problem = str(exc).strip().splitlines()[0]
            if optional and "No field named" in problem:
                return {"table_uri": uri, "status": f"left as it is: the predicate names a column it lacks ({problem})",
                        "rows": 0}
            raise DeleteRefused(f"pipeline {pipeline.name}: delete --where {where!r} on {uri}: {problem}",
                                pipeline=pipeline.name, table_uri=uri) from None
        if not matched.num_rows:
            return {"table_uri": uri, "status": "nothing matched", "rows": 0, "version": table.version()}
        spans = _spans(matched)
        count = sum(len(s) for s in spans.values())
        if count > MAX_SPANS:
            raise DeleteRefused(f"pipeline {pipeline.name}: delete --where {where!r} on {uri}: the {matched.num_rows} "
                                f"rows matched lie in {count} runs of offsets (at most {MAX_SPANS}): narrow the "
                                "predicate (by _kafka_partition, say) and delete in steps", pipeline=pipeline.name)
        offsets = nested({p: [[s, e] for s, e in runs] for p, runs in spans.items()})
        if dry_run:
            return {"table_uri": uri, "status": "would delete", "rows": matched.num_rows, "offsets": offsets}
        # The commit deletes by the offsets alone: delta-rs's delete evaluates a predicate otherwise than
        # its query engine (a DECIMAL literal is coerced to the column's scale there), and the record
        # must name exactly the rows removed. Rows sharing a matched row's offsets were not all matched.
        pinned = _pinned(spans)
        foreign = holding(table, unremovable(table), [TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN], matched,
                          pipeline.sink.storage_options)
        if foreign:  # delta-rs's delete would leave it live beside its rewrite: the matched rows stay, the others twice
            raise UnremovableFile(f"pipeline {pipeline.name}: delete --where {where!r} on {uri}: file "
                                  f"{foreign[0]['path']} holds a matched row, and {SPELLED}: the delete would leave it "
                                  f"live beside its rewrite; nothing was deleted from it; {WAY_OUT}",
                                  table_uri=uri, path=foreign[0]["path"])
        at_offsets = _matching(table, pinned).num_rows
        if at_offsets != matched.num_rows:
            raise DeleteRefused(f"pipeline {pipeline.name}: delete --where {where!r} on {uri}: {at_offsets} rows hold "
                                f"the offsets of the {matched.num_rows} rows matched (a row twice: run oncemore verify); "
                                "nothing was deleted from it", pipeline=pipeline.name, table_uri=uri)
        record = CommitInfo(pipeline=pipeline.name, run_id=run_id,
                              deletion=Deletion(where=where, offsets=offsets, rows=matched.num_rows))
        try:
            table.delete(pinned, commit_properties=CommitProperties(custom_metadata={METADATA_KEY: record.to_json()}))
        except CommitFailedError as exc:  # nothing of ours landed
            read_version = table.version()
            table.update_incremental()
            if table.version() > read_version:  # a concurrent commit rewrote files ours read: again
                continue
            raise DeleteRefused(f"pipeline {pipeline.name}: delete --where {where!r} on {uri}: "
                                f"{str(exc).strip().splitlines()[0]}; nothing was deleted from it",
                                pipeline=pipeline.name, table_uri=uri) from None
        return {"table_uri": uri, "status": "deleted", "rows": matched.num_rows, "version": table.version(),
                "offsets": offsets}
    raise CommitConflict(f"pipeline {pipeline.name}: delete --where {where!r} on {uri}: concurrent commits refused it "
                         f"{ATTEMPTS} times; nothing was deleted from it: run it again", table_uri=uri)


def _matching(table: DeltaTable, where: str) -> pa.Table:
    """The coordinates of the rows of ``table``'s snapshot that ``where`` matches."""
    columns = ", ".join((TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN))
    return QueryBuilder().register("t", table).execute(f"SELECT {columns} FROM t WHERE {where}").read_all()


def _spans(matched: pa.Table) -> dict[KafkaPartition, list[tuple[int, int]]]:
    """The matched offsets as runs [start, end) of consecutive offsets, per partition."""
    found: dict[KafkaPartition, list[int]] = {}
    for topic, partition, offset in zip(*(matched.column(c).to_pylist() for c in (TOPIC_COLUMN, PARTITION_COLUMN,
                                                                                   OFFSET_COLUMN))):
        found.setdefault(KafkaPartition(topic, partition), []).append(offset)
    spans: dict[KafkaPartition, list[tuple[int, int]]] = {}
    for partition, offsets in found.items():
        runs = spans[partition] = []
        for offset in sorted(offsets):
            if runs and runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], offset + 1)
            else:
                runs.append((offset, offset + 1))
    return spans


def _pinned(spans: dict[KafkaPartition, list[tuple[int, int]]]) -> str:
    """A predicate matching exactly the rows at these offsets (topic names are [a-zA-Z0-9._-]: no quoting)."""
    return " OR ".join(
        f"({TOPIC_COLUMN} = '{p.topic}' AND {PARTITION_COLUMN} = {p.partition} AND ("
        + " OR ".join(f"{OFFSET_COLUMN} BETWEEN {s} AND {e - 1}" for s, e in runs) + "))"
        for p, runs in sorted(spans.items()))
