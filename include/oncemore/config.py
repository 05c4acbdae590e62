"""Pipeline configuration: the YAML model (pydantic), ${ENV} substitution and redaction.

The model is the one definition of a pipeline file: it validates, it fills defaults, and its JSON
Schema (`oncemore schema`) lets editors complete and check pipeline files. Errors name the file,
the key and the problem, never a value (a value may be a substituted secret), and are raised
before anything runs.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Mapping
from urllib.parse import urlsplit

import pyarrow as pa
import yaml
from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, PrivateAttr, StrictBool, StrictInt, StrictStr,
    ValidationError, WithJsonSchema, field_validator, model_validator,
)
from pydantic_core import PydanticCustomError

from .coordinates import KafkaPartition
from .redaction import redact
from .ddl import check_json_types, parse_ddl
from .schema import SchemaError, check_partition_by, key_type, records_schema

PIPELINES_DIR_ENV = "ONCEMORE_PIPELINES_DIR"
DEFAULT_PIPELINES_DIR = Path(__file__).resolve().parent.parent / "pipelines"

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """A pipeline configuration's problems, each with the key it is about, in one line naming the
    file; ``key`` and ``problem`` are the first."""

    def __init__(self, source: str, key: str, problem: str, more: Iterable[tuple[str, str]] = ()):
        self.source, self.key, self.problem = source, key, problem
        self.problems = [(key, problem), *more]
        self.summary = "; ".join(f"{k}: {p}" if k else p for k, p in self.problems)  # the message without the file
        super().__init__(f"{source}: {self.summary}")


@dataclass(frozen=True)
class OffsetBound:
    """An offset per partition, as a user states it: ``earliest``, ``latest``, a record timestamp,
    or explicit per-partition offsets. Used for where new partitions start and where a run ends.

    Explicit offsets are keyed (topic, partition), as Spark's Kafka source takes them
    (``{"orders": {"0": 42}}``); ``{"0": 42}`` is the short form for a pipeline of one topic, kept
    with the topic None until ``for_topics`` knows the pipeline's topics."""

    kind: str  # "earliest" | "latest" | "timestamp" | "offsets"
    timestamp_ms: int | None = None
    offsets: Mapping[tuple[str | None, int], int] = field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "timestamp":
            return format_timestamp_ms(self.timestamp_ms)
        if self.kind == "offsets":
            if all(topic is None for topic, _ in self.offsets):
                return json.dumps({str(p): o for (_, p), o in sorted(self.offsets.items())})
            nested: dict[str, dict[str, int]] = {}
            for (topic, p), o in sorted(self.offsets.items()):
                nested.setdefault(topic, {})[str(p)] = o
            return json.dumps(nested)
        return self.kind

    def for_topics(self, topics: Iterable[str]) -> dict[KafkaPartition, int]:
        """The explicit offsets by partition of ``topics``; the short form needs exactly one topic."""
        topics = sorted(topics)
        if any(topic is None for topic, _ in self.offsets) and len(topics) != 1:
            raise ValueError(f"name the topic of each offset, like {{\"{topics[0] if topics else 'topic'}\": "
                             f"{{\"0\": 42}}}}: the pipeline reads topics {', '.join(topics)}")
        return {KafkaPartition(topic if topic is not None else topics[0], p): o for (topic, p), o in self.offsets.items()}

    def only(self, topics: set[str]) -> "OffsetBound":
        """The bound for ``topics`` alone: explicit offsets of other topics left out."""
        if self.kind != "offsets":
            return self
        return OffsetBound("offsets", offsets={k: v for k, v in self.offsets.items() if k[0] is None or k[0] in topics})

    @classmethod
    def parse(cls, value: Any, allowed: tuple[str, ...] = ("earliest", "latest")) -> "OffsetBound":
        """From YAML or command-line text: a keyword, an ISO-8601 timestamp (or ``{timestamp: ...}``),
        ``{"orders": {"0": 42, "1": 7}}`` or, for one topic, ``{"0": 42, "1": 7}`` (JSON text too).
        Raises ValueError naming the problem."""
        if isinstance(value, OffsetBound):
            return value
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON offsets: {exc}") from exc
        if isinstance(value, str) and value in allowed:
            return cls(kind=value)
        if isinstance(value, dict) and set(value) == {"timestamp"}:
            value = value["timestamp"]
        expected = f"must be {' | '.join(allowed)}, an ISO-8601 timestamp or per-partition offsets like {{\"0\": 42}}"
        if isinstance(value, (str, datetime)):
            try:
                return cls(kind="timestamp", timestamp_ms=parse_timestamp_ms(value))
            except ValueError:
                raise ValueError(expected) from None
        if isinstance(value, dict) and value:
            nested = all(isinstance(v, dict) for v in value.values())
            try:
                offsets = ({(str(t), int(p)): int(o) for t, partitions in value.items() for p, o in partitions.items()}
                           if nested else {(None, int(p)): int(o) for p, o in value.items()})
            except (TypeError, ValueError, AttributeError):
                raise ValueError("offsets must map partition numbers to offsets, per topic "
                                 '({"orders": {"0": 42}}) or for the one topic ({"0": 42})') from None
            if not offsets or any(p < 0 or o < 0 for (_, p), o in offsets.items()):
                raise ValueError("partitions and offsets must not be negative")
            return cls(kind="offsets", offsets=offsets)
        raise ValueError(f"{expected}, got {type(value).__name__}")


