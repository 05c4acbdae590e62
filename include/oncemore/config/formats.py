"""The ``format`` and ``key`` blocks of a pipeline file (and each route's ``format``): how a
record's value or key is decoded, checked as the file loads (decode/ reads records by it)."""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import Field, StrictBool, StrictStr, model_validator

from oncemore.config.values import ConfigModel, Options, key_problem
from oncemore.core.columns import SchemaError
from oncemore.core.ddl import check_json_types, parse_ddl


class Format(ConfigModel):
    """How a record's value (``format``) or key (``key``) is decoded.

    json: the declared Spark DDL (``schema``), the values plain, framed by Confluent's JSON Schema
    serializer (``confluent_framing``) or wrapped by Kafka Connect's JsonConverter (``schemas_enable``);
    avro and protobuf: Confluent's wire format, each record's writer schema fetched by ID from
    ``schema_registry`` and the table's from the subject's latest version (a declared ``schema`` is
    then checked against it); raw: the bytes; string: UTF-8 text."""
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
    schemas_enable: StrictBool = Field(
        default=False, description='json: values written by Kafka Connect\'s JsonConverter with schemas.enable=true, '
                                   '{"schema": ..., "payload": ...}: the payload is read, the schema consulted')

    @model_validator(mode="after")
    def _settings_fit_type(self) -> "Format":
        registered = self.type in ("avro", "protobuf")
        if self.type == "json" and not self.ddl:
            raise key_problem("schema", "is required for json (Spark DDL, e.g. 'id BIGINT, name STRING')")
        if self.ddl and self.type in ("raw", "string"):
            raise key_problem("schema", f"does not apply to type {self.type}")
        if self.ddl:
            try:
                check_json_types(parse_ddl(self.ddl)) if self.type == "json" else parse_ddl(self.ddl)
            except SchemaError as exc:
                raise key_problem("schema", str(exc)) from None
        if registered and not (self.schema_registry or {}).get("url"):
            raise key_problem("schema_registry", f"with a url is required for {self.type}")
        if self.confluent_framing and self.type != "json":
            raise key_problem("confluent_framing", "applies to type json (avro and protobuf are always framed)")
        if self.schemas_enable and self.type != "json":
            raise key_problem("schemas_enable", f"applies to type json (Kafka Connect's JsonConverter), not {self.type}")
        if self.schemas_enable and self.confluent_framing:
            raise key_problem("schemas_enable", "and confluent_framing are two different writers (JsonConverter's wrapper, "
                                                "Confluent's JSON Schema serializer): set the one that wrote the records")
        if self.schema_registry is not None and not (registered or self.confluent_framing):
            raise key_problem("schema_registry", f"does not apply to type {self.type}")
        if self.subject is not None and not registered:
            raise key_problem("subject", f"does not apply to type {self.type}")
        if self.message is not None and self.type != "protobuf":
            raise key_problem("message", "applies to type protobuf")
        return self

    @property
    def declared(self) -> pa.Schema | None:
        """The declared columns (Arrow), when a schema is declared."""
        return parse_ddl(self.ddl) if self.ddl else None
