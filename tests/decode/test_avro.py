"""Avro in Confluent's wire format: values produced by confluent-kafka's own AvroSerializer against
Apicurio Registry (a JVM of its own, reached over HTTP), decoded by AvroDecoder in another process
(a spawn child that shares no memory with the producer), written to Delta and read back by DuckDB."""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import subprocess
import sys
import uuid
from dataclasses import asdict, replace
from decimal import Decimal

import fastavro
import pyarrow as pa
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from deltalake import DeltaTable, write_deltalake
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from conftest import ROOT, decode_in_child, duckdb_connection
from devtools.schemaregistry import start_registry
from oncemore.commit.inputs import AheadRecord
from oncemore.commit.tables import ensure_table
from oncemore.core.columns import SchemaError
from oncemore.decode.avro.compare import compare_schemas
from oncemore.decode.avro.decoder import AvroDecoder, avro_to_arrow
from oncemore.decode.avro.merge import merge_schemas
from oncemore.decode.avro.schemas import AvroSchema
from oncemore.decode.decoder import SchemaAhead
from oncemore.decode.recordspec import FormatSpec, RecordSpec
from oncemore.decode.registry import Registry, RegistryError, RegistrySchema
from oncemore.decode.rows import RecordDecoder, format_decoder
from oncemore.kafka.batches import READ_SCHEMA
from oncemore.run.tasks import _RangeDecoding
from oncemore.run.taskspec import TaskSpec

UTC = datetime.timezone.utc
ADDRESS = {"type": "record", "name": "Address", "fields": [{"name": "zip", "type": "string"}]}
ORDER = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "id", "type": "long"},
    {"name": "customer", "type": {"type": "record", "name": "Customer", "fields": [
        {"name": "name", "type": "string"},
        {"name": "address", "type": ["null", ADDRESS], "default": None}]}},
    {"name": "items", "type": {"type": "array", "items": {"type": "record", "name": "Item", "fields": [
        {"name": "sku", "type": "string"}, {"name": "qty", "type": "int"},
        {"name": "tags", "type": {"type": "array", "items": "string"}}]}}},
    {"name": "attributes", "type": {"type": "map", "values": ["null", "double"]}},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
    {"name": "big", "type": {"type": "fixed", "name": "Big", "size": 16, "logicalType": "decimal", "precision": 38, "scale": 6}},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    {"name": "placed", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "paid", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
    {"name": "local", "type": {"type": "long", "logicalType": "local-timestamp-micros"}},
    {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["NEW", "PAID", "SHIPPED"]}},
    {"name": "note", "type": ["null", "string", "shop.Address", "long"], "default": None},
    {"name": "count", "type": ["int", "long"]},
    {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 4}},
    {"name": "flag", "type": "boolean"},
    {"name": "ratio", "type": "float"},
]}


def order(i: int) -> dict:
    return {
        "id": i, "customer": {"name": f"customer-{i}", "address": {"zip": f"{10000 + i}"} if i % 2 else None},
        "items": [{"sku": f"sku-{i}-{k}", "qty": k, "tags": ["a"] * k} for k in range(i % 3)],
        "attributes": {"weight": i * 0.5, "missing": None},
        "amount": Decimal(f"{i}.{i % 100:02d}"), "big": Decimal("12345678901234567890123456789012.345678"),
        "day": datetime.date(2024, 2, 29) + datetime.timedelta(days=i),
        "placed": datetime.datetime(2024, 3, 1, 12, 0, 0, 123000, tzinfo=UTC) + datetime.timedelta(seconds=i),
        "paid": datetime.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC) if i == 1 else None,
        "local": datetime.datetime(2024, 3, 1, 12, 0, 0, 654321), "ref": str(uuid.UUID(int=i)),
        "status": ["NEW", "PAID", "SHIPPED"][i % 3],
        "note": [None, "text", ("shop.Address", {"zip": "0"}), 2 ** 40][i % 4], "count": i, "digest": b"\x00\x01\x02\x03",
        "flag": bool(i % 2), "ratio": 0.5,
    }