def _error(key: str, problem: str) -> PydanticCustomError:
    """A validation error about ``key`` below the validated model (reported as its path)."""
    return PydanticCustomError("oncemore", "{problem}", {"problem": problem, "key": key})


def _offset_bound(value: Any) -> OffsetBound:
    try:
        return OffsetBound.parse(value)
    except ValueError as exc:
        raise _error("", str(exc)) from None


StartingOffsets = Annotated[
    OffsetBound,
    BeforeValidator(_offset_bound),
    PlainSerializer(lambda bound: bound.describe()),
    WithJsonSchema({"anyOf": [
        {"enum": ["earliest", "latest"]},
        {"type": "string", "format": "date-time", "description": "the first record at or after this time"},
        {"type": "object", "properties": {"timestamp": {"type": "string", "format": "date-time"}},
         "required": ["timestamp"], "additionalProperties": False},
        {"type": "object", "description": "offset per partition number (a pipeline of one topic)",
         "patternProperties": {"^[0-9]+$": {"type": "integer", "minimum": 0}}, "additionalProperties": False},
        {"type": "object", "description": "offset per partition number, per topic",
         "patternProperties": {r"^[A-Za-z0-9._-]+$": {
             "type": "object", "patternProperties": {"^[0-9]+$": {"type": "integer", "minimum": 0}},
             "additionalProperties": False}}, "additionalProperties": False},
    ]}),
]
Positive = Annotated[StrictInt, Field(ge=1)]
# Airflow's cron presets, as the 5-field crons Airflow reads them as.
CRON_PRESETS = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@weekly": "0 0 * * 0", "@monthly": "0 0 1 * *",
                "@quarterly": "0 0 1 */3 *", "@yearly": "0 0 1 1 *"}


def _cron(value: str) -> str:
    """A 5-field cron Airflow accepts (a preset becomes its cron), checked where the file loads
    rather than when Airflow first parses the DAG."""
    from croniter import CroniterError, croniter  # Airflow's own cron parser; imported only to validate

    # The value is never quoted (nor croniter's reason, which quotes it): it may hold a ${ENV} secret.
    text = CRON_PRESETS.get(value.strip(), value.strip())
    if len(text.split()) != 5:
        raise PydanticCustomError("cron", "{problem}", {"problem": (
            f"is not a 5-field cron (minute hour day-of-month month day-of-week) or one of {', '.join(CRON_PRESETS)}")})
    try:
        croniter(text)
    except CroniterError:
        raise PydanticCustomError("cron", "{problem}", {"problem": (
            "is not a valid cron: a field is out of range or not a number, list, range or step")}) from None
    return text


