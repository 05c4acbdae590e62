"""The values a pipeline file states, each parsed and checked where the file loads: offset bounds
(``earliest``, ``latest``, a timestamp, offsets per partition), cron schedules, option maps; the
one error type of a pipeline configuration, and the one base of the models of its parts.

Invariant: a problem names the key and never the value (a value may be a substituted secret).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Any, Iterable, Mapping

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, StrictInt, StrictStr,
                      WithJsonSchema)
from pydantic_core import PydanticCustomError

from oncemore.core.coordinates import KafkaPartition


class ConfigError(ValueError):
    """A pipeline configuration's problems, each with the key it is about, in one line naming the
    file; ``key`` and ``problem`` are the first."""

    def __init__(self, source: str, key: str, problem: str, more: Iterable[tuple[str, str]] = ()):
        self.source, self.key, self.problem = source, key, problem
        self.problems = [(key, problem), *more]
        self.summary = "; ".join(f"{k}: {p}" if k else p for k, p in self.problems)  # the message without the file
        super().__init__(f"{source}: {self.summary}")


class ConfigModel(BaseModel):
    """A part of a pipeline file: unchanged once loaded (a run's steps share one), and a key it does
    not know is an error, never ignored (a misspelt key would silently take its default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


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


def key_problem(key: str, problem: str) -> PydanticCustomError:
    """A validation error about ``key`` below the validated model (reported as its path)."""
    return PydanticCustomError("oncemore", "{problem}", {"problem": problem, "key": key})


def _offset_bound(value: Any) -> OffsetBound:
    try:
        return OffsetBound.parse(value)
    except ValueError as exc:
        raise key_problem("", str(exc)) from None


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


def option_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _options_text(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    for key, option in value.items():
        if not isinstance(option, (str, int, float, bool)):
            raise key_problem(str(key), f"must be a scalar, got {type(option).__name__}")
    return {str(k): option_text(v) for k, v in value.items()}


# librdkafka and delta-rs take text: YAML scalars become text, anything else is refused.
Options = Annotated[dict[str, str], BeforeValidator(_options_text)]


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