def expected_row(i: int) -> dict:
    """order(i) as the table holds it (timestamps as Arrow reads them back: aware in UTC)."""
    record = order(i)
    note = {"member0": None, "member1": None, "member2": None}
    if i % 4:
        note[f"member{i % 4 - 1}"] = {"zip": "0"} if i % 4 == 2 else record["note"]
    return {**record, "attributes": list(record["attributes"].items()), "note": note if i % 4 else None,
            "status": record["status"], "ref": record["ref"]}


@pytest.fixture
def elsewhere(spawned):
    """Decodes in another Python process (spawned: nothing inherited), as a Spark worker does."""
    return lambda settings, reader, values: spawned(decode_in_child, settings, "avro", reader, values)


def serializer(registry, subject_schema: dict) -> AvroSerializer:
    client = SchemaRegistryClient(registry.settings())
    return AvroSerializer(client, json.dumps(subject_schema))


def produce(ser: AvroSerializer, topic: str, records: list) -> list[bytes | None]:
    context = SerializationContext(topic, MessageField.VALUE)
    return [None if r is None else ser(r, context) for r in records]


def assert_delta_round_trip(table: pa.Table, path: str) -> None:
    write_deltalake(path, table)
    assert DeltaTable(path).to_pyarrow_table().sort_by("id").to_pylist() == table.sort_by("id").to_pylist()
    read = duckdb_connection().execute(f"SELECT * FROM delta_scan('{path}') ORDER BY id").to_arrow_table()
    rows = read.to_pylist()
    for row in rows:  # DuckDB hands maps over as lists of key/value pairs like Arrow; timestamps keep the zone
        assert set(row) == set(table.column_names)
    assert rows == table.sort_by("id").to_pylist()


def test_nested_records_arrays_maps_decimals_and_times_round_trip_through_delta(registry, elsewhere, tmp_path):
    topic = "orders-types"
    values = produce(serializer(registry, ORDER), topic, [order(i) for i in range(8)] + [None])
    kind, table, errors = elsewhere(registry.settings(), (f"{topic}-value", "latest"), values)
    assert kind == "decoded" and errors == {}
    assert table.schema == avro_to_arrow(ORDER)
    assert table.num_rows == 9 and all(v is None for v in table.slice(8).to_pylist()[0].values())  # tombstone
    assert table.slice(0, 8).to_pylist() == [expected_row(i) for i in range(8)]
    assert_delta_round_trip(table.slice(0, 8), str(tmp_path / "orders"))


def test_table_schema_follows_spark_and_delta(registry):
    schema = avro_to_arrow(ORDER)
    assert schema.field("items").type == pa.list_(pa.field("element", pa.struct([
        ("sku", pa.string()), ("qty", pa.int32()), ("tags", pa.list_(pa.field("element", pa.string())))])))
    assert schema.field("attributes").type == pa.map_(pa.field("key", pa.string(), nullable=False),
                                                        pa.field("value", pa.float64()))
    assert schema.field("customer").type == pa.struct([("name", pa.string()), ("address", pa.struct([("zip", pa.string())]))])
    assert [schema.field(n).type for n in ("amount", "big", "day", "placed", "paid", "local", "ref", "status",
                                           "count", "digest", "flag", "ratio")] == [
        pa.decimal128(12, 2), pa.decimal128(38, 6), pa.date32(), pa.timestamp("us", "UTC"), pa.timestamp("us", "UTC"),
        pa.timestamp("us"), pa.string(), pa.string(), pa.int64(), pa.binary(), pa.bool_(), pa.float32()]
    assert schema.field("note").type == pa.struct([("member0", pa.string()), ("member1", pa.struct([("zip", pa.string())])),
                                                   ("member2", pa.int64())])
    # What Spark's Arrow conversion makes of it comes back unchanged, and delta-rs takes it.
    assert to_arrow_schema(from_arrow_schema(schema), timezone="UTC") == schema
    from deltalake import Schema as DeltaSchema
    DeltaSchema.from_arrow(schema)
    assert avro_to_arrow('"string"') == pa.schema([("value", pa.string())])
    assert avro_to_arrow({"type": "array", "items": "long"}) == pa.schema([("value", pa.list_(pa.field("element", pa.int64())))])


