"""The pipeline's tables made ready before a run writes a file: created when missing, checked
(writer features and constraints oncemore cannot honour, partitioning), and the main table's schema
brought to the records' by the rules of evolution.py.

Nothing here moves a position. A table oncemore cannot write correctly is refused before anything
is read, naming what it asks of writers. A schema change is a commit of its own, made before the
first data commit that needs it (delta-rs 1.6.6's append commit cannot carry one: its
``create_write_transaction`` ignores a new schema): a crash between them leaves a table with a new
nullable column and no rows using it yet, which is what the data commit would show for the rows
before it.

A TIMESTAMP_NTZ column needs the ``timestampNtz`` table feature, which delta-rs 1.6.6 enables by
itself only where it sees one: not inside a MAP, which it then refuses to create or add. Columns
with one there are added after the table's creation (so they come after the others), once the
feature is enabled.
"""

from __future__ import annotations

import json
import logging
from typing import Iterable, Mapping

import pyarrow as pa
from deltalake import DeltaTable, Schema, TableFeatures
from pyspark.sql.types import ArrayType, DataType, MapType, StructField, StructType, TimestampNTZType

from oncemore.commit.evolution import arrow_schema, evolve, spark_schema
from oncemore.commit.tablefeatures import check_writable
from oncemore.config.model import Pipeline
from oncemore.commit.sequencing import check_sequence, record_sequence
from oncemore.core.columns import MAIN_TAG, QUARANTINE_SCHEMA, SchemaError, key_columns, tombstones_schema
from oncemore.core.errors import InvalidDataFile, OncemoreError, TableLocationError, root_cause
from oncemore.core.storage import location_problem, table_location
from oncemore.plan.ledger import open_table

log = logging.getLogger("oncemore")

# Set on the tables oncemore creates. A checkpoint every 10 commits (delta-spark's default; delta-rs's
# is 100): every txn lookup (a position, a claim) replays the commits since the last checkpoint, so
# a plan, a status or a commit's re-check on a tail of up to 99 commits took several times as long.
TABLE_PROPERTIES = {"delta.checkpointInterval": "10"}


def ensure_table(table_uri: str, schema: pa.Schema, partition_by: Iterable[str], name: str, description: str,
                 storage_options: Mapping[str, str] | None = None, evolution: str = "add_columns",
                 opened: DeltaTable | None = None) -> pa.Schema:
    """Opens the table, creating it when missing, and brings its schema to ``schema``'s by the
    rules of evolution.py (delta-rs's alter.add_columns; an append commit cannot carry a schema
    change in delta-rs 1.6.6); returns the table's schema, the one its files are written in."""
    location = table_location(table_uri)
    options = dict(storage_options) if storage_options else None
    table = opened if opened is not None else open_table(location, options)  # opened: the caller's snapshot
    if table is None:
        columns = spark_schema(schema).fields
        unseen = [f.name for f in columns if _holds_timestamp_ntz(f.dataType, only_in_maps=True)]
        try:
            table = DeltaTable.create(
                location, pa.schema([f for f in schema if f.name not in unseen]), mode="error",
                partition_by=list(partition_by) or None, name=name, description=description, storage_options=options,
                configuration=dict(TABLE_PROPERTIES),
            )
        except Exception:
            # Another run created it first (version 0 exists): use theirs.
            table = open_table(location, options)
            if table is None:
                raise
        else:
            if unseen:
                add_columns(table, [f for f in columns if f.name in unseen])
    check_writable(table, table_uri)
    _declare_invariants(table, location, options)
    check_partitioning(table, table_uri, partition_by)
    for attempt in range(2):
        current = StructType.fromJson(json.loads(table.schema().to_json()))
        merged, added = evolve(current, spark_schema(schema), evolution, f"table {table_uri}")
        if not added:
            return arrow_schema(merged)
        changed = {f.name for f in merged.fields} - {f.name for f in current.fields if f in merged.fields}
        try:
            add_columns(table, [f for f in merged.fields if f.name in changed])
            _declare_invariants(table, location, options)  # the columns may have raised its protocol to 7
            log.info("table %s: added %s", table_uri, ", ".join(added))
            return arrow_schema(merged)
        except Exception:
            if attempt:  # a concurrent run added them first: the schema it left is compared again
                raise
            table = open_table(location, options)
    raise AssertionError("unreachable")


def add_columns(table: DeltaTable, fields: list[StructField]) -> None:
    """Adds ``fields`` to the table, enabling the timestampNtz feature first when one holds a
    TIMESTAMP_NTZ the table's protocol lacks (module docstring)."""
    if ("timestampNtz" not in (table.protocol().writer_features or ())
            and any(_holds_timestamp_ntz(f.dataType) for f in fields)):
        table.alter.add_feature(TableFeatures.TimestampWithoutTimezone, allow_protocol_versions_increase=True)
    table.alter.add_columns(Schema.from_json(StructType(fields).json()).fields)


def _declare_invariants(table: DeltaTable, location: str, options: Mapping[str, str] | None) -> None:
    """Lists the invariants writer feature on a table of writer version 7 that lacks it: delta-spark
    takes every NOT NULL column (the ``_kafka_*`` ones) for an invariant and refuses to read such a
    table unless the protocol lists the feature (DELTA_FEATURES_PROTOCOL_METADATA_MISMATCH), and
    delta-rs, creating a table with a TIMESTAMP_NTZ column at version 7, lists only timestampNtz.
    Older versions imply the feature. Another run listing it first is as good; a commit landing
    meanwhile makes it try once more on the table as that commit left it."""
    for attempt in range(2):
        protocol = table.protocol()
        if protocol.min_writer_version < 7 or "invariants" in (protocol.writer_features or ()):
            return
        try:
            table.alter.add_feature(TableFeatures.Invariants)
            return
        except Exception:
            if attempt:
                raise
            table = open_table(location, options)


