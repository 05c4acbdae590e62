"""Table upkeep (``oncemore maintain``): compaction of small files, a checkpoint, and vacuum, for a
pipeline's main and quarantine tables (and an upsert's tombstones table, under sequence_by), by
delta-rs's own operations; and the staging directories runs left behind (staging.py), older than
the same retention. The tombstones table first forgets the deletes applied (``_deleted_at``) more
than ``upsert.tombstone_retention_hours`` ago: a delete holds against late events that long.

Invariants: the ledger survives (compaction rewrites data files with dataChange=false and never
touches txn actions; a checkpoint carries them), it runs beside ingestion (compaction commits
through delta-rs's conflict checker, which lets blind appends through), and vacuum never deletes
a file younger than the pipeline's retention, which the config holds at or above
VACUUM_RETENTION_FLOOR_HOURS: an ingestion writes its files before it commits them, and a
batch still reading must find them when it commits (the committer checks they exist). Forgetting
tombstones rewrites files a batch's tombstones MERGE may read: whichever commits second is
refused (a run's with CommitConflict, its next run carries on; maintain's is tried again on the
new snapshot), and the txn actions are untouched either way.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from deltalake.exceptions import CommitFailedError

from oncemore.config.model import Maintenance, Pipeline
from oncemore.core import crashpoints
from oncemore.core.columns import DELETED_AT_FIELD
from oncemore.core.errors import CommitConflict
from oncemore.plan.ledger import open_table
from oncemore.run.staging import remove_stale

log = logging.getLogger("oncemore")

ATTEMPTS = 3  # snapshots the tombstones' deletion is tried on while batches rewrite their files


def maintain(pipeline: Pipeline) -> dict[str, Any]:
    """Maintains the pipeline's tables with its ``maintenance`` settings (defaults when absent);
    returns what was done per table."""
    settings = pipeline.maintenance or Maintenance()
    tables = [("main", pipeline.sink.table_uri), ("quarantine", pipeline.sink.quarantine_uri)]
    if pipeline.upsert is not None and pipeline.upsert.sequence_by is not None:
        tables.append(("tombstones", pipeline.sink.tombstones_uri))
    done = {}
    for role, uri in tables:
        table = open_table(uri, pipeline.sink.storage_options)
        if table is None:
            done[role] = {"table_uri": uri, "status": "no table yet"}
            continue
        started = time.monotonic()
        forgotten = forget_tombstones(pipeline, table) if role == "tombstones" else None
        compacted = table.optimize.compact(target_size=settings.target_file_size_mb << 20)
        crashpoints.reach("compacted")
        table.update_incremental()
        table.create_checkpoint()
        crashpoints.reach("checkpointed")
        deleted = table.vacuum(retention_hours=settings.vacuum_retention_hours, dry_run=False,
                               enforce_retention_duration=False, full=True)
        done[role] = {
            "table_uri": uri, "status": "maintained", "version": table.version(),
            "files_removed": compacted.get("numFilesRemoved", 0), "files_added": compacted.get("numFilesAdded", 0),
            "files_deleted": len(deleted), "seconds": round(time.monotonic() - started, 2),
        }
        if role == "quarantine":  # vacuum leaves directories starting with "_" alone
            done[role]["staging_removed"] = remove_stale(uri, settings.vacuum_retention_hours,
                                                         pipeline.sink.storage_options)
        if forgotten is not None:
            done[role]["tombstones_forgotten"] = forgotten
        log.info("%s: %s table %s: %s", pipeline.name, role, uri, done[role])
    return {"pipeline": pipeline.name, "tables": done}


def forget_tombstones(pipeline: Pipeline, table) -> int:
    """Deletes the rows of the tombstones ``table`` applied more than the pipeline's
    ``upsert.tombstone_retention_hours`` ago; how many."""
    hours = pipeline.upsert.tombstone_retention_hours
    cutoff = datetime.now(timezone.utc) - timedelta(hours=hours)
    for _ in range(ATTEMPTS):
        try:
            return table.delete(f"{DELETED_AT_FIELD.name} < '{cutoff.isoformat()}'").get("num_deleted_rows", 0)
        except CommitFailedError:  # nothing of ours landed
            read_version = table.version()
            table.update_incremental()
            if table.version() == read_version:
                raise
    raise CommitConflict(f"pipeline {pipeline.name}: maintain: forgetting the tombstones older than {hours} h in "
                         f"{table.table_uri}: batches' commits refused it {ATTEMPTS} times; nothing was forgotten: "
                         "run it again", table_uri=table.table_uri, attempts=ATTEMPTS)