@pytest.mark.parametrize("schema, complaint", [
    ({"type": "record", "name": "Node", "fields": [{"name": "next", "type": ["null", "Node"]}]}, "contains itself"),
    ({"type": "record", "name": "R", "fields": [{"name": "x", "type": ["int", "long", "string"]}]}, "union of int and long"),
    ({"type": "record", "name": "R", "fields": [{"name": "_kafka_offset", "type": "long"}]}, "reserved"),
    ({"type": "record", "name": "R", "fields": [{"name": "d", "type": {"type": "bytes", "logicalType": "decimal",
                                                                        "precision": 40, "scale": 2}}]}, "precision 1..38"),
])
def test_schemas_a_table_cannot_take_are_refused_naming_the_field(schema, complaint):
    with pytest.raises(SchemaError, match=complaint):
        avro_to_arrow(schema)


V1 = {"type": "record", "name": "User", "namespace": "crm", "fields": [
    {"name": "id", "type": "long"},
    {"name": "profile", "type": {"type": "record", "name": "Profile", "fields": [{"name": "name", "type": "string"}]}}]}
V2 = {**V1, "fields": [V1["fields"][0],
                       {"name": "profile", "type": {"type": "record", "name": "Profile", "fields": [
                           {"name": "name", "type": "string"},
                           {"name": "phone", "type": ["null", "string"], "default": None}]}},
                       {"name": "email", "type": ["null", "string"], "default": None}]}


def test_a_newer_schema_adding_nullable_fields_reads_older_records_as_null_and_is_ahead_of_the_old_table(
        registry, elsewhere, tmp_path):
    topic, subject = "users", "users-value"
    old = produce(serializer(registry, V1), topic, [{"id": i, "profile": {"name": f"n{i}"}} for i in range(3)])
    new = produce(serializer(registry, V2), topic,
                  [{"id": i, "profile": {"name": f"n{i}", "phone": f"+{i}"}, "email": f"u{i}@x"} for i in range(3, 5)])
    values = old[:2] + new[:1] + old[2:] + new[1:]

    kind, table, errors = elsewhere(registry.settings(), (subject, "latest"), values)
    assert kind == "decoded" and errors == {}
    assert table.schema == avro_to_arrow(V2)
    assert table.to_pylist() == [
        {"id": 0, "profile": {"name": "n0", "phone": None}, "email": None},
        {"id": 1, "profile": {"name": "n1", "phone": None}, "email": None},
        {"id": 3, "profile": {"name": "n3", "phone": "+3"}, "email": "u3@x"},
        {"id": 2, "profile": {"name": "n2", "phone": None}, "email": None},
        {"id": 4, "profile": {"name": "n4", "phone": "+4"}, "email": "u4@x"}]
    assert_delta_round_trip(table, str(tmp_path / "users"))

    # The table still at version 1: the first version-2 record stops the batch, naming what v1 lacks.
    result = elsewhere(registry.settings(), (subject, 1), values)
    assert result[:3] == ("ahead", 2, Registry(registry.settings()).latest(subject).schema.id)
    assert "field profile.phone" in result[3] and "field email" in result[3]
    # The records before it decode into v1.
    kind, prefix, errors = elsewhere(registry.settings(), (subject, 1), values[:2])
    assert (kind, errors, prefix.column("id").to_pylist()) == ("decoded", {}, [0, 1])


