"""Pipeline configuration: YAML model, ${ENV} substitution, validation and redaction.

Errors name the file, the key and the problem, and are raised before anything runs.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import yaml

from .schema import PARTITIONABLE_TYPES, SchemaError, main_table_schema, parse_schema

PIPELINES_DIR_ENV = "ONCEMORE_PIPELINES_DIR"
DEFAULT_PIPELINES_DIR = Path(__file__).resolve().parent.parent / "pipelines"

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Option keys whose values must never be printed (librdkafka's, and Spark's own defaults).
SECRET_KEY_PATTERN = r"password|secret|token|access[.]?key|jaas|ssl\.key|credentials"
_SECRET_KEY = re.compile(SECRET_KEY_PATTERN, re.I)
REDACTED = "***"


class ConfigError(ValueError):
    """A pipeline configuration problem, with the file and key it is about."""

    def __init__(self, source: str, key: str, problem: str):
        self.source, self.key, self.problem = source, key, problem
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


@dataclass(frozen=True)
class OffsetBound:
    """An offset per partition, as a user states it: ``earliest``, ``latest``, a record timestamp,
    or explicit per-partition offsets. Used for where new partitions start and where a run ends."""

    kind: str  # "earliest" | "latest" | "timestamp" | "offsets"
    timestamp_ms: int | None = None
    offsets: Mapping[int, int] = field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "timestamp":
            return format_timestamp_ms(self.timestamp_ms)
        if self.kind == "offsets":
            return json.dumps({str(p): o for p, o in sorted(self.offsets.items())})
        return self.kind

    @classmethod
    def parse(cls, value: Any, allowed: tuple[str, ...] = ("earliest", "latest")) -> "OffsetBound":
        """From YAML or command-line text: a keyword, an ISO-8601 timestamp (or ``{timestamp: ...}``),
        or ``{"0": 42, "1": 7}`` (a JSON string too). Raises ValueError naming the problem."""
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON offsets: {exc}") from exc
        if isinstance(value, str) and value in allowed:
            return cls(kind=value)
        if isinstance(value, dict) and set(value) == {"timestamp"}:
            value = value["timestamp"]
        if isinstance(value, (str, datetime)):
            text = value.isoformat() if isinstance(value, datetime) else value
            try:
                return cls(kind="timestamp", timestamp_ms=parse_timestamp_ms(text))
            except ValueError:
                raise ValueError(
                    f"must be {' | '.join(allowed)}, an ISO-8601 timestamp or per-partition offsets "
                    f'like {{"0": 42}}, got {text!r}'
                ) from None
        if isinstance(value, dict) and value:
            try:
                offsets = {int(p): int(o) for p, o in value.items()}
            except (TypeError, ValueError) as exc:
                raise ValueError(f"per-partition offsets must map partition numbers to offsets: {exc}") from exc
            if any(p < 0 or o < 0 for p, o in offsets.items()):
                raise ValueError("partitions and offsets must not be negative")
            return cls(kind="offsets", offsets=offsets)
        raise ValueError(
            f"must be {' | '.join(allowed)}, an ISO-8601 timestamp or per-partition offsets like "
            f'{{"0": 42}}, got {value!r}'
        )


@dataclass(frozen=True)
class Source:
    bootstrap_servers: str
    topic: str
    starting_offsets: OffsetBound
    kafka_options: Mapping[str, str]
    # A read that makes no progress for this long fails, naming partition and position
    # (a broker that never answers with OFFSET_OUT_OF_RANGE would otherwise hang the job).
    stall_timeout_seconds: float = 60.0

    def kafka_config(self) -> dict[str, str]:
        """librdkafka settings shared by every client of this pipeline (secrets included)."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.kafka_options}


@dataclass(frozen=True)
class Sink:
    table_uri: str
    quarantine_uri: str
    partition_by: tuple[str, ...] = ()
    # Object-store options for delta-rs (AWS_ENDPOINT_URL, ...); empty for local tables.
    storage_options: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Format:
    type: str  # "json" | "raw"
    schema: str | None = None  # Spark DDL, for json


