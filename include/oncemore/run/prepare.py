"""What a run settles before it reads a record: how its records are decoded (the formats resolved
against the registry, asked once), what the table is (the records' columns, or what the transform
makes of them as Spark's analysis says), and both tables made ready for it. When a record's writer
schema is ahead of the reader, the run follows that writer where the table can take the result, or
refuses it, its records quarantined with the reason.

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
from oncemore.core.columns import OWN_PREFIX, SchemaError, check_partition_by
from oncemore.core.coordinates import KafkaPartition, by_text
from oncemore.decode.recordspec import RecordSpec
from oncemore.decode.resolve import FormatError, follow, refuse, registries, resolve
from oncemore.decode.rows import decoded_columns
from oncemore.run.tasks import TaskSpec
from oncemore.shape.changes import UpsertRefused
from oncemore.shape.transform import TransformRefused

log = logging.getLogger("oncemore")

Registries = tuple[Mapping[str, str] | None, Mapping[str, str] | None]  # the value's and the key's settings


@dataclass(frozen=True)
class Prepared:
    """How a run's records are decoded (``records``, with the registries' settings) and the main
    table's schema, which the tables hold."""

    records: RecordSpec
    registries: Registries
    table_schema: pa.Schema

    def task_spec(self, pipeline: Pipeline, floors: Mapping[KafkaPartition, int]) -> TaskSpec:
        """What every task of a part needs, with the quarantine table's ``floors``."""
        return task_spec(pipeline, self.records, self.table_schema, floors, self.registries)


def prepare(pipeline: Pipeline, topics: list[str], spark_factory: Callable[[], object]) -> Prepared:
    """The run's first preparation: its formats resolved, its tables made ready."""
    settings = registries(pipeline)
    return _made_ready(pipeline, resolve(pipeline, topics), settings, spark_factory)


def follow_writer(pipeline: Pipeline, prepared: Prepared, ahead: AheadRecord,
                  spark_factory: Callable[[], object]) -> Prepared:
    """``prepared`` changed for ``ahead``'s writer schema: the reader follows it when the table can
    take the result (decode.resolve.follow), else the writer is refused (its records become errors
    with the reason) and the table stays as it is."""
    from oncemore.commit.evolution import SchemaChangeRefused  # imports PySpark's types

    try:
        followed = follow(pipeline, prepared.records, ahead.role, ahead.schema_id)
        return _made_ready(pipeline, followed, prepared.registries, spark_factory)
    except (FormatError, SchemaError, SchemaChangeRefused, TransformRefused, UpsertRefused) as exc:
        # Quarantined, not a failed run: every later run would fail on the same record.
        reason = (f"writer schema {ahead.schema_id} cannot be stored in the table: "
                  f"{exc.evidence['problem'] if isinstance(exc, SchemaChangeRefused) else exc}")
        log.warning("pipeline %s: %s/%d offset %d: %s; its records are quarantined", pipeline.name, ahead.topic,
                    ahead.partition, ahead.offset, reason)
        return Prepared(refuse(prepared.records, ahead.role, ahead.schema_id, reason), prepared.registries,
                        prepared.table_schema)


def _made_ready(pipeline: Pipeline, records: RecordSpec, settings: Registries,
                spark_factory: Callable[[], object]) -> Prepared:
    from oncemore.commit.tables import ensure_tables

    schema = table_schema(pipeline, records, settings, spark_factory)
    return Prepared(records, settings, ensure_tables(pipeline, schema))


def table_schema(pipeline: Pipeline, records: RecordSpec, settings: Registries,
                 spark_factory: Callable[[], object]) -> pa.Schema:
    """The table's schema for records decoded by ``records``: theirs, or what the transform makes of
    them, as Spark's analysis of it says before a record is read (the session from
    ``spark_factory``, asked only for a pipeline that shapes records in Spark); its partition
    columns checked. TransformRefused names what does not resolve or fit."""
    schema = decoded_columns(records, *settings)
    if pipeline.shapes_in_spark:
        from oncemore.commit.evolution import arrow_schema
        from oncemore.run.kafkasource import KafkaRecordsDataSource
        from oncemore.run.session import register_source
        from oncemore.shape.transform import shape

        spark = spark_factory()
        register_source(spark, KafkaRecordsDataSource)
        probe = _probe_options(task_spec(pipeline, records, schema, {}, settings))
        shaped = shape(spark, spark.read.format(KafkaRecordsDataSource.name()).options(**probe).load(), pipeline)
        schema = arrow_schema(shaped.drop(*[c for c in shaped.columns if c.startswith(OWN_PREFIX)]).schema)
    try:
        check_partition_by(schema, pipeline.sink.partition_by)
    except SchemaError as exc:
        raise TransformRefused(f"pipeline {pipeline.name}: sink.partition_by: {exc}") from None
    return schema


def task_spec(pipeline: Pipeline, records: RecordSpec, table_schema: pa.Schema, floors: Mapping[KafkaPartition, int],
              settings: Registries) -> TaskSpec:
    """What every task of the pipeline's records needs: how to decode them, where to write, the
    quarantine table's ``floors``."""
    sink = pipeline.sink
    return TaskSpec(records, table_schema, sink.table_uri, sink.quarantine_uri, sink.partition_by, by_text(floors),
                    dict(sink.storage_options), *settings)


def _probe_options(spec: TaskSpec) -> dict[str, str]:
    """Options of a records DataFrame that reads nothing: what Spark's analysis of a transform needs."""
    options = {"tasks": "[]", "maxBytesPerTask": "1", "spec": spec.to_json(), "staging": "probe"}
    for prefix, settings in (("registry.", spec.value_registry or {}), ("key.registry.", spec.key_registry or {})):
        options.update({f"{prefix}{k}": v for k, v in settings.items()})
    return options