def test_records_that_cannot_be_decoded_are_errors_with_reasons(registry, elsewhere):
    topic, subject = "payments", "payments-value"

    def payment(amount: dict, at: str) -> dict:
        return {"type": "record", "name": "Payment", "fields": [
            {"name": "id", "type": "long"}, {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", **amount}},
            {"name": "at", "type": {"type": "long", "logicalType": at}}]}

    def one(schema: dict, i: int, amount: str) -> bytes:
        at = datetime.datetime(2024, 1, 1, tzinfo=UTC)
        return produce(serializer(registry, schema), topic, [{"id": i, "amount": Decimal(amount), "at": at}])[0]

    good = one(payment({"precision": 6, "scale": 2}, "timestamp-micros"), 1, "1.50")
    too_wide = one(payment({"precision": 12, "scale": 2}, "timestamp-micros"), 2, "123456.78")
    other_unit = one(payment({"precision": 6, "scale": 2}, "timestamp-millis"), 3, "1")
    # The table's schema is the first version; the later ones were registered with compatibility off.
    unknown_id = b"\x00\x00\x00\x7f\xff" + good[5:]
    values = [good, unknown_id, b"{\"id\": 1}", b"\x00\x01", good[:-3], good + b"\x00\x00", too_wide, other_unit, None,
              b"\x00" + good[1:5] + b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]

    kind, table, errors = elsewhere(registry.settings(), (subject, 1), values)
    assert kind == "decoded"
    assert table.column("id").to_pylist() == [1] + [None] * 9
    assert sorted(errors) == [1, 2, 3, 4, 5, 6, 7, 9]
    assert "schema ID 32767 is not in the registry" in errors[1]
    assert "not Confluent's magic byte 0" in errors[2] and "'{'" in errors[2]
    assert "too short for Confluent framing" in errors[3]
    written_with = int.from_bytes(good[1:5], "big")
    assert f"payload is not a record of writer schema {written_with} (truncated or garbage?)" in errors[4]
    assert "2 bytes left over" in errors[5]
    assert "field amount: 123456.78 does not fit DECIMAL(6,2)" in errors[6]
    assert "at is timestamp-millis in the writer, timestamp-micros in the table" in errors[7]
    assert f"payload is not a record of writer schema {written_with} (truncated or garbage?)" in errors[9]


def test_an_unreachable_registry_fails_the_batch_instead_of_quarantining(registry):
    values = produce(serializer(registry, V1), "dead", [{"id": 1, "profile": {"name": "x"}}])
    dead = Registry({"url": "http://127.0.0.1:9", "max.retries": 0})
    decoder = AvroDecoder(dead, RegistrySchema(json.dumps(V1)))
    with pytest.raises(RegistryError, match=r"schema registry http://127.0.0.1:9: schema ID \d+: ConnectError"):
        decoder.decode(pa.array(values, pa.binary()))


def test_records_of_the_readers_own_id_are_read_without_the_registry_or_its_client(registry):
    """A worker's reader schema comes with the ID it is registered under: records of that ID need no
    request, so a worker reading only those never loads the registry client (23 MiB a process); a
    reader the registry never served (a merge) has none."""
    values = produce(serializer(registry, V1), "own-id", [{"id": 3, "profile": {"name": "o"}}])
    latest = Registry(registry.settings()).latest("own-id-value")
    spec = FormatSpec("avro", registered=latest.schema.to_dict())
    assert latest.schema.id == int.from_bytes(values[0][1:5], "big") and RegistrySchema(json.dumps(V1)).id is None
    dead = {"url": "http://127.0.0.1:9", "max.retries": 0}
    child = ("import json, sys; import pyarrow as pa\n"
             "from oncemore.decode.recordspec import FormatSpec\n"
             "from oncemore.decode.rows import format_decoder\n"
             "spec, dead, value = json.loads(sys.argv[1])\n"
             "decoded = format_decoder(FormatSpec(**spec), dead).decode(pa.array([bytes.fromhex(value)], pa.binary()))\n"
             "print(json.dumps([decoded.table.to_pylist(), decoded.errors,\n"
             "                  sorted(m for m in sys.modules if m.startswith('confluent_kafka.schema_registry'))]))\n")
    run = subprocess.run([sys.executable, "-c", child, json.dumps([asdict(spec), dead, values[0].hex()])],
                         env={**os.environ, "PYTHONPATH": str(ROOT / "include")}, capture_output=True, text=True, check=True)
    assert json.loads(run.stdout) == [[{"id": 3, "profile": {"name": "o"}}], {}, []]
    # Without the ID, the same record's writer is asked for: here of a registry that is down.
    with pytest.raises(RegistryError, match=rf"schema ID {latest.schema.id}: ConnectError"):
        format_decoder(replace(spec, registered={**spec.registered, "id": None}), dead).decode(
            pa.array(values, pa.binary()))


def test_a_registry_that_never_answers_times_out_instead_of_stalling_the_run():
    import socket
    import time

    from oncemore.decode.registry import REQUEST_TIMEOUT_SECONDS

    silent = socket.socket()  # accepts connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    assert Registry({"url": url}).settings["timeout"] == REQUEST_TIMEOUT_SECONDS  # never without one
    started = time.monotonic()
    with pytest.raises(RegistryError, match=rf"schema registry {url}: subject 'orders-value': ReadTimeout"):
        Registry({"url": url, "max.retries": "0", "timeout": "1"}).latest("orders-value")
    assert time.monotonic() - started < 10
    silent.close()


def test_basic_auth_settings_pass_through_and_the_secret_never_shows(elsewhere):
    secured = start_registry(user_info="ingest:pa55-w0rd-s3cret")
    try:
        values = produce(serializer(secured, V1), "secured", [{"id": 7, "profile": {"name": "s"}}])
        kind, table, errors = elsewhere(secured.settings(), ("secured-value", "latest"), values)
        assert (kind, errors, table.column("id").to_pylist()) == ("decoded", {}, [7])

        wrong = {**secured.settings(), "basic.auth.user.info": "ingest:wrong-s3cret-guess"}
        kind, message = elsewhere(wrong, ("secured-value", "latest"), values)
        assert kind == "registry" and "HTTP 401" in message and secured.url in message
        assert "wrong-s3cret-guess" not in message and "pa55-w0rd-s3cret" not in message

        in_url = {"url": secured.url.replace("http://", "http://ingest:wrong-s3cret-guess@")}
        with pytest.raises(RegistryError) as failure:
            Registry(in_url).latest("secured-value")
        assert "wrong-s3cret-guess" not in str(failure.value) and "***@127.0.0.1" in str(failure.value)
    finally:
        secured.stop()


def test_decoders_pickle_for_spark_workers(registry):
    produce(serializer(registry, V1), "pickled-avro", [{"id": 1, "profile": {"name": "p"}}])
    settings = registry.settings()
    decoder = AvroDecoder(Registry(settings), Registry(settings).latest("pickled-avro-value").schema)
    copy = pickle.loads(pickle.dumps(decoder))
    assert copy.schema == decoder.schema and copy.registry.settings == decoder.registry.settings == {**settings, "timeout": 30.0}


def test_the_merge_of_the_reader_and_a_writer_ahead_of_it_reads_records_of_both(registry):
    # The reader (the subject's latest) dropped `legacy` and has a union and an enum; the writer
    # (an old producer) still writes `legacy`, a third union branch, another symbol, and more in a
    # named record that both use twice.
    contact = {"type": "record", "name": "Contact", "fields": [{"name": "email", "type": "string"}]}
    reader = {"type": "record", "name": "Lead", "namespace": "crm", "fields": [
        {"name": "id", "type": "long"}, {"name": "home", "type": contact}, {"name": "work", "type": ["null", "Contact"]},
        {"name": "score", "type": ["null", "long"], "default": None},
        {"name": "stage", "type": {"type": "enum", "name": "Stage", "symbols": ["NEW", "WON"]}},
        {"name": "since", "type": {"type": "long", "logicalType": "timestamp-micros"}}]}
    writer = {"type": "record", "name": "Lead", "namespace": "crm", "fields": [
        {"name": "id", "type": "int"},
        {"name": "home", "type": {**contact, "fields": contact["fields"] + [{"name": "phone", "type": "string"}]}},
        {"name": "work", "type": ["null", "Contact"]}, {"name": "score", "type": ["null", "long", "string"]},
        {"name": "stage", "type": {"type": "enum", "name": "Stage", "symbols": ["NEW", "LOST"]}},
        {"name": "legacy", "type": {"type": "array", "items": "Contact"}},
        {"name": "since", "type": {"type": "long", "logicalType": "timestamp-micros"}}]}
    topic = f"leads-{uuid.uuid4().hex[:8]}"
    written = produce(serializer(registry, writer), topic, [{
        "id": 1, "home": {"email": "a@x", "phone": "1"}, "work": {"email": "b@x", "phone": "2"}, "score": "high",
        "stage": "LOST", "legacy": [{"email": "c@x", "phone": "3"}], "since": 1}])
    read = produce(serializer(registry, reader), topic, [{
        "id": 2, "home": {"email": "d@x"}, "work": None, "score": 7, "stage": "WON", "since": 2}])
    registry_client = Registry(registry.settings())
    older_id = int.from_bytes(written[0][1:5], "big")
    latest = AvroSchema.registered(registry_client, registry_client.latest(f"{topic}-value").schema)
    older = AvroSchema.registered(registry_client, registry_client.schema(older_id))

    merged = merge_schemas(latest, older)

    # One standalone schema: each named type defined once, where it first occurs, then named.
    assert merged.count('"name": "crm.Contact"') == 1
    assert compare_schemas(older, AvroSchema(merged)) == ([], []) == compare_schemas(latest, AvroSchema(merged))
    decoder = AvroDecoder(registry_client, RegistrySchema(merged))
    decoded = decoder.decode(pa.array(written + read, pa.binary()))
    assert decoded.errors == {}
    assert decoded.table.to_pylist() == [
        {"id": 1, "home": {"email": "a@x", "phone": "1"}, "work": {"email": "b@x", "phone": "2"},
         "score": {"member0": None, "member1": "high"}, "stage": "LOST",
         "since": datetime.datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC), "legacy": [{"email": "c@x", "phone": "3"}]},
        {"id": 2, "home": {"email": "d@x", "phone": None}, "work": None, "score": {"member0": 7, "member1": None},
         "stage": "WON", "since": datetime.datetime(1970, 1, 1, 0, 0, 0, 2, tzinfo=UTC), "legacy": None}]
    # Whether a table can take the merge is the table's call: here `score` turns from BIGINT into a struct.
    assert decoder.schema.field("score").type == pa.struct([("member0", pa.int64()), ("member1", pa.string())])

    # A writer the run refused (its table could not take it): its records are errors with the reason.
    refusing = AvroDecoder(registry_client, registry_client.latest(f"{topic}-value").schema, {older_id: "no room"})
    decoded = pickle.loads(pickle.dumps(refusing)).decode(pa.array(written + read, pa.binary()))
    assert decoded.errors == {0: "no room"} and decoded.table.column("id").to_pylist() == [None, 2]


