"""Table upkeep (``oncemore maintain``): compaction of small files, a checkpoint, and vacuum, for a
pipeline's main and quarantine tables (and an upsert's tombstones table, under sequence_by), by
delta-rs's own operations; and the staging directories runs left behind (staging.py), older than
the same retention. The tombstones table first forgets the deletes older than
``upsert.tombstone_retention_hours`` in the stream's time (stream_time_ms): a delete holds against
late events that long, however long ingestion paused.

Invariants: the ledger survives (compaction rewrites data files with dataChange=false and never
touches txn actions; a checkpoint carries them), it runs beside ingestion (compaction commits
through delta-rs's conflict checker, which lets blind appends through; a compaction racing
another writer's of the same files is undone: compaction.py), and vacuum never deletes
a file younger than the pipeline's retention, which the config holds at or above
VACUUM_RETENTION_FLOOR_HOURS: an ingestion writes its files before it commits them, and a
batch still reading must find them when it commits (the committer checks they exist). Forgetting
tombstones rewrites files a batch's tombstones MERGE may read: whichever commits second is
refused (a run's with CommitConflict, its next run carries on; maintain's is tried again on the
new snapshot), and the txn actions are untouched either way. A table holding a file delta-rs
cannot remove (commit/removable.py) is neither compacted nor rid of tombstones, and the command
fails naming it once every table is done.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from deltalake.exceptions import CommitFailedError

from oncemore.commit.removable import SPELLED, WAY_OUT, UnremovableFile, unremovable
from oncemore.config.model import Pipeline
from oncemore.config.schedule import Maintenance
from oncemore.core import crashpoints
from oncemore.core.columns import DELETED_AT_FIELD, TIMESTAMP_COLUMN
from oncemore.core.coordinates import KafkaPartition, flat
from oncemore.core.errors import CommitConflict
from oncemore.ops.compaction import compact
from oncemore.plan.ledger import Ledger, open_table
from oncemore.run.staging import remove_stale

log = logging.getLogger("oncemore")

ATTEMPTS = 3  # snapshots the tombstones' deletion is tried on while batches rewrite their files


def maintain(pipeline: Pipeline) -> dict[str, Any]:
    """Maintains the pipeline's tables with its ``maintenance`` settings (defaults when absent);
    returns what was done per table."""
    settings = pipeline.maintenance or Maintenance()
    tables = [(t.tag, t.table_uri) for t in pipeline.tables] + [("quarantine", pipeline.sink.quarantine_uri)]
    if pipeline.upsert is not None and pipeline.upsert.sequence_by is not None:
        tables.append(("tombstones", pipeline.sink.tombstones_uri))
    done, refused = {}, []
    for role, uri in tables:
        table = open_table(uri, pipeline.sink.storage_options)
        if table is None:
            done[role] = {"table_uri": uri, "status": "no table yet"}
            continue
        started = time.monotonic()
        foreign = unremovable(table)  # their removes would not cancel their adds: rows twice
        if foreign:
            refused.append((role, uri, foreign[0]["path"]))
        forgotten = forget_tombstones(pipeline, table) if role == "tombstones" and not foreign else None
        compacted = {} if foreign else compact(table, settings.target_file_size_mb << 20,
                                               f"pipeline {pipeline.name}: maintain: {role} table {uri}",
                                               pipeline.sink.storage_options)
        crashpoints.reach("compacted")
        table.update_incremental()
        table.create_checkpoint()
        crashpoints.reach("checkpointed")
        deleted = table.vacuum(retention_hours=settings.vacuum_retention_hours, dry_run=False,
                               enforce_retention_duration=False, full=True)
        done[role] = {
            "table_uri": uri, "status": "checkpointed and vacuumed, not compacted" if foreign else "maintained",
            "version": table.version(),
            "files_removed": compacted.get("numFilesRemoved", 0), "files_added": compacted.get("numFilesAdded", 0),
            "files_deleted": len(deleted), "seconds": round(time.monotonic() - started, 2),
        }
        if role == "quarantine":  # vacuum leaves directories starting with "_" alone
            done[role]["staging_removed"] = remove_stale(uri, settings.vacuum_retention_hours,
                                                         pipeline.sink.storage_options)
        if forgotten is not None:
            done[role]["tombstones_forgotten"] = forgotten
        log.info("%s: %s table %s: %s", pipeline.name, role, uri, done[role])
    if refused:
        role, uri, path = refused[0]
        raise UnremovableFile(f"pipeline {pipeline.name}: maintain: {role} table {uri}: file {path}: {SPELLED}: "
                              "compacting (or forgetting tombstones) would leave it live beside its rewrite, so that "
                              f"table was checkpointed and vacuumed only ({len(refused)} of {len(tables)} tables so); "
                              f"{WAY_OUT}", table_uri=uri, path=path)
    return {"pipeline": pipeline.name, "tables": done}


def stream_time_ms(pipeline: Pipeline) -> int | None:
    """The stream's time: how far the pipeline's committed progress reaches, in Kafka's timestamps.
    Per partition, its newest commit's greatest timestamp read (``stream_ms``; the commit's time
    where that commit reached the partition's log end, where a later record can only be newer;
    the commit's time for a commit of a format before stream_ms); the slowest partition bounds
    it. None: no commit of the pipeline in the log (nothing is forgotten)."""
    ledger = Ledger(pipeline.sink.table_uri, pipeline.name, pipeline.sink.storage_options)
    table = ledger.snapshot()
    if table is None:
        return None
    times: dict[KafkaPartition, int] = {}
    for entry in ledger.recent_batches(None, table):  # newest first
        record = entry.record
        read, ends = flat(record.stream_ms), flat(record.log_end)
        for partition, (_, end) in record.partition_ranges().items():
            if partition in times:
                continue
            caught_up = partition in ends and end >= ends[partition]
            if partition in read:
                times[partition] = max(read[partition], entry.timestamp_ms) if caught_up else read[partition]
            elif caught_up or record.format_version < 8:
                times[partition] = entry.timestamp_ms
            # else: this commit read no change event of it (all quarantined): an older one says
    return min(times.values()) if times else None


def forget_tombstones(pipeline: Pipeline, table) -> int:
    """Deletes the rows of the tombstones ``table`` whose delete (its Kafka timestamp; when it
    has none, when it was applied) is more than the pipeline's ``upsert.tombstone_retention_hours``
    older than the stream's time (stream_time_ms); how many."""
    hours = pipeline.upsert.tombstone_retention_hours
    now = stream_time_ms(pipeline)
    if now is None:
        return 0
    cutoff = datetime.fromtimestamp(now / 1000, timezone.utc) - timedelta(hours=hours)
    older = f"coalesce({TIMESTAMP_COLUMN}, {DELETED_AT_FIELD.name}) < '{cutoff.isoformat()}'"
    for _ in range(ATTEMPTS):
        try:
            return table.delete(older).get("num_deleted_rows", 0)
        except CommitFailedError:  # nothing of ours landed
            read_version = table.version()
            table.update_incremental()
            if table.version() == read_version:
                raise
    raise CommitConflict(f"pipeline {pipeline.name}: maintain: forgetting the tombstones older than {hours} h in "
                         f"{table.table_uri}: batches' commits refused it {ATTEMPTS} times; nothing was forgotten: "
                         "run it again", table_uri=table.table_uri, attempts=ATTEMPTS)
