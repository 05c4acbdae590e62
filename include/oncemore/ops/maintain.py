"""Table upkeep (``oncemore maintain``): compaction of small files, a checkpoint, and vacuum, for a
pipeline's main and quarantine tables, by delta-rs's own operations; and the staging directories
runs left behind (staging.py), older than the same retention.

Invariants: the ledger survives (compaction rewrites data files with dataChange=false and never
touches txn actions; a checkpoint carries them), it runs beside ingestion (compaction commits
through delta-rs's conflict checker, which lets blind appends through), and vacuum never deletes
a file younger than the pipeline's retention, which the config holds at or above
VACUUM_RETENTION_FLOOR_HOURS: an ingestion writes its files before it commits them, and a
batch still reading must find them when it commits (the committer checks they exist).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from oncemore.config.model import Maintenance, Pipeline
from oncemore.core import crashpoints
from oncemore.plan.ledger import open_table
from oncemore.run.staging import remove_stale

log = logging.getLogger("oncemore")


def maintain(pipeline: Pipeline) -> dict[str, Any]:
    """Maintains both tables with the pipeline's ``maintenance`` settings (defaults when absent);
    returns what was done per table."""
    settings = pipeline.maintenance or Maintenance()
    done = {}
    for role, uri in (("main", pipeline.sink.table_uri), ("quarantine", pipeline.sink.quarantine_uri)):
        table = open_table(uri, pipeline.sink.storage_options)
        if table is None:
            done[role] = {"table_uri": uri, "status": "no table yet"}
            continue
        started = time.monotonic()
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
        log.info("%s: %s table %s: %s", pipeline.name, role, uri, done[role])
    return {"pipeline": pipeline.name, "tables": done}