def test_a_batch_ahead_in_its_key_and_later_in_its_value_stops_at_the_earlier_of_the_two(registry, tmp_path):
    def framed(schema: dict, subject: str, field: str, records: list[dict]) -> list[bytes]:
        ser = AvroSerializer(SchemaRegistryClient(registry.settings()), json.dumps(schema),
                             conf={"subject.name.strategy": lambda ctx, name: subject})
        return [ser(r, SerializationContext("t", field)) for r in records]

    topic = f"keyed-{uuid.uuid4().hex[:8]}"
    grown = {**V1, "fields": V1["fields"] + [{"name": "email", "type": ["null", "string"], "default": None}]}
    key = {"type": "record", "name": "Key", "fields": [{"name": "k", "type": "long"}]}
    key_grown = {**key, "fields": key["fields"] + [{"name": "region", "type": ["null", "string"], "default": None}]}
    keys = (framed(key, f"{topic}-key", MessageField.KEY, [{"k": i} for i in range(4)])
            + framed(key_grown, f"{topic}-key-next", MessageField.KEY, [{"k": 4, "region": "eu"}]))
    values = framed(V1, f"{topic}-value", MessageField.VALUE, [{"id": i, "profile": {"name": "p"}} for i in range(5)])
    values[2] = framed(grown, f"{topic}-value-next", MessageField.VALUE, [{"id": 2, "profile": {"name": "p"}}])[0]
    settings = registry.settings()
    registry_client = Registry(settings)
    latest = lambda role: registry_client.latest(f"{topic}-{role}").schema.to_dict()
    spec = RecordSpec(FormatSpec("avro", registered=latest("value")), FormatSpec("avro", registered=latest("key")), False)
    count = len(values)
    batch = pa.RecordBatch.from_pydict({
        "key": keys, "value": values, "topic": [topic] * count, "partition": pa.array([0] * count, pa.int32()),
        "offset": list(range(10, 10 + count)), "timestamp": pa.array([0] * count, pa.timestamp("us", tz="UTC")),
        "timestampType": pa.array([0] * count, pa.int32()), "headers": pa.nulls(count, READ_SCHEMA.field("headers").type),
        "timestamp_ms": [0] * count}, schema=READ_SCHEMA)

    # The key's first record ahead is at 4, the value's at 2: the batch stops at 2.
    with pytest.raises(SchemaAhead) as ahead:
        RecordDecoder(spec, settings, settings).decode(batch)
    assert (ahead.value.index, ahead.value.role, ahead.value.schema_id) == (2, "value", int.from_bytes(values[2][1:5], "big"))

    class Range:  # a range that yields the batch and stops where told, like records.RangeRecords
        def __init__(self):
            self.topic, self.partition, self.start, self.end, self.reached, self.bytes_read = topic, 0, 10, 15, None, 0

        def __iter__(self):
            yield batch

        def stop_at(self, offset):
            self.reached = offset

    task = TaskSpec.single(spec, pa.schema([]), str(tmp_path / "main"), str(tmp_path / "quarantine"), (),
                           {f"{topic}/0": 0}, {}, settings, settings)
    decoding = _RangeDecoding(Range(), task, task.decoders(), False, task.quarantine_writer())
    rows = list(decoding.rows())
    assert [r["id"] for _, t in rows for r in t.to_pylist()] == [0, 1]
    assert AheadRecord.parse(decoding.schema_ahead) == AheadRecord("value", ahead.value.schema_id, topic, 0, 12)


