"""oncemore.decode.registry, the decoders' client of a Confluent-compatible registry, against Apicurio Registry
(devtools.schemaregistry) over HTTP, as Spark's workers reach it: what it caches, how it pickles, what
its failures show (never a secret); and what confluent-kafka's serializers write through the
registry, read by oncemore: Avro whose schema has references, JSON Schema's framing."""

from __future__ import annotations

import json
import pickle

import httpx
import pyarrow as pa
import pytest
from confluent_kafka.schema_registry import Schema, SchemaReference, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from devtools.schemaregistry import start_registry
from oncemore.decode.avro.decoder import AvroDecoder
from oncemore.decode.framing import split_frames, strip_confluent_framing
from oncemore.decode.recordspec import FormatSpec, RecordSpec
from oncemore.decode.registry import Registry, RegistryError, SchemaNotFound
from oncemore.decode.rows import RecordDecoder
from oncemore.kafka.batches import READ_SCHEMA

POINT = json.dumps({"type": "record", "name": "Point", "fields": [{"name": "x", "type": "long"}]})
POINT_V2 = json.dumps({"type": "record", "name": "Point", "fields": [
    {"name": "x", "type": "long"}, {"name": "y", "type": ["null", "long"], "default": None}]})


@pytest.fixture
def client(registry):
    with SchemaRegistryClient(registry.settings()) as connected:
        yield connected


def test_a_schema_with_references_is_read_with_the_schemas_they_name(client, registry):
    address = json.dumps({"type": "record", "name": "Address", "namespace": "geo",
                          "fields": [{"name": "zip", "type": "string"}]})
    person = json.dumps({"type": "record", "name": "Person", "fields": [{"name": "home", "type": "geo.Address"}]})
    client.register_schema("geo.Address", Schema(address, "AVRO"))
    referencing = Schema(person, "AVRO", [SchemaReference("geo.Address", "geo.Address", 1)])
    client.register_schema("people-value", referencing)
    serialize = AvroSerializer(client, referencing, conf={"auto.register.schemas": False, "use.latest.version": True})
    value = serialize({"home": {"zip": "75001"}}, SerializationContext("people", MessageField.VALUE))

    registry_client = Registry(registry.settings())
    latest = registry_client.latest("people-value")
    assert [(r.name, r.subject, r.version) for r in latest.schema.references] == [("geo.Address", "geo.Address", 1)]
    decoded = AvroDecoder(registry_client, latest.schema).decode(pa.array([value], pa.binary()))
    assert decoded.errors == {} and decoded.table.to_pylist() == [{"home": {"zip": "75001"}}]


def test_the_client_side_caches_by_id_asks_latest_anew_and_pickles(client, registry):
    subject = "evolving-points-value"  # the session registry: a subject no other test uses
    client.register_schema(subject, Schema(POINT, "AVRO"))
    registry_client = Registry(registry.settings())
    first = registry_client.latest(subject)
    assert first.version == 1 and registry_client.schema(first.schema.id).schema_str == POINT
    client.register_schema(subject, Schema(POINT_V2, "AVRO"))
    assert registry_client.latest(subject).version == 2  # no stale cache of "latest"
    copy = pickle.loads(pickle.dumps(registry_client))  # how it reaches Spark's workers
    assert copy.latest(subject).schema.id == registry_client.latest(subject).schema.id
    assert registry_client.version(subject, 1).schema.schema_str == POINT
    with pytest.raises(SchemaNotFound) as missing:
        registry_client.schema(4242)
    assert missing.value.evidence == {"url": registry.url, "status": 404, "schema_id": 4242}
    with pytest.raises(SchemaNotFound, match="subject 'nothing-here'"):
        registry_client.latest("nothing-here")


