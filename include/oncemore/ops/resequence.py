"""An accepted change of an upsert table's ``upsert.sequence_by`` (``oncemore resequence``): the
rows and deletes it holds were ordered by sequences the old expression computed, which mean
nothing beside the new one's.

The rows keep their values and coordinates and lose their sequences (NULL: before any number, so
each key's next event wins, whatever its sequence); the tombstones table forgets its deletes
(their sequences are the old expression's too); then the table records the new expression, last,
so runs stay refused until the rest is done. Each step is one commit recording what it accepts;
a crash between them is healed by running it again (each step is idempotent). A run already
under way is refused at its commit (merge.check_sequence reads the snapshot it commits on). A
table holding a file delta-rs cannot remove (commit/removable.py) is refused before any step.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable

from oncemore.commit.evolution import spark_schema
from oncemore.commit.removable import SPELLED, WAY_OUT, UnremovableFile, unremovable
from oncemore.commit.tables import add_columns
from oncemore.config.model import Pipeline
from oncemore.core.columns import SEQUENCE_COLUMN, SEQUENCE_FIELD, SEQUENCE_PROPERTY
from oncemore.core.errors import OncemoreError
from oncemore.plan.commitinfo import METADATA_KEY, CommitInfo
from oncemore.plan.ledger import open_table

log = logging.getLogger("oncemore")


class NothingToResequence(OncemoreError):
    """The pipeline has no upsert table yet, or appends."""


def resequence(pipeline: Pipeline) -> dict[str, Any]:
    """Makes the pipeline's upsert table ordered by its ``upsert.sequence_by`` (module docstring);
    returns what was done."""
    if pipeline.upsert is None:
        raise NothingToResequence(f"pipeline {pipeline.name}: resequence applies to an upsert table; this pipeline "
                                  "appends")
    options = pipeline.sink.storage_options
    table = open_table(pipeline.sink.table_uri, options)
    if table is None:
        raise NothingToResequence(f"pipeline {pipeline.name}: no table at {pipeline.sink.table_uri} yet: its first "
                                  "run records the sequence_by")
    recorded = table.metadata().configuration.get(SEQUENCE_PROPERTY)
    wanted = pipeline.upsert.sequence_by or ""
    if recorded == wanted:
        return {"pipeline": pipeline.name, "status": "unchanged", "sequence_by": wanted}
    names = {f.name for f in table.schema().fields}
    held = open_table(pipeline.sink.tombstones_uri, options)
    # Clearing the sequences rewrites the table's files, forgetting the deletes the tombstones': one
    # delta-rs cannot remove would keep its rows beside their rewrite.
    for role, rewritten in (("table", table if SEQUENCE_COLUMN in names else None), ("tombstones table", held)):
        foreign = unremovable(rewritten) if rewritten is not None else []
        if foreign:
            raise UnremovableFile(f"pipeline {pipeline.name}: resequence: {role} {rewritten.table_uri}: file "
                                  f"{foreign[0]['path']}: {SPELLED}: its rewrite would leave it live; nothing was "
                                  f"changed; {WAY_OUT}", table_uri=rewritten.table_uri, path=foreign[0]["path"])
    record = CommitInfo(pipeline=pipeline.name, run_id="resequence",
                        resequence={"from": recorded if recorded is not None else "(not recorded)", "to": wanted})
    properties = CommitProperties(custom_metadata={METADATA_KEY: record.to_json()})
    cleared = 0
    if SEQUENCE_COLUMN in names:
        cleared = table.update({SEQUENCE_COLUMN: "NULL"}, predicate=f"{SEQUENCE_COLUMN} IS NOT NULL",
                               commit_properties=properties).get("num_updated_rows", 0)
    elif wanted:  # a table ordered by offsets gains the column, NULL in every row held
        add_columns(table, list(spark_schema(pa.schema([SEQUENCE_FIELD])).fields))
    forgotten = 0
    if held is not None:
        forgotten = held.delete(commit_properties=properties).get("num_deleted_rows", 0)
    table = DeltaTable(table.table_uri, storage_options=dict(options) if options else None)
    table.alter.set_table_properties({SEQUENCE_PROPERTY: wanted}, raise_if_not_exists=False,
                                     commit_properties=properties)
    done = {"pipeline": pipeline.name, "status": "resequenced", "from": recorded, "to": wanted,
            "rows_cleared": cleared, "deletes_forgotten": forgotten, "version": table.version()}
    log.info("%s: resequenced: %s", pipeline.name, done)
    return done