@dataclass(frozen=True)
class Limits:
    max_records_per_commit: int = 1_000_000
    # Offsets per Spark task; a larger partition range is split into sub-ranges
    # (Spark's Kafka source calls this maxRecordsPerPartition).
    max_records_per_partition: int = 1_000_000
    # Key + value bytes read per commit and per Spark task: a task stops at its share, so large
    # values make more, smaller commits instead of exhausting memory or Arrow's 2 GiB buffers.
    max_bytes_per_commit: int = 8 << 30
    max_bytes_per_task: int = 256 << 20


@dataclass(frozen=True)
class AirflowSettings:
    """How the pipeline's DAG runs. Runs cover data intervals of ``schedule`` (a cron string)."""

    schedule: str = "0 * * * *"
    start_date_ms: int | None = None
    catchup: bool = False
    max_active_runs: int = 1
    owner: str = "oncemore"
    retries: int = 2
    retry_delay_minutes: float = 5.0
    tags: tuple[str, ...] = ()
    spark_conn_id: str = "oncemore_spark"
    kafka_conn_id: str | None = None


@dataclass(frozen=True)
class Pipeline:
    name: str
    source: Source
    sink: Sink
    format: Format
    limits: Limits = Limits()
    fail_on_data_loss: bool = True
    airflow: AirflowSettings = AirflowSettings()
    origin: str = "<config>"

    def table_schema(self):
        """The main table's Arrow schema."""
        return main_table_schema(self.format.type, self.format.schema)

    def redacted(self) -> dict[str, Any]:
        """The pipeline as a plain dict safe to print or log: secret option values masked."""
        return {
            "name": self.name,
            "source": {
                "bootstrap_servers": self.source.bootstrap_servers,
                "topic": self.source.topic,
                "starting_offsets": self.source.starting_offsets.describe(),
                "kafka_options": redact_options(self.source.kafka_options),
                "stall_timeout_seconds": self.source.stall_timeout_seconds,
            },
            "sink": {
                "table_uri": self.sink.table_uri,
                "quarantine_uri": self.sink.quarantine_uri,
                "partition_by": list(self.sink.partition_by),
            },
            "format": {"type": self.format.type, "schema": self.format.schema},
            "limits": asdict(self.limits),
            "fail_on_data_loss": self.fail_on_data_loss,
        }


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (REDACTED if _SECRET_KEY.search(k) else v) for k, v in options.items()}


def format_timestamp_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def parse_timestamp_ms(text: str) -> int:
    """ISO-8601 to epoch milliseconds; a value without a zone is UTC."""
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return int(parsed.timestamp() * 1000)


# ---------------------------------------------------------------------------------------------
# Loading


def pipelines_dir() -> Path:
    return Path(os.environ.get(PIPELINES_DIR_ENV) or DEFAULT_PIPELINES_DIR)


def resolve_config_path(name: str) -> Path:
    """The YAML file of pipeline ``name`` in the pipelines directory."""
    directory = pipelines_dir()
    for suffix in (".yaml", ".yml"):
        candidate = directory / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in directory.glob("*.y*ml"))
    raise ConfigError(str(directory), "", f"no pipeline named {name!r} (known: {', '.join(known) or 'none'})")


def load_pipeline(path: str | Path, environ: Mapping[str, str] | None = None) -> Pipeline:
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read: {exc.strerror or exc}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, "", f"not valid YAML: {exc}") from exc
    pipeline = parse_pipeline(raw, source, os.environ if environ is None else environ)
    if pipeline.name != path.stem:
        raise ConfigError(source, "name", f"must match the file name {path.stem!r}, got {pipeline.name!r}")
    return pipeline


def load_all(directory: Path | None = None) -> tuple[list[Pipeline], dict[str, ConfigError]]:
    """Every pipeline in ``directory``; broken files are returned apart so the others still load."""
    loaded, broken = [], {}
    for path in sorted((directory or pipelines_dir()).glob("*.y*ml")):
        try:
            loaded.append(load_pipeline(path))
        except ConfigError as exc:
            broken[str(path)] = exc
    return loaded, broken


# ---------------------------------------------------------------------------------------------
# Validation


