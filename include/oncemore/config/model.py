"""Pipeline configuration: the model of a pipeline file (pydantic), its defaults and its checks.

The model is the one definition of a pipeline file: it validates, it fills defaults, and its JSON
Schema (`oncemore schema`) lets editors complete and check pipeline files. Errors name the key and
the problem, never a value (a value may be a substituted secret), and are raised before anything
runs; loading.py reads the files into it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import pyarrow as pa
from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from oncemore.config.catalog import Catalog
from oncemore.config.formats import Format
from oncemore.config.routes import DataTable, Routes, check_tables
from oncemore.config.schedule import AirflowSettings, Maintenance
from oncemore.config.upsert import Upsert
from oncemore.config.values import (
    ConfigModel,
    OffsetBound,
    Options,
    Positive,
    StartingOffsets,
    key_problem,
)
from oncemore.core.columns import SchemaError, check_partition_by, decoded_schema, key_type
from oncemore.core.redaction import redact
from oncemore.core.storage import same_table


TopicName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._-]{1,249}$")]


class Source(ConfigModel):
    """Where records come from: one topic, several, or every topic matching a pattern, of one cluster."""

    bootstrap_servers: StrictStr = Field(min_length=1)
    topic: TopicName | None = None
    topics: tuple[TopicName, ...] | None = Field(default=None, min_length=1)
    topic_pattern: StrictStr | None = Field(
        default=None, description="a regex the whole topic name matches (Spark's subscribePattern); "
                                  "resolved again by every run, internal topics (__...) never match")
    starting_offsets: StartingOffsets = Field(
        default=OffsetBound("earliest"),
        description="Where topics and partitions without a position start; defaults to airflow.start_date when set.")
    kafka_options: Options = Field(default_factory=dict, description="librdkafka settings; ${ENV} for secrets")
    # A read that makes no progress for this long fails, naming partition and position
    # (a broker that never answers with OFFSET_OUT_OF_RANGE would otherwise hang the job).
    stall_timeout_seconds: float = Field(default=60.0, gt=0, strict=False)

    @field_validator("kafka_options")
    @classmethod
    def _no_bootstrap_option(cls, value: dict[str, str]) -> dict[str, str]:
        if "bootstrap.servers" in value:
            raise key_problem("bootstrap.servers", "set source.bootstrap_servers instead")
        return value

    @model_validator(mode="after")
    def _one_subscription(self) -> "Source":
        given = [key for key in ("topic", "topics", "topic_pattern") if getattr(self, key) is not None]
        if len(given) != 1:
            raise key_problem("topic", "set exactly one of topic, topics and topic_pattern"
                         + (f" (found {', '.join(given)})" if given else ""))
        if self.topics is not None and len(set(self.topics)) != len(self.topics):
            raise key_problem("topics", "names a topic twice")
        if self.topic_pattern is not None:
            try:
                re.compile(self.topic_pattern)
            except re.error as exc:
                raise key_problem("topic_pattern", f"is not a valid regular expression: {exc}") from None
        if self.topic is None and any(t is None for t, _ in self.starting_offsets.offsets):
            raise key_problem("starting_offsets", 'name the topic of each offset ({"orders": {"0": 42}}): the pipeline '
                                             "reads several topics")
        return self

    @property
    def topic_names(self) -> tuple[str, ...] | None:
        """The topics named in the config; None for a pattern (resolved by each run)."""
        return (self.topic,) if self.topic is not None else self.topics

    def subscribes(self, topic: str) -> bool:
        if self.topic_pattern is None:
            return topic in self.topic_names
        return not topic.startswith("__") and re.fullmatch(self.topic_pattern, topic) is not None

    def describe_subscription(self) -> str:
        if self.topic_pattern is not None:
            return f"topics matching {self.topic_pattern}"
        return f"topic {self.topic}" if self.topic is not None else f"topics {', '.join(self.topics)}"

    def kafka_config(self) -> dict[str, str]:
        """librdkafka settings shared by every client of this pipeline (secrets included)."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.kafka_options}