def test_a_map_of_local_timestamps_makes_a_table_and_a_column(tmp_path):
    # TIMESTAMP_NTZ inside a MAP: delta-rs does not enable the timestampNtz table feature by itself.
    schema = avro_to_arrow({"type": "record", "name": "Visit", "fields": [
        {"name": "id", "type": "long"},
        {"name": "seen", "type": {"type": "map", "values": {"type": "long", "logicalType": "local-timestamp-micros"}}}]})
    rows = pa.Table.from_pylist([{"id": 1, "seen": [("home", datetime.datetime(2026, 1, 2, 3, 4, 5))]}], schema)
    created = str(tmp_path / "created")
    assert ensure_table(created, schema, (), "visits", "test") == schema
    evolved = str(tmp_path / "evolved")
    ensure_table(evolved, schema.remove(1), (), "visits", "test")
    assert ensure_table(evolved, schema, (), "visits", "test") == schema
    for path in (created, evolved):
        write_deltalake(path, rows, mode="append")
        assert "timestampNtz" in DeltaTable(path).protocol().reader_features
        assert DeltaTable(path).to_pyarrow_table().to_pylist() == rows.to_pylist()


class _Registry:
    """Writer schemas by ID, as AvroDecoder asks a registry (schemas without references)."""

    url = "in-memory"

    def __init__(self, schemas: dict):
        self.schemas = {i: RegistrySchema(json.dumps(s)) for i, s in schemas.items()}

    def schema(self, schema_id: int, fmt=None) -> RegistrySchema:
        return self.schemas[schema_id]


