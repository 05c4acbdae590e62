"""The interface every record format's decoder keeps (json, avro, protobuf, raw), for record
keys and values alike: a batch of bytes in, one row of typed columns per input out, or the
reason that input cannot be stored.

Invariant: a decoder never turns a value it cannot represent into a NULL or a default. Every
input index is either a row of ``table`` (its Arrow schema, ``schema``) or in ``errors`` with a
one-line reason that names the field path (``customer.address.zip``) where there is one. A null
input (a null key, a tombstone) is a null row, never an error: whether it is acceptable is the
caller's call (decode/rows.py quarantines tombstone values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa


@dataclass(frozen=True)
class DecodedValues:
    """``table`` has one row per input, in input order; the rows of inputs in ``errors`` hold
    nulls and are never stored."""

    table: pa.Table
    errors: dict[int, str] = field(default_factory=dict)


class SchemaAhead(Exception):
    """The input at ``index`` was written with a schema that has fields the table's schema lacks
    (a producer moved to a newer registered schema during the run): decoding it into the table's
    schema would drop them. The reader stops its range there; the run evolves the table first."""

    def __init__(self, index: int, schema_id: int, message: str, role: str = "value"):
        super().__init__(message)
        self.index, self.schema_id, self.role = index, schema_id, role  # role: "value" or "key"

    def __reduce__(self):  # crosses from Spark's Python workers to the driver
        return SchemaAhead, (self.index, self.schema_id, str(self), self.role)


class ValueDecoder(Protocol):
    schema: pa.Schema

    def decode(self, values: pa.Array) -> DecodedValues:
        """``values``: binary (or large_binary) Arrow array, nulls allowed. May raise SchemaAhead."""
        ...
