"""What a pipeline's decoded records are, as executors need it: the value's and key's formats
(``FormatSpec``: for avro and protobuf the reader schema resolved on the driver, recordformat.py),
whether headers are read, and the columns the records become. Travels to executors as JSON and
rebuilds their decoders there; each format's decoder is imported only where that format is read,
so a Python worker decoding JSON never imports the registry client.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import pyarrow as pa

from .ddl import parse_ddl
from .schema import records_schema


@dataclass(frozen=True)
class FormatSpec:
    """One format (a value's or a key's) as executors need it: its type, and for json the declared
    DDL, for avro and protobuf the reader schema (``Schema.to_dict()``: registered, or a merge), the
    message, the declared DDL that projects it, and the writer schema IDs whose records are errors
    (``refused``: ID -> reason)."""

    type: str
    ddl: str | None = None
    registered: Mapping[str, Any] | None = None
    message: str | None = None
    framed: bool = False
    refused: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FormatSpec":
        """``asdict``'s form back, after JSON (which made the refused IDs text)."""
        return cls(**{**data, "refused": {int(k): v for k, v in data.get("refused", {}).items()}})

    def decoder(self, registry_settings: Mapping[str, str] | None):
        """The decoder of these values (raw and string: None, decode.py handles bytes and text)."""
        if self.type == "json":
            from .decode_json import JsonDecoder

            return JsonDecoder(parse_ddl(self.ddl))
        if self.type not in ("avro", "protobuf"):
            return None
        from confluent_kafka.schema_registry import Schema

        from .registry import Registry

        registered = Schema.from_dict(dict(self.registered))
        if self.type == "avro":
            from .decode_avro import AvroDecoder

            return AvroDecoder(Registry(registry_settings), registered, self.refused)
        from .decode_protobuf import ProtobufDecoder

        return ProtobufDecoder(Registry(registry_settings), registered, self.message, self.refused)

    def columns(self, registry_settings: Mapping[str, str] | None) -> pa.Schema | None:
        """The columns a record of this format becomes (json, avro, protobuf); a declared DDL keeps
        only its columns."""
        if self.type in ("raw", "string"):
            return None
        return parse_ddl(self.ddl) if self.ddl else self.decoder(registry_settings).schema


@dataclass(frozen=True)
class RecordSpec:
    """The records' formats, and whether they carry headers. Travels to executors as JSON."""

    value: FormatSpec
    key: FormatSpec | None
    headers: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RecordSpec":
        data = json.loads(text)
        return cls(value=FormatSpec.from_dict(data["value"]),
                   key=FormatSpec.from_dict(data["key"]) if data["key"] else None, headers=data["headers"])

    def schema(self, value_registry: Mapping[str, str] | None, key_registry: Mapping[str, str] | None) -> pa.Schema:
        """The records' columns (schema.records_schema)."""
        key = None
        if self.key is not None:
            columns = self.key.columns(key_registry)
            if columns is None:
                key = pa.binary() if self.key.type == "raw" else pa.string()
            elif self.key.type in ("avro", "protobuf") and columns.names == ["value"]:
                key = columns.field("value").type  # a key of one plain type (an Avro "string" key)
            else:
                key = pa.struct(list(columns))
        return records_schema(self.value.type, self.value.columns(value_registry), key, self.headers)
