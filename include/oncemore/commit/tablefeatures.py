"""What of a Delta table oncemore can honour as a writer: its writer features, constraints, and
generated, identity and invariant columns. oncemore adds files it wrote itself, so a table asking
writers to check or compute values, or for a feature delta-rs does not write, is refused.

Invariant: a table is refused before a run writes anything to it (tables.py, at the run's start)
and again on the snapshot each data commit builds on (committer.py), so a row breaching a
constraint another writer added never lands in a commit of oncemore's. Imports no PySpark: the
no-op rerun commits nothing and starts no Spark.
"""

from __future__ import annotations

import json

from deltalake import DeltaTable

from oncemore.core.errors import UnsupportedTable

# Writer features that appending files with add actions honours as it is (delta-rs writes V2-spec
# checkpoints, with checkpointMetadata, on a v2Checkpoint table). Any other feature asks writers for
# work oncemore does not do (row IDs, column mapping, clustering, commit timestamps, Iceberg metadata).
HONOURED_WRITER_FEATURES = frozenset({
    "appendOnly", "changeDataFeed", "deletionVectors", "domainMetadata", "timestampNtz", "vacuumProtocolCheck",
    "v2Checkpoint",
    # Harmless while no column or table uses them; check_writable looks at the table itself.
    "invariants", "checkConstraints", "generatedColumns", "identityColumns",
})


# What users call the writer features oncemore refuses, as delta-spark's documentation names them.
FEATURE_NAMES = {"clustering": "liquid clustering", "columnMapping": "column mapping", "rowTracking": "row tracking",
                 "inCommitTimestamp": "in-commit timestamps", "icebergCompatV1": "UniForm (Iceberg)",
                 "icebergCompatV2": "UniForm (Iceberg)", "typeWidening": "type widening"}


def check_writable(table: DeltaTable, table_uri: str) -> None:
    """Refuses, before anything is written, a table whose writers must check or compute values:
    oncemore adds files it wrote itself, so it can neither enforce a CHECK constraint or an
    invariant nor fill a generated or identity column; or one needing a writer feature it does
    not honour. A row violating a constraint therefore never lands in a commit of oncemore's."""
    configuration = table.metadata().configuration
    fields = json.loads(table.schema().to_json())["fields"]
    asks = [f"CHECK constraint {key.removeprefix('delta.constraints.')} ({value})"
            for key, value in sorted(configuration.items()) if key.startswith("delta.constraints.")]
    for field in fields:
        metadata = field.get("metadata") or {}
        asks += [f"invariant on column {field['name']}"] if "delta.invariants" in metadata else []
        asks += [f"generated column {field['name']}"] if "delta.generationExpression" in metadata else []
        asks += [f"identity column {field['name']}"] if any(k.startswith("delta.identity.") for k in metadata) else []
    mode = configuration.get("delta.columnMapping.mode", "none")
    asks += [f"column mapping (mode {mode})"] if mode != "none" else []
    unknown = set(table.protocol().writer_features or ()) - HONOURED_WRITER_FEATURES
    unknown -= {"columnMapping"} if mode != "none" else set()  # named once, with its mode
    asks += [f"{FEATURE_NAMES[f]} (writer feature {f})" if f in FEATURE_NAMES else f"writer feature {f}"
             for f in sorted(unknown)]
    if asks:
        raise UnsupportedTable(
            f"table {table_uri} asks its writers for what oncemore does not do: {'; '.join(asks)}. Nothing was "
            "written; remove them or point the pipeline at another table",
            table_uri=table_uri, requirements=asks,
        )


def check_scannable(table: DeltaTable, table_uri: str, where: str) -> None:
    """Refuses a table whose files oncemore reads as they are (copyonwrite.scan_keys, merge.py's
    own scan; delta-rs's MERGE refuses it untyped) while it may hold deletion vectors: a row one
    deleted is still in the file's Parquet."""
    if "deletionVectors" in (table.protocol().writer_features or ()):
        raise UnsupportedTable(
            f"{where}: table {table_uri} has the deletionVectors feature, and oncemore reads its files as they are "
            "(a row a deletion vector removed would still count). Neither the table nor its tombstones changed; drop the feature with "
            "delta-spark (ALTER TABLE ... DROP FEATURE deletionVectors), or point the pipeline at another table",
            table_uri=table_uri, requirements=["deletion vectors"])


def check_rewritable(table: DeltaTable, table_uri: str, where: str, on_cluster: bool) -> None:
    """Refuses, before anything is committed, a table whose files an upsert's MERGE may not
    replace: an append-only table (delta-rs's MERGE failed its first update with a commit
    conflict, on every rerun), and on the cluster (a copy-on-write of oncemore's, copyonwrite.py)
    one whose writers must record the change data feed, which delta-rs's MERGE writes."""
    configuration = table.metadata().configuration
    if configuration.get("delta.appendOnly", "").lower() == "true":  # delta-spark reads "True" too
        raise UnsupportedTable(
            f"{where}: table {table_uri} is append-only (delta.appendOnly), and an upsert replaces the files of the "
            "rows it changes or deletes. Neither the table nor its tombstones changed; unset it (ALTER TABLE ... SET TBLPROPERTIES "
            "('delta.appendOnly' = 'false')) or point the pipeline at another table",
            table_uri=table_uri, requirements=["delta.appendOnly"])
    if on_cluster and configuration.get("delta.enableChangeDataFeed", "").lower() == "true":
        raise UnsupportedTable(
            f"{where}: table {table_uri} records the change data feed (delta.enableChangeDataFeed), which upsert.merge "
            "cluster's rewrite does not write. Neither the table nor its tombstones changed; use upsert.merge local (delta-rs's MERGE writes "
            "the change files) or point the pipeline at another table",
            table_uri=table_uri, requirements=["delta.enableChangeDataFeed"])

