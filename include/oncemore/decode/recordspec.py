"""What a pipeline's decoded records are, as executors need it: the value's and key's formats
(``FormatSpec``: for avro and protobuf the reader schema resolved on the driver, resolve.py),
and whether headers are read. Travels to executors as JSON and
rebuilds their decoders there (rows.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class FormatSpec:
    """One format (a value's or a key's) as executors need it: its type, and for json the declared
    DDL and its wire wrapping (``framed``: Confluent's JSON Schema header; ``schemas_enable``: Kafka
    Connect's JsonConverter wrapper), for avro and protobuf the reader schema (``registered``:
    ``RegistrySchema.to_dict()``, a registered schema with its ID, or a merge), the message, the
    declared DDL that projects it, and the writer schema IDs whose records are errors (``refused``:
    ID -> reason)."""

    type: str
    ddl: str | None = None
    registered: Mapping[str, Any] | None = None
    message: str | None = None
    framed: bool = False
    schemas_enable: bool = False
    envelope: str | None = None  # json: "debezium" when the value is Debezium's envelope around ``ddl``'s row
    refused: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FormatSpec":
        """``asdict``'s form back, after JSON (which made the refused IDs text)."""
        return cls(**{**data, "refused": {int(k): v for k, v in data.get("refused", {}).items()}})


@dataclass(frozen=True)
class RecordSpec:
    """The records' formats, whether they carry headers, and whether they are an upsert's change
    records (``changes``: a null value is a record, a tombstone, rather than an error, and each row
    keeps its record's bytes for the quarantine). Travels to executors as JSON."""

    value: FormatSpec
    key: FormatSpec | None
    headers: bool
    changes: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RecordSpec":
        data = json.loads(text)
        return cls(value=FormatSpec.from_dict(data["value"]),
                   key=FormatSpec.from_dict(data["key"]) if data["key"] else None, headers=data["headers"],
                   changes=data["changes"])