def _holds_timestamp_ntz(data_type: DataType, only_in_maps: bool = False, in_map: bool = False) -> bool:
    """Whether ``data_type`` holds a TIMESTAMP_NTZ at any depth (``only_in_maps``: inside a map)."""
    if isinstance(data_type, TimestampNTZType):
        return in_map or not only_in_maps
    if isinstance(data_type, StructType):
        return any(_holds_timestamp_ntz(f.dataType, only_in_maps, in_map) for f in data_type.fields)
    if isinstance(data_type, ArrayType):
        return _holds_timestamp_ntz(data_type.elementType, only_in_maps, in_map)
    if isinstance(data_type, MapType):
        return any(_holds_timestamp_ntz(t, only_in_maps, True) for t in (data_type.keyType, data_type.valueType))
    return False


def ensure_tables(pipeline: Pipeline, schemas: pa.Schema | Mapping[str, pa.Schema]) -> dict[str, pa.Schema]:
    """The pipeline's data tables (the main table, or one per route: ``schemas`` by tag, each
    table's brought to its own; returned; one schema: the main table's), quarantine table and, for
    an upsert ordered by a sequence, tombstones table, created when missing, checked otherwise."""
    schemas = schemas if isinstance(schemas, Mapping) else {MAIN_TAG: schemas}
    sink, subscription = pipeline.sink, pipeline.source.describe_subscription()
    options = dict(sink.storage_options) if sink.storage_options else None
    # Every location checked before any table is created: a refused one leaves nothing behind.
    tables = [("sink.quarantine_uri", sink.quarantine_uri)]
    keeps_deletes = pipeline.upsert is not None and pipeline.upsert.sequence_by is not None
    if keeps_deletes:
        tables.append(("sink.tombstones_uri", sink.tombstones_uri))
    tables += [(t.setting, t.table_uri) for t in pipeline.tables]
    for key, uri in tables:
        problem = location_problem(uri, options)
        if problem:
            raise TableLocationError(f"pipeline {pipeline.name}: {key} {uri}: no table can be created there: {problem}; "
                                     "nothing was created", pipeline=pipeline.name, key=key, table_uri=uri)

    def ready(key: str, uri: str, action, *arguments, **keywords):
        try:
            return action(uri, *arguments, **keywords)
        except (OncemoreError, SchemaError):
            raise
        except Exception as exc:  # the store refused (permissions, a bucket's policy): name pipeline and key
            raise TableLocationError(f"pipeline {pipeline.name}: {key} {uri}: {root_cause(exc)}",
                                     pipeline=pipeline.name, key=key, table_uri=uri) from exc

    # A table another writer made refuses before any table is created or changed; so does an
    # upsert table ordered by another sequence_by than the pipeline's.
    opened = {key: ready(key, uri, check_existing, options) for key, uri in tables}
    if pipeline.upsert is not None:
        check_sequence(pipeline.name, sink.table_uri, opened["sink.table_uri"], pipeline.upsert.sequence_by)
    what = "records" if pipeline.routes is None else "records of every route"
    ready("sink.quarantine_uri", sink.quarantine_uri, ensure_table, QUARANTINE_SCHEMA, (), f"{pipeline.name}_quarantine",
          f"oncemore quarantine of pipeline {pipeline.name}: {what} of {subscription} that could not be stored", options,
          opened=opened["sink.quarantine_uri"])
    if keeps_deletes:
        keys = pa.schema([schemas[MAIN_TAG].field(k) for k in key_columns(schemas[MAIN_TAG], pipeline.upsert.keys)])
        ready("sink.tombstones_uri", sink.tombstones_uri, ensure_table, tombstones_schema(keys), (),
              f"{pipeline.name}_tombstones", f"oncemore tombstones of pipeline {pipeline.name}: deletes kept "
              f"{pipeline.upsert.tombstone_retention_hours} h against late events", options,
              opened=opened["sink.tombstones_uri"])
    ensured = {}
    for table in pipeline.tables:
        name, described = (pipeline.name, subscription) if table.route is None else (
            f"{pipeline.name}_{table.route}", f"{subscription}, the records routed by {pipeline.routes.by} = {table.route}")
        ensured[table.tag] = ready(table.setting, table.table_uri, ensure_table, schemas[table.tag], table.partition_by,
                                   name, f"oncemore pipeline {pipeline.name}: {described}", options,
                                   sink.schema_evolution, opened=opened[table.setting])
    if pipeline.upsert is not None:
        ready("sink.table_uri", sink.table_uri, record_sequence, pipeline.upsert.sequence_by, options)
    return ensured


def check_existing(table_uri: str, storage_options: Mapping[str, str] | None) -> DeltaTable | None:
    """The table at ``table_uri`` (None: there is none yet), after check_writable."""
    table = open_table(table_location(table_uri), storage_options)
    if table is not None:
        check_writable(table, table_uri)
    return table


def check_partitioning(table: DeltaTable, table_uri: str, partition_by: Iterable[str]) -> None:
    """Refuses a table partitioned otherwise than the pipeline says: its files would not match."""
    if list(table.metadata().partition_columns) != list(partition_by):
        raise InvalidDataFile(
            f"table {table_uri} is partitioned by {table.metadata().partition_columns}, "
            f"the pipeline says {list(partition_by)}", table_uri=table_uri,
        )