class _Section:
    """Reads one mapping of the YAML, tracking the key path for error messages."""

    def __init__(self, value: Any, source: str, path: str, allowed: set[str]):
        self.source, self.path = source, path
        if not isinstance(value, dict):
            raise ConfigError(source, path or "<top>", f"must be a mapping, got {type(value).__name__}")
        unknown = sorted(set(map(str, value)) - allowed)
        if unknown:
            raise ConfigError(
                source, self._key(unknown[0]), f"unknown key (allowed: {', '.join(sorted(allowed))})"
            )
        self.value = value

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.source, self._key(key), problem)

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., required: bool = False):
        if key not in self.value or self.value[key] is None:
            if required or default is ...:
                raise self.error(key, "is required")
            return default
        value = self.value[key]
        # bool is an int in Python; a YAML `true` is never a valid number here.
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            names = " or ".join(t.__name__ for t in _as_tuple(kind))
            raise self.error(key, f"must be {names}, got {type(value).__name__} {value!r}")
        return value

    def section(self, key: str, allowed: set[str], required: bool = True) -> "_Section":
        value = self.value.get(key)
        if value is None and not required:
            value = {}
        return _Section(value, self.source, self._key(key), allowed)


def _as_tuple(kind):
    return kind if isinstance(kind, tuple) else (kind,)


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
    raw = substitute_env(raw, source, environ)
    top = _Section(raw, source, "", {"name", "source", "sink", "format", "limits", "fail_on_data_loss", "airflow"})
    name = top.get("name", str, required=True)
    if not _NAME.match(name):
        raise top.error("name", f"must be lowercase letters, digits and _ starting with a letter, got {name!r}")

    src = top.section(
        "source", {"bootstrap_servers", "topic", "starting_offsets", "kafka_options", "stall_timeout_seconds"}
    )
    topic = src.get("topic", str, required=True)
    if not topic.strip():
        raise src.error("topic", "must not be empty")
    kafka_options = src.get("kafka_options", dict, default={})
    for key, value in kafka_options.items():
        if not isinstance(value, (str, int, float, bool)):
            raise src.error(f"kafka_options.{key}", f"must be a scalar, got {type(value).__name__}")
    if "bootstrap.servers" in kafka_options:
        raise src.error("kafka_options.bootstrap.servers", "set source.bootstrap_servers instead")
    stall = src.get("stall_timeout_seconds", (int, float), default=60.0)
    if stall <= 0:
        raise src.error("stall_timeout_seconds", "must be positive")
    airflow = _parse_airflow(top)
    source_cfg = Source(
        bootstrap_servers=src.get("bootstrap_servers", str, required=True),
        topic=topic,
        starting_offsets=_parse_starting_offsets(src, airflow),
        kafka_options={str(k): _option_text(v) for k, v in kafka_options.items()},
        stall_timeout_seconds=float(stall),
    )

    sink = top.section("sink", {"table_uri", "quarantine_uri", "partition_by"})
    table_uri = sink.get("table_uri", str, required=True)
    partition_by = sink.get("partition_by", list, default=[])
    sink_cfg = Sink(
        table_uri=table_uri,
        quarantine_uri=sink.get("quarantine_uri", str, default=table_uri.rstrip("/") + "_quarantine"),
        partition_by=tuple(partition_by),
    )
    if sink_cfg.quarantine_uri.rstrip("/") == table_uri.rstrip("/"):
        raise sink.error("quarantine_uri", "must differ from table_uri")

    fmt = top.section("format", {"type", "schema"})
    fmt_type = fmt.get("type", str, required=True)
    if fmt_type not in ("json", "raw"):
        raise fmt.error("type", f"must be json or raw, got {fmt_type!r}")
    schema_text = fmt.get("schema", str, default=None)
    if fmt_type == "json":
        if not schema_text:
            raise fmt.error("schema", "is required for json (Spark DDL, e.g. 'id BIGINT, name STRING')")
        try:
            parse_schema(schema_text)
        except SchemaError as exc:
            raise fmt.error("schema", str(exc)) from exc
    elif schema_text:
        raise fmt.error("schema", "only applies to type json")
    format_cfg = Format(type=fmt_type, schema=schema_text)

    limit_keys = set(Limits.__dataclass_fields__)
    lim = top.section("limits", limit_keys, required=False)
    limits = Limits(**{key: lim.get(key, int, default=getattr(Limits, key)) for key in limit_keys})
    for key in sorted(limit_keys):
        if getattr(limits, key) < 1:
            raise lim.error(key, "must be at least 1")

    pipeline = Pipeline(
        name=name,
        source=source_cfg,
        sink=sink_cfg,
        format=format_cfg,
        limits=limits,
        fail_on_data_loss=top.get("fail_on_data_loss", bool, default=True),
        airflow=airflow,
        origin=source,
    )
    _check_partition_by(pipeline, sink)
    return pipeline