class Sink(ConfigModel):
    """Where records go: the main table and the quarantine table for records that cannot be stored."""

    table_uri: StrictStr | None = Field(default=None, min_length=1,
                                        description="the table (with routes: none, each route names its own)")
    quarantine_uri: StrictStr | None = Field(default=None, description="defaults to table_uri + '_quarantine'; with "
                                                                       "routes, required: the quarantine of every route")
    tombstones_uri: StrictStr | None = Field(
        default=None, description="upsert with sequence_by: the deletes kept against late events; defaults to "
                                  "table_uri + '_tombstones'")
    partition_by: tuple[StrictStr, ...] = Field(default=(), description="columns of the table, those a transform "
                                                                       "derives included")
    schema_evolution: Literal["add_columns", "fail"] = Field(
        default="add_columns", description="add_columns: a new nullable field of the schema becomes a column in the "
                                           "commit of the first data that has it; fail: any change stops the run")
    # Object-store options for delta-rs (AWS_ENDPOINT_URL, ...); empty for local tables.
    storage_options: Options = Field(default_factory=dict, description="delta-rs storage options; ${ENV} for secrets")
    catalog: Catalog | None = Field(
        default=None, description="register the tables in a catalog after each commit: {type: hive, uri: "
                                  "thrift://host:port, database, table} or {type: glue, database, table}")

    @model_validator(mode="after")
    def _safe_commits_on_s3(self) -> "Sink":
        return self.safe_on_s3(self.table_uri, self.quarantine_uri)

    def safe_on_s3(self, *uris: str | None) -> "Sink":
        """S3 has no atomic put-if-absent rename: two writers could both "win" a commit. delta-rs
        commits safely with a conditional put (ETag) or a DynamoDB lock; never the unsafe rename.
        Checked when one of ``uris`` (the tables) is on S3; the conditional put set when neither is."""
        if not any(uri and urlsplit(uri).scheme in ("s3", "s3a") for uri in uris):
            return self
        options = {k.upper(): v for k, v in self.storage_options.items()}
        if options.get("AWS_S3_ALLOW_UNSAFE_RENAME", "false").lower() == "true":
            raise key_problem("storage_options.AWS_S3_ALLOW_UNSAFE_RENAME",
                         "lets two writers both commit a version; use conditional_put (the default) or a lock")
        if "CONDITIONAL_PUT" not in options and "AWS_S3_LOCKING_PROVIDER" not in options:
            object.__setattr__(self, "storage_options", {**self.storage_options, "conditional_put": "etag"})
        return self

    @model_validator(mode="after")
    def _quarantine_apart(self) -> "Sink":
        if self.table_uri is None:  # routes: each route's table (Pipeline._routed checks them)
            return self
        if self.quarantine_uri is None:
            object.__setattr__(self, "quarantine_uri", self.table_uri.rstrip("/") + "_quarantine")
        elif same_table(self.quarantine_uri, self.table_uri):
            raise key_problem("quarantine_uri", "must differ from table_uri")
        if self.tombstones_uri is None:
            object.__setattr__(self, "tombstones_uri", self.table_uri.rstrip("/") + "_tombstones")
        elif same_table(self.tombstones_uri, self.table_uri) or same_table(self.tombstones_uri, self.quarantine_uri):
            raise key_problem("tombstones_uri", "must differ from table_uri and quarantine_uri")
        return self


class PythonTransform(ConfigModel):
    python: StrictStr = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                              description="package.module:function, taking and returning a Spark DataFrame")


class Expectation(ConfigModel):
    """A Spark SQL predicate every row must satisfy after the transform (a NULL result fails it)."""

    name: StrictStr = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    check: StrictStr = Field(min_length=1, description="Spark SQL predicate, e.g. 'amount > 0'")
    on_fail: Literal["quarantine", "fail"] = "quarantine"


class Limits(ConfigModel):
    max_records_per_commit: Positive = 1_000_000
    # Offsets per Spark task; a larger partition range is split into sub-ranges
    # (Spark's Kafka source calls this maxRecordsPerPartition).
    max_records_per_partition: Positive = 1_000_000
    # Key + value bytes read per commit and per Spark task: a task stops at its share, so large
    # values make more, smaller commits instead of exhausting memory or Arrow's 2 GiB buffers.
    max_bytes_per_commit: Positive = 8 << 30
    max_bytes_per_task: Positive = 256 << 20


class Quarantine(ConfigModel):
    """How much of a batch may be quarantined: more fails it before its commits (commit/share.py)."""

    max_fraction: float = Field(default=0.5, gt=0, le=1, strict=False, description="the share of a batch's records "
                                "(written, quarantined or filtered) that may be quarantined (1: any)")
    min_quarantined: StrictInt = Field(default=10, ge=1, description="fewer quarantined never fail a batch")


class Alert(ConfigModel):
    """Freshness limits: the DAG's report task fails when a run ends beyond one, naming the partition."""

    max_lag_records: Positive | None = Field(default=None, description="records not yet ingested, per partition")
    max_lag_minutes: float | None = Field(default=None, gt=0, strict=False,
                                          description="age of the oldest record not yet ingested, per partition")


