"""The development schema registry, as confluent-kafka's client and serializers use it, and the client
side (oncemore.registry): a real subprocess reached over HTTP, as Spark's workers reach it."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys

import httpx
import pyarrow as pa
import pytest
from confluent_kafka.schema_registry import Schema, SchemaReference, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from oncemore.decode import RecordDecoder
from oncemore.recordspec import FormatSpec, RecordSpec
from oncemore.devregistry import start_registry
from oncemore.framing import split_frames, strip_confluent_framing
from oncemore.registry import Registry, RegistryError, SchemaNotFound
from oncemore.schema import RECORD_SCHEMA

POINT = json.dumps({"type": "record", "name": "Point", "fields": [{"name": "x", "type": "long"}]})
POINT_V2 = json.dumps({"type": "record", "name": "Point", "fields": [
    {"name": "x", "type": "long"}, {"name": "y", "type": ["null", "long"], "default": None}]})


@pytest.fixture
def client(registry):
    with SchemaRegistryClient(registry.settings()) as connected:
        yield connected


def test_registering_is_idempotent_and_ids_are_global(client):
    first = client.register_schema("points-value", Schema(POINT, "AVRO"))
    # The same schema laid out differently, again and under another subject: the same ID, no new version.
    assert client.register_schema("points-value", Schema(json.dumps(json.loads(POINT), indent=2), "AVRO")) == first
    assert client.register_schema("other-points-value", Schema(POINT, "AVRO")) == first
    second = client.register_schema("points-value", Schema(POINT_V2, "AVRO"))
    assert second != first and client.get_versions("points-value") == [1, 2]
    assert {"points-value", "other-points-value"} <= set(client.get_subjects())

    latest = client.get_latest_version("points-value")
    assert (latest.schema_id, latest.version, latest.subject) == (second, 2, "points-value")
    found = client.lookup_schema("points-value", Schema(POINT, "AVRO"))
    assert (found.schema_id, found.version) == (first, 1)
    assert client.get_schema(first).schema_str == POINT and client.get_schema(first).schema_type == "AVRO"
    assert client.get_version("points-value", 1).schema_id == first
    assert sorted(client.get_subjects_by_schema_id(first)) == ["other-points-value", "points-value"]
    assert client.get_config().compatibility_level.value == "NONE"


def test_answers_confluent_error_codes(client, registry):
    for call, code in [(lambda: client.get_schema(9999), 40403),
                       (lambda: client.get_version("no-such-subject", 1), 40401),
                       (lambda: client.lookup_schema("no-such-subject", Schema(POINT, "AVRO")), 40401),
                       (lambda: client.register_schema("bad", Schema("{not json", "AVRO")), 42201),
                       (lambda: client.register_schema("bad", Schema('{"type": "nonsense"}', "AVRO")), 42201),
                       (lambda: client.register_schema("bad", Schema("syntax = 'proto3';", "PROTOBUF")), 42201),
                       (lambda: client.set_compatibility(level="BACKWARD"), 42203)]:
        with pytest.raises(SchemaRegistryError) as failure:
            call()
        assert failure.value.error_code == code
    client.register_schema("points-value", Schema(POINT, "AVRO"))
    with pytest.raises(SchemaRegistryError) as failure:
        client.get_version("points-value", 99)
    assert failure.value.error_code == 40402
    assert httpx.get(f"{registry.url}/schemas/types").json() == ["AVRO", "JSON", "PROTOBUF"]


def test_avro_serializer_and_deserializer_round_trip(client):
    context = SerializationContext("rounds", MessageField.VALUE)
    old = AvroSerializer(client, POINT)({"x": 1}, context)
    new = AvroSerializer(client, POINT_V2)({"x": 2, "y": 3}, context)
    assert old[0] == 0 and int.from_bytes(old[1:5], "big") == client.get_version("rounds-value", 1).schema_id
    assert AvroDeserializer(client)(old, context) == {"x": 1}
    assert AvroDeserializer(client, POINT_V2)(old, context) == {"x": 1, "y": None}
    assert AvroDeserializer(client)(new, context) == {"x": 2, "y": 3}


def test_references_are_served_with_the_schema(client, registry):
    address = json.dumps({"type": "record", "name": "Address", "namespace": "geo", "fields": [{"name": "zip", "type": "string"}]})
    person = json.dumps({"type": "record", "name": "Person", "fields": [{"name": "home", "type": "geo.Address"}]})
    client.register_schema("geo.Address", Schema(address, "AVRO"))
    reference = SchemaReference("geo.Address", "geo.Address", 1)
    person_id = client.register_schema("people-value", Schema(person, "AVRO", [reference]))
    answer = httpx.get(f"{registry.url}/schemas/ids/{person_id}").json()
    assert answer == {"schema": person, "references": [{"name": "geo.Address", "subject": "geo.Address", "version": 1}]}
    context = SerializationContext("people", MessageField.VALUE)
    serializer = AvroSerializer(client, Schema(person, "AVRO", [reference]), conf={"auto.register.schemas": False,
                                                                                 "use.latest.version": True})
    assert AvroDeserializer(client)(serializer({"home": {"zip": "75001"}}, context), context) == {"home": {"zip": "75001"}}
    with pytest.raises(SchemaRegistryError) as failure:  # a reference to nothing registered
        client.register_schema("orphans-value", Schema(person, "AVRO", [SchemaReference("geo.Address", "nowhere", 1)]))
    assert failure.value.error_code == 42201


def test_the_client_side_caches_by_id_asks_latest_anew_and_pickles(client, registry):
    subject = "evolving-points-value"  # the session registry: a subject no other test uses
    client.register_schema(subject, Schema(POINT, "AVRO"))
    registry_client = Registry(registry.settings())
    first = registry_client.latest(subject)
    assert first.version == 1 and registry_client.schema(first.id).schema_str == POINT
    client.register_schema(subject, Schema(POINT_V2, "AVRO"))
    assert registry_client.latest(subject).version == 2  # no stale cache of "latest"
    copy = pickle.loads(pickle.dumps(registry_client))  # how it reaches Spark's workers
    assert copy.latest(subject).id == registry_client.latest(subject).id
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
        assert Registry(settings).latest("kept-value").id == schema_id
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


def test_runs_as_a_module_printing_its_url_and_stops_on_sigterm():
    process = subprocess.Popen([sys.executable, "-m", "oncemore.devregistry", "--port", "0"],
                               stdout=subprocess.PIPE, text=True,
                               env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1] / "include")})
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/subjects").json() == []
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0


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
                        "timestamp": pa.nulls(n, RECORD_SCHEMA.field("timestamp").type),
                        "timestampType": pa.array([0] * n, pa.int32()),
                        "headers": pa.nulls(n, RECORD_SCHEMA.field("headers").type),
                        "timestamp_ms": pa.nulls(n, pa.int64())}, schema=RECORD_SCHEMA)
    decoded = RecordDecoder(RecordSpec(FormatSpec("json", ddl="id BIGINT, name STRING", framed=True), None, False)).decode(records)
    assert decoded.good.select(["id", "name"]).to_pylist() == [{"id": 1, "name": "ada"}, {"id": 3, "name": "bob"}]