Cron = Annotated[StrictStr, AfterValidator(_cron), Field(json_schema_extra={"examples": ["0 * * * *", "@hourly"]})]


def _option_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _options_text(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    for key, option in value.items():
        if not isinstance(option, (str, int, float, bool)):
            raise _error(str(key), f"must be a scalar, got {type(option).__name__}")
    return {str(k): _option_text(v) for k, v in value.items()}


# librdkafka and delta-rs take text: YAML scalars become text, anything else is refused.
Options = Annotated[dict[str, str], BeforeValidator(_options_text)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


TopicName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._-]{1,249}$")]


class Source(_Model):
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
            raise _error("bootstrap.servers", "set source.bootstrap_servers instead")
        return value

    @model_validator(mode="after")
    def _one_subscription(self) -> "Source":
        given = [key for key in ("topic", "topics", "topic_pattern") if getattr(self, key) is not None]
        if len(given) != 1:
            raise _error("topic", "set exactly one of topic, topics and topic_pattern"
                         + (f" (found {', '.join(given)})" if given else ""))
        if self.topics is not None and len(set(self.topics)) != len(self.topics):
            raise _error("topics", "names a topic twice")
        if self.topic_pattern is not None:
            try:
                re.compile(self.topic_pattern)
            except re.error as exc:
                raise _error("topic_pattern", f"is not a valid regular expression: {exc}") from None
        if self.topic is None and any(t is None for t, _ in self.starting_offsets.offsets):
            raise _error("starting_offsets", 'name the topic of each offset ({"orders": {"0": 42}}): the pipeline '
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


class Sink(_Model):
    """Where records go: the main table and the quarantine table for records that cannot be stored."""

    table_uri: StrictStr = Field(min_length=1)
    quarantine_uri: StrictStr | None = Field(default=None, description="defaults to table_uri + '_quarantine'")
    partition_by: tuple[StrictStr, ...] = Field(default=(), description="columns of the table, those a transform "
                                                                       "derives included")
    schema_evolution: Literal["add_columns", "fail"] = Field(
        default="add_columns", description="add_columns: a new nullable field of the schema becomes a column in the "
                                           "commit of the first data that has it; fail: any change stops the run")
    # Object-store options for delta-rs (AWS_ENDPOINT_URL, ...); empty for local tables.
    storage_options: Options = Field(default_factory=dict, description="delta-rs storage options; ${ENV} for secrets")

    @model_validator(mode="after")
    def _safe_commits_on_s3(self) -> "Sink":
        # S3 has no atomic put-if-absent rename: two writers could both "win" a commit. delta-rs
        # commits safely with a conditional put (ETag) or a DynamoDB lock; never the unsafe rename.
        if urlsplit(self.table_uri).scheme not in ("s3", "s3a"):
            return self
        options = {k.upper(): v for k, v in self.storage_options.items()}
        if options.get("AWS_S3_ALLOW_UNSAFE_RENAME", "false").lower() == "true":
            raise _error("storage_options.AWS_S3_ALLOW_UNSAFE_RENAME",
                         "lets two writers both commit a version; use conditional_put (the default) or a lock")
        if "CONDITIONAL_PUT" not in options and "AWS_S3_LOCKING_PROVIDER" not in options:
            object.__setattr__(self, "storage_options", {**self.storage_options, "conditional_put": "etag"})
        return self

    @model_validator(mode="after")
    def _quarantine_apart(self) -> "Sink":
        if self.quarantine_uri is None:
            object.__setattr__(self, "quarantine_uri", self.table_uri.rstrip("/") + "_quarantine")
        elif self.quarantine_uri.rstrip("/") == self.table_uri.rstrip("/"):
            raise _error("quarantine_uri", "must differ from table_uri")
        return self


class Format(_Model):
    """How a record's value (``format``) or key (``key``) is decoded.

    json: the declared Spark DDL (``schema``); avro and protobuf: Confluent's wire format, each
    record's writer schema fetched by ID from ``schema_registry`` and the table's from the
    subject's latest version (a declared ``schema`` is then checked against it); raw: the bytes;
    string: UTF-8 text."""

    type: Literal["json", "avro", "protobuf", "raw", "string"]
    ddl: StrictStr | None = Field(default=None, alias="schema",
                                  description="Spark DDL, e.g. 'id BIGINT, customer STRUCT<name: STRING, zip: STRING>'")
    schema_registry: Options | None = Field(
        default=None, description="confluent-kafka SchemaRegistryClient settings (url, basic.auth.user.info, ...); "
                                  "${ENV} for secrets")
    subject: StrictStr | None = Field(default=None, description="default <topic>-value (<topic>-key for keys)")
    message: StrictStr | None = Field(default=None, description="protobuf: the message's full name (default: the "
                                                                "schema's first message)")
    confluent_framing: StrictBool = Field(default=False, description="json: values carry Confluent's JSON Schema "
                                                                     "serializer header (magic byte, schema ID)")

    @model_validator(mode="after")
    def _settings_fit_type(self) -> "Format":
        registered = self.type in ("avro", "protobuf")
        if self.type == "json" and not self.ddl:
            raise _error("schema", "is required for json (Spark DDL, e.g. 'id BIGINT, name STRING')")
        if self.ddl and self.type in ("raw", "string"):
            raise _error("schema", f"does not apply to type {self.type}")
        if self.ddl:
            try:
                check_json_types(parse_ddl(self.ddl)) if self.type == "json" else parse_ddl(self.ddl)
            except SchemaError as exc:
                raise _error("schema", str(exc)) from None
        if registered and not (self.schema_registry or {}).get("url"):
            raise _error("schema_registry", f"with a url is required for {self.type}")
        if self.confluent_framing and self.type != "json":
            raise _error("confluent_framing", "applies to type json (avro and protobuf are always framed)")
        if self.schema_registry is not None and not (registered or self.confluent_framing):
            raise _error("schema_registry", f"does not apply to type {self.type}")
        if self.subject is not None and not registered:
            raise _error("subject", f"does not apply to type {self.type}")
        if self.message is not None and self.type != "protobuf":
            raise _error("message", "applies to type protobuf")
        return self

    @property
    def declared(self) -> pa.Schema | None:
        """The declared columns (Arrow), when a schema is declared."""
        return parse_ddl(self.ddl) if self.ddl else None


class PythonTransform(_Model):
    python: StrictStr = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                              description="package.module:function, taking and returning a Spark DataFrame")


class Expectation(_Model):
    """A Spark SQL predicate every row must satisfy after the transform (a NULL result fails it)."""

    name: StrictStr = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    check: StrictStr = Field(min_length=1, description="Spark SQL predicate, e.g. 'amount > 0'")
    on_fail: Literal["quarantine", "fail"] = "quarantine"


class Limits(_Model):
    max_records_per_commit: Positive = 1_000_000
    # Offsets per Spark task; a larger partition range is split into sub-ranges
    # (Spark's Kafka source calls this maxRecordsPerPartition).
    max_records_per_partition: Positive = 1_000_000
    # Key + value bytes read per commit and per Spark task: a task stops at its share, so large
    # values make more, smaller commits instead of exhausting memory or Arrow's 2 GiB buffers.
    max_bytes_per_commit: Positive = 8 << 30
    max_bytes_per_task: Positive = 256 << 20


class AirflowSettings(_Model):
    """How the pipeline's DAG runs (a pipeline without this block has no DAG: CLI only). Runs cover
    data intervals of ``schedule``."""

    schedule: Cron = Field(default="0 * * * *", description="5-field cron or an Airflow preset (@hourly, @daily, ...); "
                                                            "each run covers one interval of it")
    start_date: datetime = Field(description="ISO-8601; without a zone, UTC: the first data interval starts here")
    catchup: StrictBool = False
    max_active_runs: Positive = 1
    owner: StrictStr = "oncemore"
    retries: Annotated[StrictInt, Field(ge=0)] = 2
    retry_delay_minutes: Annotated[float, Field(gt=0)] = 5.0
    tags: tuple[StrictStr, ...] = ()
    spark_conn_id: StrictStr = Field(default="oncemore_spark",
                                     description="the Spark connection the ingest task's spark-submit uses")
    spark_connect_conn_id: StrictStr | None = Field(
        default=None, description="a spark_connect connection: the ingest task runs on that Spark Connect server "
                                  "instead of spark-submit")
    kafka_conn_id: StrictStr | None = None

    @field_validator("start_date")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value

    @property
    def start_date_ms(self) -> int:
        return parse_timestamp_ms(self.start_date)


# Vacuum never deletes a file younger than this: an ingestion writes its files before it
# commits them, and a batch that is still reading must find its files there when it commits.
VACUUM_RETENTION_FLOOR_HOURS = 24


class Maintenance(_Model):
    """Table upkeep (``oncemore maintain``), run by the pipeline's maintenance DAG on ``schedule``:
    compaction of small files, a checkpoint, and vacuum of files no version within the retention
    still needs; and, on ``verify``'s schedule, the audit of the tables (``oncemore verify``)."""

    schedule: Cron = Field(default="30 3 * * *", description="5-field cron or an Airflow preset")
    target_file_size_mb: Positive = Field(default=128, description="compaction rewrites smaller files into files of about this size")
    vacuum_retention_hours: StrictInt = Field(
        default=168, ge=VACUUM_RETENTION_FLOOR_HOURS,
        description=f"files no version needs and older than this are deleted (at least {VACUUM_RETENTION_FLOOR_HOURS})")
    verify: Literal["off"] | Cron = Field(
        default="off", description="off, or a 5-field cron: a maintenance run whose interval holds one of its times "
                                   "also runs `oncemore verify` (on spark_conn_id) and fails on a discrepancy")


class Alert(_Model):
    """Freshness limits: the DAG's report task fails when a run ends beyond one, naming the partition."""

    max_lag_records: Positive | None = Field(default=None, description="records not yet ingested, per partition")
    max_lag_minutes: float | None = Field(default=None, gt=0, strict=False,
                                          description="age of the oldest record not yet ingested, per partition")


class Pipeline(_Model):
    """One pipeline file: a topic into a Delta table, exactly once."""

    model_config = ConfigDict(frozen=True, extra="forbid", title="oncemore pipeline")

    name: StrictStr = Field(description="lowercase letters, digits and _, starting with a letter; in the pipelines "
                                          "directory, the file's name")
    source: Source
    sink: Sink
    format: Format
    key: Format | None = Field(default=None, description="how record keys are decoded into column `key` (raw: "
                                                         "BINARY); no key column when absent, but for format raw")
    headers: StrictBool = Field(default=False, description="add column headers ARRAY<STRUCT<key: STRING, value: "
                                                           "BINARY>> (repeated keys kept in order)")
    transform: StrictStr | PythonTransform | None = Field(
        default=None, description="Spark SQL over the view `records`, or {python: module:function}; a record maps "
                                  "to at most one row and the _kafka_* columns must stay")
    expectations: tuple[Expectation, ...] = ()
    limits: Limits = Limits()
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
    def _records_shape(self) -> "Pipeline":
        if self.key is not None and self.key.confluent_framing is False and self.key.type == "json" and not self.key.ddl:
            raise _error("key.schema", "is required for json")
        names = [f.name.lower() for f in self.format.declared or []]
        for column, taken in (("key", self.key is not None or self.format.type == "raw"), ("headers", self.headers)):
            if taken and column in names:
                raise _error("format.schema", f"declares a column {column!r}, which the record's {column} takes")
        names = {e.name for e in self.expectations}
        if len(names) != len(self.expectations):
            raise _error("expectations", "names an expectation twice")
        if self.static_columns() is not None:
            try:
                check_partition_by(self.static_columns(), self.sink.partition_by)
            except SchemaError as exc:
                raise _error("sink.partition_by", str(exc)) from None
        return self

    @property
    def origin(self) -> str:
        """The file the pipeline was loaded from."""
        return self._origin

    @property
    def shapes_in_spark(self) -> bool:
        """Records go through Spark DataFrames (a transform or expectations): else they stay in
        the Python workers, decoded and written in one pass."""
        return self.transform is not None or bool(self.expectations)

    def static_columns(self) -> pa.Schema | None:
        """The table's columns when the config alone tells them (no registry, no transform)."""
        if self.shapes_in_spark or self.format.type in ("avro", "protobuf") or (
                self.key is not None and self.key.type in ("avro", "protobuf")):
            return None
        return records_schema(self.format.type, self.format.declared, key_type(self.key, self.format.type,
                                                                               self.key.declared if self.key else None),
                              self.headers)

    def redacted(self) -> dict[str, Any]:
        """The pipeline as a plain dict safe to print or log: secret option values masked."""
        shown = self.model_dump(mode="json", by_alias=True)
        shown["source"]["kafka_options"] = redact("kafka", self.source.kafka_options)
        shown["sink"]["storage_options"] = redact("storage", self.sink.storage_options)
        for block in ("format", "key"):
            if shown.get(block) and shown[block].get("schema_registry") is not None:
                shown[block]["schema_registry"] = redact("registry", shown[block]["schema_registry"])
        return shown


def format_timestamp_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def parse_timestamp_ms(value: str | datetime) -> int:
    """ISO-8601 text or a datetime to epoch milliseconds; a value without a zone is UTC."""
    parsed = value if isinstance(value, datetime) else datetime.fromisoformat(value.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return int(parsed.timestamp() * 1000)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of pipeline files, for editors (`oncemore schema`)."""
    return Pipeline.model_json_schema(by_alias=True)


# ---------------------------------------------------------------------------------------------
# Loading


def pipelines_dir() -> Path:
    return Path(os.environ.get(PIPELINES_DIR_ENV) or DEFAULT_PIPELINES_DIR)


def known_pipeline_names() -> list[str]:
    """The names of the pipeline files in the pipelines directory (not loaded)."""
    return sorted(p.stem for p in pipelines_dir().glob("*.y*ml"))


def load_named(name: str) -> Pipeline:
    """Pipeline ``name``: its YAML file in the pipelines directory."""
    return _directory_pipeline(resolve_config_path(name))


def resolve_config_path(name: str) -> Path:
    """The YAML file of pipeline ``name`` in the pipelines directory."""
    directory = pipelines_dir()
    for suffix in (".yaml", ".yml"):
        candidate = directory / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    raise ConfigError(str(directory), "", f"no pipeline named {name!r} (known: {', '.join(known_pipeline_names()) or 'none'})")


def load_pipeline(path: str | Path, environ: Mapping[str, str] | None = None) -> Pipeline:
    """The pipeline of a YAML file, named anything (``--config``; in the pipelines directory a
    file is named after its pipeline, which is how a name finds it)."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read: {exc.strerror or exc}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, "", f"not valid YAML: {_yaml_problem(exc)}") from None
    return parse_pipeline(raw, source, os.environ if environ is None else environ)


def _directory_pipeline(path: Path) -> Pipeline:
    pipeline = load_pipeline(path)
    if pipeline.name != path.stem:
        raise ConfigError(str(path), "name", f"must match the file name {path.stem!r} in the pipelines directory, got "
                                             f"{pipeline.name!r}")
    return pipeline


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Where and what, never the text around it: the line may hold a secret."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{context + ': ' if context else ''}{problem}"


def load_all(directory: Path | None = None) -> tuple[list[Pipeline], dict[str, ConfigError]]:
    """Every pipeline in ``directory``; broken files are returned apart so the others still load.
    Pipelines that share a table are all broken: a table belongs to one pipeline."""
    loaded, broken = [], {}
    for path in sorted((directory or pipelines_dir()).glob("*.y*ml")):
        try:
            loaded.append(_directory_pipeline(path))
        except ConfigError as exc:
            broken[str(path)] = exc
        except Exception as exc:  # a bug of ours must not take every other pipeline's DAG down
            broken[str(path)] = ConfigError(str(path), "", f"cannot be loaded ({type(exc).__name__})")
    broken.update(shared_tables(loaded))
    return [p for p in loaded if p.origin not in broken], broken


def shared_tables(pipelines: list[Pipeline]) -> dict[str, ConfigError]:
    """By file, the pipelines whose main or quarantine table is also another pipeline's table, with
    the error naming the other: two pipelines planning into one table would duplicate records."""
    owners: dict[str, list[tuple[Pipeline, str]]] = {}
    for pipeline in pipelines:
        for key, uri in (("sink.table_uri", pipeline.sink.table_uri), ("sink.quarantine_uri", pipeline.sink.quarantine_uri)):
            owners.setdefault(_table_key(uri), []).append((pipeline, key))
    errors: dict[str, ConfigError] = {}
    for users in owners.values():
        for pipeline, key in users:
            others = [f"{other.name} ({other.origin}, {other_key})" for other, other_key in users if other is not pipeline]
            if others and pipeline.origin not in errors:
                errors[pipeline.origin] = ConfigError(pipeline.origin, key, f"is also the table of pipeline {', '.join(others)}; "
                                                                     "a table belongs to one pipeline")
    return errors


def _table_key(uri: str) -> str:
    return (uri if "://" in uri else str(Path(uri).expanduser().resolve())).rstrip("/")


def substitute_env(value: Any, source: str, environ: Mapping[str, str], path: str = "") -> Any:
    """Replaces ``${VAR}`` and ``${VAR:-default}`` in every string of the document."""
    if isinstance(value, dict):
        return {k: substitute_env(v, source, environ, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_env(v, source, environ, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise ConfigError(source, path, f"environment variable {name} is not set")

    return _ENV_REF.sub(replace, value)


def parse_pipeline(raw: Any, source: str, environ: Mapping[str, str]) -> Pipeline:
    """A validated pipeline from a parsed YAML document; ConfigError names the first problem."""
    if not isinstance(raw, dict):
        raise ConfigError(source, "", f"must be a mapping, got {type(raw).__name__}")
    try:
        pipeline = Pipeline.model_validate(substitute_env(raw, source, environ))
    except ValidationError as exc:
        problems = [_problem(e) for e in exc.errors(include_url=False)]
        # A misspelt key also leaves the right one missing: the unknown key says what happened.
        meant = {suggested for _, _, suggested in problems if suggested}
        found = sorted(((k, p) for k, p, _ in problems if not (k in meant and p == "is required")),
                       key=lambda kp: not kp[1].startswith("unknown"))
        found = list(dict.fromkeys(found))  # a union's members may each report the same problem
        raise ConfigError(source, *found[0], more=found[1:]) from None
    pipeline._origin = source
    return pipeline


# What a YAML value is, for "got ..." (never the value itself: it may be a substituted secret).
_YAML_KINDS = {str: "a string", int: "a number", float: "a number", bool: "true/false", list: "a list",
               dict: "a mapping", type(None): "nothing (null)"}
# Pydantic's wording, in a YAML writer's words.
_PLAIN_WORDS = [(r"^Value error, ", ""), (r"^Input should be ", "must be "), (r"^String should ", "should "),
                (r"a valid (tuple|list)", "a list"), (r"a valid dictionary( or instance of \w+)?", "a mapping"),
                (r"a valid string", "a string"), (r"a valid integer(, unable to parse string as an integer)?", "an integer"),
                (r"a valid boolean(, unable to interpret input)?", "true or false"), (r"a valid number", "a number")]


def _problem(error: Mapping[str, Any]) -> tuple[str, str, str | None]:
    """Pydantic's error as (dotted key, problem, the key it was probably meant as). The problem
    never quotes the input; a type error names the YAML kind given."""
    loc = [str(part) for part in error["loc"] if not str(part).startswith("function-")]
    context = error.get("ctx") or {}
    if context.get("key"):
        loc.append(context["key"])
    # Pydantic names the member of a union it tried (transform.PythonTransform.python): not a key.
    members = {m.__name__ for m in _all_models(Pipeline)} | {m.__name__ for n in _all_models(Pipeline) for m in _models_in(n)}
    keys = [p for p in loc if p not in members | {"str", "int", "float", "bool"}]
    key, meant = ".".join(keys), None
    if error["type"] == "missing":
        problem = "is required"
    elif error["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        close = difflib.get_close_matches(keys[-1], allowed, n=1, cutoff=0.75)
        if close:
            meant = ".".join([*keys[:-1], close[0]])
            problem = f"unknown key; did you mean {meant}?"
        else:
            problem = f"unknown key (allowed: {', '.join(allowed)})"
    else:
        problem = error["msg"]
        for pattern, plain in _PLAIN_WORDS:
            problem = re.sub(pattern, plain, problem)
        if error["type"].endswith("_type") and "input" in error:
            problem += f", got {_YAML_KINDS.get(type(error['input']), type(error['input']).__name__)}"
    return key, problem, meant


def _allowed_keys(loc: list[str]) -> list[str]:
    """The keys of the model at ``loc`` (optional blocks, lists of blocks and unions included)."""
    model: type[BaseModel] = Pipeline
    for part in loc:
        field = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if field is not None:
            model = _model_of(field.annotation) or model
        # Otherwise a list index or the member of a union pydantic names (e.g. PythonTransform).
        elif any(m.__name__ == part for m in _models_in(model)):
            model = next(m for m in _models_in(model) if m.__name__ == part)
    return sorted(field.alias or name for name, field in model.model_fields.items())


def _models_in(model: type[BaseModel]) -> list[type[BaseModel]]:
    return [m for f in model.model_fields.values() for m in _all_models(f.annotation)]


def _all_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _all_models(arg)]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds (``Maintenance | None`` -> Maintenance), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_of, typing.get_args(annotation)) if m is not None), None)


def with_kafka_overrides(pipeline: Pipeline, overrides: Mapping[str, Any]) -> Pipeline:
    """The pipeline with ``bootstrap_servers`` and ``kafka_options`` taken from ``overrides`` (an
    Airflow connection, or ``run --kafka-overrides-file`` for a Spark job it launches)."""
    unknown = set(overrides) - {"bootstrap_servers", "kafka_options"}
    if unknown:
        raise ConfigError("Kafka overrides", sorted(unknown)[0], "unknown key (allowed: bootstrap_servers, kafka_options)")
    source = pipeline.source.model_copy(update={
        "bootstrap_servers": overrides.get("bootstrap_servers") or pipeline.source.bootstrap_servers,
        "kafka_options": {**pipeline.source.kafka_options,
                          **{k: _option_text(v) for k, v in overrides.get("kafka_options", {}).items()}},
    })
    return pipeline.model_copy(update={"source": source})  # keeps the origin (a private attribute)
