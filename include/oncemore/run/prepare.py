"""What a run settles before it reads a record: how its records are decoded (the formats resolved
against the registry, asked once; with routes, each route's), what each table is (the records'
columns, or what the transform makes of them as Spark's analysis says), and the tables made ready
for it. When a record's writer schema is ahead of its table's reader, the run follows that writer
where the table can take the result, or refuses it, its records quarantined with the reason.

Invariant: a Prepared is one the tables already hold. A preparation that fails raises and leaves the
run with the Prepared it had.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping

import pyarrow as pa

from oncemore.commit.inputs import AheadRecord
from oncemore.config.model import Pipeline
from oncemore.config.routes import DataTable
from oncemore.core.columns import MAIN_TAG, OWN_PREFIX, QUARANTINE_TAG, SchemaError, check_partition_by
from oncemore.core.coordinates import KafkaPartition, by_text
from oncemore.decode.recordspec import RecordSpec
from oncemore.decode.resolve import FormatError, follow, refuse, registries, resolve
from oncemore.decode.routing import RouterSpec
from oncemore.decode.rows import decoded_columns
from oncemore.run.taskspec import TableSpec, TaskSpec
from oncemore.shape.changes import UpsertRefused
from oncemore.shape.transform import TransformRefused

log = logging.getLogger("oncemore")

Registries = tuple[Mapping[str, str] | None, Mapping[str, str] | None]  # the value's and the key's settings


@dataclass(frozen=True)
class PreparedTable:
    """How one table's records are decoded, and its schema, which the table holds."""

    records: RecordSpec
    table_schema: pa.Schema


@dataclass(frozen=True)
class Prepared:
    """How a run's records are decoded and each data table's schema (by tag: the main table, or
    one per route), with the registries' settings."""

    tables: Mapping[str, PreparedTable]
    registries: Registries

    @property
    def main(self) -> PreparedTable:
        return self.tables[MAIN_TAG]

    @property
    def records(self) -> RecordSpec:
        return self.main.records

    @property
    def table_schema(self) -> pa.Schema:
        return self.main.table_schema

    def schemas(self) -> dict[str, pa.Schema]:
        return {tag: table.table_schema for tag, table in self.tables.items()}

    def task_spec(self, pipeline: Pipeline, floors: Mapping[str, Mapping[KafkaPartition, int]]) -> TaskSpec:
        """What every task of a part needs, with each table's ``floors`` (by tag, the quarantine
        table's included: parts.PartPlan.floors)."""
        if pipeline.routes is None:
            return task_spec(pipeline, self.records, self.table_schema, floors[QUARANTINE_TAG], self.registries)
        routes = pipeline.routes
        by = routes.parsed_by
        tables = tuple(TableSpec(t.tag, self.tables[t.tag].records, self.tables[t.tag].table_schema, t.table_uri,
                                 t.partition_by, by_text(floors[t.tag])) for t in pipeline.tables)
        first = pipeline.tables[0].format  # by a value's field, every route's framing and wrapping are alike
        router = RouterSpec(by.kind, by.path, by.name, tuple(t.route for t in pipeline.tables),
                            framed=first.confluent_framing, wrapped=first.schemas_enable)
        return TaskSpec(tables, pipeline.sink.quarantine_uri, by_text(floors[QUARANTINE_TAG]),
                        dict(pipeline.sink.storage_options), *self.registries, router=router,
                        skip_unrouted=routes.unrouted == "skip")


def prepare(pipeline: Pipeline, topics: list[str], spark_factory: Callable[[], object]) -> Prepared:
    """The run's first preparation: its formats resolved, its tables made ready."""
    settings = registries(pipeline)
    return _made_ready(pipeline, {t.tag: resolve(pipeline, topics, t) for t in pipeline.tables}, settings,
                       spark_factory)