def _option_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parse_starting_offsets(src: _Section, airflow: AirflowSettings) -> OffsetBound:
    if "starting_offsets" not in src.value and airflow.start_date_ms is not None:
        # A scheduled pipeline starts with its first data interval.
        return OffsetBound(kind="timestamp", timestamp_ms=airflow.start_date_ms)
    try:
        return OffsetBound.parse(src.value.get("starting_offsets", "earliest"))
    except ValueError as exc:
        raise src.error("starting_offsets", str(exc)) from exc


def _parse_airflow(top: _Section) -> AirflowSettings:
    section = top.section("airflow", {
        "schedule", "start_date", "catchup", "max_active_runs", "owner", "retries", "retry_delay_minutes", "tags",
        "spark_conn_id", "kafka_conn_id",
    }, required=False)
    defaults = AirflowSettings()
    start_date = section.get("start_date", (str, datetime), default=None)
    start_date_ms = None
    if start_date is not None:
        try:
            start_date_ms = parse_timestamp_ms(start_date.isoformat() if isinstance(start_date, datetime) else start_date)
        except ValueError:
            raise section.error("start_date", f"not an ISO-8601 timestamp: {start_date!r}") from None
    schedule = section.get("schedule", str, default=defaults.schedule)
    if len(schedule.split()) != 5:
        raise section.error("schedule", f"must be a 5-field cron expression, got {schedule!r}")
    settings = AirflowSettings(
        schedule=schedule,
        start_date_ms=start_date_ms,
        catchup=section.get("catchup", bool, default=defaults.catchup),
        max_active_runs=section.get("max_active_runs", int, default=defaults.max_active_runs),
        owner=section.get("owner", str, default=defaults.owner),
        retries=section.get("retries", int, default=defaults.retries),
        retry_delay_minutes=float(section.get("retry_delay_minutes", (int, float), default=defaults.retry_delay_minutes)),
        tags=tuple(str(t) for t in section.get("tags", list, default=[])),
        spark_conn_id=section.get("spark_conn_id", str, default=defaults.spark_conn_id),
        kafka_conn_id=section.get("kafka_conn_id", str, default=None),
    )
    if settings.max_active_runs < 1:
        raise section.error("max_active_runs", "must be at least 1")
    if settings.retries < 0:
        raise section.error("retries", "must not be negative")
    return settings


def with_kafka_overrides(pipeline: Pipeline, overrides: Mapping[str, Any]) -> Pipeline:
    """The pipeline with ``bootstrap_servers`` and ``kafka_options`` taken from ``overrides`` (an
    Airflow connection, or ONCEMORE_KAFKA_OVERRIDES for a Spark job it launches)."""
    unknown = set(overrides) - {"bootstrap_servers", "kafka_options"}
    if unknown:
        raise ConfigError("Kafka overrides", sorted(unknown)[0], "unknown key (allowed: bootstrap_servers, kafka_options)")
    source = replace(
        pipeline.source,
        bootstrap_servers=overrides.get("bootstrap_servers") or pipeline.source.bootstrap_servers,
        kafka_options={**pipeline.source.kafka_options,
                       **{k: _option_text(v) for k, v in overrides.get("kafka_options", {}).items()}},
    )
    return replace(pipeline, source=source)


def _check_partition_by(pipeline: Pipeline, sink: _Section) -> None:
    schema = pipeline.table_schema()
    for column in pipeline.sink.partition_by:
        if not isinstance(column, str) or schema.get_field_index(column) < 0:
            raise sink.error("partition_by", f"{column!r} is not a column of the table ({', '.join(schema.names)})")
        if str(schema.field(column).type) not in PARTITIONABLE_TYPES:
            raise sink.error(
                "partition_by", f"{column!r} has type {schema.field(column).type}; partition by "
                f"one of {', '.join(sorted(PARTITIONABLE_TYPES))}"
            )
    if len(pipeline.sink.partition_by) >= len(schema.names):
        raise sink.error("partition_by", "cannot partition by every column")