class Pipeline(ConfigModel):
    """One pipeline file: a topic into a Delta table, exactly once."""

    model_config = ConfigDict(title="oncemore pipeline")

    name: StrictStr = Field(description="lowercase letters, digits and _, starting with a letter; in the pipelines "
                                          "directory, the file's name")
    source: Source
    sink: Sink
    format: Format | None = Field(default=None, description="how record values are decoded (with routes: none, each "
                                                            "route has its own)")
    routes: Routes | None = Field(default=None, description="one topic into several tables: {by, tables: {value: "
                                                            "{table_uri, format}}, unrouted}")
    key: Format | None = Field(default=None, description="how record keys are decoded into column `key` (raw: "
                                                         "BINARY); no key column when absent, but for format raw")
    headers: StrictBool = Field(default=False, description="add column headers ARRAY<STRUCT<key: STRING, value: "
                                                           "BINARY>> (repeated keys kept in order)")
    transform: StrictStr | PythonTransform | None = Field(
        default=None, description="Spark SQL over the view `records`, or {python: module:function}; a record maps "
                                  "to at most one row and the _kafka_* columns must stay")
    expectations: tuple[Expectation, ...] = ()
    upsert: Upsert | None = Field(default=None, description="apply change events by key (MERGE); without it, append")
    limits: Limits = Limits()
    quarantine: Quarantine = Quarantine()
    fail_on_data_loss: StrictBool = True
    # Mirror the table's positions to consumer group oncemore.<name> after each commit, for lag
    # tools (kafka-consumer-groups, Burrow, exporters). Never read back: the Delta log is the truth.
    commit_consumer_group: StrictBool = False
    alert: Alert = Alert()
    maintenance: Maintenance | None = None
    airflow: AirflowSettings | None = Field(default=None, description="the pipeline's Airflow DAG; without it, no DAG")
    _origin: str = PrivateAttr("<config>")

    @field_validator("name")
    @classmethod
    def _name_is_an_identifier(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", value):
            raise PydanticCustomError("name", "must be lowercase letters, digits and _ starting with a letter")
        return value

    @model_validator(mode="after")
    def _start_at_start_date(self) -> "Pipeline":
        # A scheduled pipeline starts with its first data interval.
        if self.airflow is not None and "starting_offsets" not in self.source.model_fields_set:
            bound = OffsetBound(kind="timestamp", timestamp_ms=self.airflow.start_date_ms)
            object.__setattr__(self, "source", self.source.model_copy(update={"starting_offsets": bound}))
        return self

    @model_validator(mode="after")
    def _one_way_to_tables(self) -> "Pipeline":
        check_tables(self)
        return self

    @model_validator(mode="after")
    def _records_shape(self) -> "Pipeline":
        if self.key is not None and self.key.confluent_framing is False and self.key.type == "json" and not self.key.ddl:
            raise key_problem("key.schema", "is required for json")
        for table in self.tables:
            where = "format" if table.route is None else f"routes.tables.{table.route}.format"
            names = [f.name.lower() for f in table.format.declared or []]
            for column, taken in (("key", self.key is not None or table.format.type == "raw"), ("headers", self.headers)):
                if taken and column in names:
                    raise key_problem(f"{where}.schema", f"declares a column {column!r}, which the record's {column} "
                                                         "takes")
        names = {e.name for e in self.expectations}
        if len(names) != len(self.expectations):
            raise key_problem("expectations", "names an expectation twice")
        if self.upsert is not None:
            self.upsert.check_fits(self.format, self.sink.partition_by, self.transform is not None or
                                   bool(self.expectations))
        for table in self.tables:
            columns = self.static_columns(table)
            if columns is not None:
                try:
                    check_partition_by(columns, table.partition_by)
                except SchemaError as exc:
                    where = "sink" if table.route is None else f"routes.tables.{table.route}"
                    raise key_problem(f"{where}.partition_by", str(exc)) from None
        return self

    @property
    def tables(self) -> tuple[DataTable, ...]:
        """The tables the pipeline's records land in, the quarantine table aside: the main table, or
        one per route (in the file's order)."""
        if self.routes is None:
            return (DataTable(None, self.sink.table_uri, self.format, self.sink.partition_by),)
        return tuple(DataTable(value, route.table_uri, route.format, route.partition_by)
                     for value, route in self.routes.tables.items())

    @property
    def main(self) -> DataTable:
        """The one table of a pipeline without routes."""
        assert self.routes is None, "a routed pipeline has a table per route"
        return self.tables[0]

    @property
    def origin(self) -> str:
        """The file the pipeline was loaded from."""
        return self._origin

    @property
    def shapes_in_spark(self) -> bool:
        """Records go through Spark DataFrames (a transform, expectations, or upserts, whose change
        columns are Spark SQL): else they stay in the Python workers, decoded and written in one pass."""
        return self.transform is not None or bool(self.expectations) or self.upsert is not None

    def static_columns(self, table: DataTable | None = None) -> pa.Schema | None:
        """``table``'s (default: the main table's) columns when the config alone tells them (no
        registry, no transform)."""
        fmt = (table or self.main).format
        if self.shapes_in_spark or fmt.type in ("avro", "protobuf") or (
                self.key is not None and self.key.type in ("avro", "protobuf")):
            return None
        return decoded_schema(fmt.type, fmt.declared, key_type(self.key, fmt.type, self.key.declared if self.key else None),
                              self.headers)

    def redacted(self) -> dict[str, Any]:
        """The pipeline as a plain dict safe to print or log: secret option values masked."""
        shown = self.model_dump(mode="json", by_alias=True)
        shown["source"]["kafka_options"] = redact("kafka", self.source.kafka_options)
        shown["sink"]["storage_options"] = redact("storage", self.sink.storage_options)
        blocks = [shown.get("format"), shown.get("key")]
        blocks += [route["format"] for route in ((shown.get("routes") or {}).get("tables") or {}).values()]
        for block in blocks:
            if block and block.get("schema_registry") is not None:
                block["schema_registry"] = redact("registry", block["schema_registry"])
        return shown


def json_schema() -> dict[str, Any]:
    """The JSON Schema of pipeline files, for editors (`oncemore schema`)."""
    return Pipeline.model_json_schema(by_alias=True)