def framed_records(schema: dict, records: list, schema_id: int = 1) -> pa.Array:
    bodies = []
    for value in records:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, fastavro.parse_schema(schema), value)
        bodies.append(b"\x00" + schema_id.to_bytes(4, "big") + out.getvalue())
    return pa.array(bodies, pa.binary())


def test_decimals_of_38_digits_are_read_whole():
    # Python's decimal context holds 28 digits: abs() of a 38-digit value rounded it up past the precision.
    schema = {"type": "record", "name": "D", "fields": [
        {"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 10}}]}
    values = [Decimal("9" * 28 + "." + "9" * 10), Decimal("-" + "9" * 28 + "." + "9" * 10), Decimal("1E-10")]
    decoded = AvroDecoder(_Registry({1: schema}), _Registry({1: schema}).schema(1)).decode(
        framed_records(schema, [{"d": v} for v in values]))
    assert decoded.errors == {}
    assert decoded.table.column("d").to_pylist() == values
    too_big = framed_records({**schema, "fields": [{"name": "d", "type": {**schema["fields"][0]["type"], "precision": 39}}]},
                             [{"d": Decimal("1" + "0" * 28)}])
    errors = AvroDecoder(_Registry({1: schema}), _Registry({1: schema}).schema(1)).decode(too_big).errors
    assert list(errors) == [0] and errors[0].endswith("does not fit DECIMAL(38,10)")  # 29 integer digits


def test_defaults_of_bytes_fixed_and_decimals_are_read_as_avro_writes_them_in_json():
    # A reader's default for bytes, fixed and decimals is JSON text of code points 0-255; fastavro
    # hands it over as that text (a decimal's failed its check, bytes became their UTF-8).
    writer = {"type": "record", "name": "R", "fields": [{"name": "id", "type": "int"}]}
    money = {"type": "bytes", "logicalType": "decimal", "precision": 5, "scale": 2}
    four = {"type": "fixed", "name": "Four", "size": 4}
    reader = {"type": "record", "name": "R", "fields": [
        {"name": "id", "type": "int"},
        {"name": "raw", "type": "bytes", "default": "\u00ff\u0000A"},
        {"name": "four", "type": four, "default": "\u0001\u00e9\u0000\u00ff"},
        {"name": "money", "type": money, "default": "\u00fb\u002e"},  # -1234 at scale 2
        {"name": "cents", "type": {"type": "fixed", "name": "Cents", "size": 2, "logicalType": "decimal",
                                   "precision": 4, "scale": 2}, "default": "\u0004\u00d2"},
        {"name": "maybe", "type": ["bytes", "null"], "default": "\u0080"},
        {"name": "inner", "type": {"type": "record", "name": "Inner", "fields": [
            {"name": "blobs", "type": {"type": "array", "items": "bytes"}}, {"name": "f", "type": "Four"}]},
         "default": {"blobs": ["\u00e9"], "f": "abcd"}}]}
    registry = _Registry({1: writer, 2: reader})
    decoded = AvroDecoder(registry, registry.schema(2)).decode(framed_records(writer, [{"id": 7}]))
    assert decoded.errors == {}
    assert decoded.table.to_pylist() == [{
        "id": 7, "raw": b"\xff\x00A", "four": b"\x01\xe9\x00\xff", "money": Decimal("-12.34"),
        "cents": Decimal("12.34"), "maybe": b"\x80", "inner": {"blobs": [b"\xe9"], "f": b"abcd"}}]


def test_a_decimal_default_of_38_digits_is_read_whole():
    # Decimal's scaleb rounds to its context's 28 digits: the default landed as ...679.00.
    unscaled = 123456789012345678901234567891
    text = unscaled.to_bytes(13, "big", signed=True).decode("latin-1")
    writer = {"type": "record", "name": "R", "fields": [{"name": "id", "type": "int"}]}
    reader = {"type": "record", "name": "R", "fields": [
        {"name": "id", "type": "int"},
        {"name": "big", "type": {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 2}, "default": text}]}
    registry = _Registry({1: writer, 2: reader})
    decoded = AvroDecoder(registry, registry.schema(2)).decode(framed_records(writer, [{"id": 7}]))
    assert decoded.errors == {}
    assert decoded.table.to_pylist() == [{"id": 7, "big": Decimal("1234567890123456789012345678.91")}]


def test_an_enum_index_that_is_negative_is_an_error_not_the_last_symbol():
    # Only garbage bytes hold one; fastavro indexed the symbols' list with it, from the end.
    suit = {"type": "enum", "name": "Suit", "symbols": ["HEARTS", "SPADES"]}
    schema = {"type": "record", "name": "E", "fields": [{"name": "e", "type": suit}, {"name": "again", "type": "Suit"}]}
    registry = _Registry({1: schema})
    # zigzag: 0 is index 0, 2 is 1, 1 is -1, 4 is 2.
    decoded = AvroDecoder(registry, registry.schema(1)).decode(pa.array(
        [b"\x00\x00\x00\x00\x01" + body for body in (b"\x00\x02", b"\x01\x00", b"\x00\x01", b"\x04\x00")], pa.binary()))
    assert decoded.table.column("e").to_pylist()[0] == "HEARTS" and decoded.table.column("again").to_pylist()[0] == "SPADES"
    assert sorted(decoded.errors) == [1, 2, 3]
    assert "enum index -1 is negative" in decoded.errors[1] and "enum index -1 is negative" in decoded.errors[2]
    reader = {"type": "record", "name": "E", "fields": [
        {"name": "e", "type": {**suit, "symbols": ["HEARTS", "SPADES", "CLUBS"]}}, {"name": "again", "type": "Suit"}]}
    registry = _Registry({1: schema, 2: reader})
    decoded = AvroDecoder(registry, registry.schema(2)).decode(pa.array(
        [b"\x00\x00\x00\x00\x01" + body for body in (b"\x02\x00", b"\x01\x00")], pa.binary()))
    assert decoded.table.column("e").to_pylist()[0] == "SPADES" and list(decoded.errors) == [1]