def follow_writer(pipeline: Pipeline, prepared: Prepared, ahead: AheadRecord,
                  spark_factory: Callable[[], object]) -> Prepared:
    """``prepared`` changed for ``ahead``'s writer schema: the reader of its table follows it when
    the table can take the result (decode.resolve.follow), else the writer is refused (its records
    become errors with the reason) and the table stays as it is."""
    from oncemore.commit.evolution import SchemaChangeRefused  # imports PySpark's types

    table = next(t for t in pipeline.tables if t.tag == ahead.table)
    records = {tag: t.records for tag, t in prepared.tables.items()}
    try:
        records[table.tag] = follow(pipeline, prepared.tables[table.tag].records, ahead.role, ahead.schema_id, table)
        return _made_ready(pipeline, records, prepared.registries, spark_factory)
    except (FormatError, SchemaError, SchemaChangeRefused, TransformRefused, UpsertRefused) as exc:
        # Quarantined, not a failed run: every later run would fail on the same record.
        reason = (f"writer schema {ahead.schema_id} cannot be stored in the table: "
                  f"{exc.evidence['problem'] if isinstance(exc, SchemaChangeRefused) else exc}")
        log.warning("pipeline %s: %s/%d offset %d: %s; its records are quarantined", pipeline.name, ahead.topic,
                    ahead.partition, ahead.offset, reason)
        refused = PreparedTable(refuse(prepared.tables[table.tag].records, ahead.role, ahead.schema_id, reason),
                                prepared.tables[table.tag].table_schema)
        return Prepared({**prepared.tables, table.tag: refused}, prepared.registries)


def _made_ready(pipeline: Pipeline, records: Mapping[str, RecordSpec], settings: Registries,
                spark_factory: Callable[[], object]) -> Prepared:
    from oncemore.commit.tables import ensure_tables

    tables = {t.tag: t for t in pipeline.tables}
    schemas = ensure_tables(pipeline, {tag: table_schema(pipeline, spec, settings, spark_factory, tables[tag])
                                       for tag, spec in records.items()})
    return Prepared({tag: PreparedTable(records[tag], schemas[tag]) for tag in records}, settings)


def table_schema(pipeline: Pipeline, records: RecordSpec, settings: Registries,
                 spark_factory: Callable[[], object], table: DataTable | None = None) -> pa.Schema:
    """The schema of ``table`` (default: the main table) for records decoded by ``records``: theirs,
    or what the transform makes of them, as Spark's analysis of it says before a record is read
    (the session from ``spark_factory``, asked only for a pipeline that shapes records in Spark);
    its partition columns checked. TransformRefused names what does not resolve or fit."""
    table = table or pipeline.main
    schema = decoded_columns(records, *settings)
    if pipeline.shapes_in_spark:
        from oncemore.commit.evolution import arrow_schema
        from oncemore.run.kafkasource import records_frame
        from oncemore.shape.transform import shape

        spark = spark_factory()
        # Records of no task, with the columns as the format declares them (those NOT NULL stay so
        # in the table): what Spark's analysis of the transform needs, and nothing is read.
        shaped = shape(spark, records_frame(spark, {"tasks": "[]"}, schema), pipeline)
        schema = arrow_schema(shaped.drop(*[c for c in shaped.columns if c.startswith(OWN_PREFIX)]).schema)
    try:
        check_partition_by(schema, table.partition_by)
    except SchemaError as exc:
        where = "sink.partition_by" if table.route is None else f"routes.tables.{table.route}.partition_by"
        raise TransformRefused(f"pipeline {pipeline.name}: {where}: {exc}") from None
    return schema


def task_spec(pipeline: Pipeline, records: RecordSpec, table_schema: pa.Schema, floors: Mapping[KafkaPartition, int],
              settings: Registries) -> TaskSpec:
    """What every task of the records of a pipeline without routes needs: how to decode them, where
    to write, the quarantine table's ``floors``."""
    sink = pipeline.sink
    return TaskSpec.single(records, table_schema, sink.table_uri, sink.quarantine_uri, sink.partition_by,
                           by_text(floors), sink.storage_options, *settings)