def test_schemas_by_id_are_kept_for_the_process_and_latest_is_asked_each_time():
    own = start_registry()
    settings = {**own.settings(), "max.retries": 0}
    try:
        with SchemaRegistryClient(own.settings()) as connected:
            schema_id = connected.register_schema("kept-value", Schema(POINT, "AVRO"))
        assert Registry(settings).schema(schema_id).schema_str == POINT
        assert Registry(settings).latest("kept-value").schema.id == schema_id
    finally:
        own.stop()
    # The registry is gone. Another Registry of the same settings (a task's unpickled copy) still
    # knows the schema by its ID: it was fetched once for the process. The latest version is not kept.
    assert Registry(settings).schema(schema_id).schema_str == POINT
    with pytest.raises(RegistryError, match="subject 'kept-value': ConnectError"):
        Registry(settings).latest("kept-value")


def test_basic_auth_is_required_when_asked_and_secrets_stay_out_of_errors():
    secured = start_registry(user_info="svc:correct-horse-battery")
    try:
        with SchemaRegistryClient(secured.settings()) as authorized:
            schema_id = authorized.register_schema("s-value", Schema(POINT, "AVRO"))
        assert httpx.get(f"{secured.url}/schemas/ids/{schema_id}").status_code == 401
        assert Registry(secured.settings()).schema(schema_id).schema_str == POINT

        settings = {"url": secured.url, "basic.auth.user.info": "svc:not-the-password"}
        with pytest.raises(RegistryError) as refused:
            Registry(settings).schema(schema_id)
        text = str(refused.value)
        assert "HTTP 401" in text and secured.url in text and "not-the-password" not in text
        assert "not-the-password" not in repr(Registry(settings))
        assert refused.value.evidence["status"] == 401 and not isinstance(refused.value, SchemaNotFound)
    finally:
        secured.stop()


def test_bad_settings_are_a_registry_error_without_their_values():
    with pytest.raises(RegistryError) as failure:
        Registry({"url": "http://127.0.0.1:1", "sasl.password": "hunter2-secret"}).latest("x")
    assert str(failure.value) == ("schema registry http://127.0.0.1:1: its settings: "
                                  "ValueError: Unrecognized properties: sasl.password")


def test_json_schema_framing_is_stripped_before_the_json_decoder(client):
    schema = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}}})
    serialize = JSONSerializer(schema, client)
    context = SerializationContext("people-json", MessageField.VALUE)
    values = pa.array([serialize({"id": 1, "name": "ada"}, context), b'{"id": 2, "name": "raw"}', None,
                       serialize({"id": 3, "name": "bob"}, context), b"\x00\x00"], pa.binary())
    payloads, errors = strip_confluent_framing(values)
    assert json.loads(payloads[0].as_py()) == {"id": 1, "name": "ada"} and payloads[1].as_py() is None
    assert sorted(errors) == [1, 4] and "not Confluent's magic byte 0" in errors[1] and "too short" in errors[4]
    frames = split_frames(values)
    assert frames.schema_ids.tolist() == [client.get_latest_version("people-json-value").schema_id, -1, -1,
                                          frames.schema_ids[0], -1]

    n = len(values)
    records = pa.table({"key": pa.nulls(n, pa.binary()), "value": values, "topic": ["people-json"] * n,
                        "partition": pa.array([0] * n, pa.int32()), "offset": pa.array(range(n), pa.int64()),
                        "timestamp": pa.nulls(n, READ_SCHEMA.field("timestamp").type),
                        "timestampType": pa.array([0] * n, pa.int32()),
                        "headers": pa.nulls(n, READ_SCHEMA.field("headers").type),
                        "timestamp_ms": pa.nulls(n, pa.int64())}, schema=READ_SCHEMA)
    decoded = RecordDecoder(RecordSpec(FormatSpec("json", ddl="id BIGINT, name STRING", framed=True), None, False)).decode(records)
    assert decoded.good.select(["id", "name"]).to_pylist() == [{"id": 1, "name": "ada"}, {"id": 3, "name": "bob"}]
