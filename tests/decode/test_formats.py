"""Real-world records end to end, on Apache Kafka with the schema registry over HTTP: nested
JSON, Avro and Protobuf in Confluent's wire format (produced by confluent-kafka's own serializers),
keys and headers, and a table following its registered schema. Values are read back with DuckDB and
compared; every (topic, partition, offset) is counted over table + quarantine."""

from __future__ import annotations

import datetime
import json
from decimal import Decimal

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from deltalake import DeltaTable
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2
from google.protobuf.descriptor_pb2 import FieldDescriptorProto as Field

from conftest import assert_exactly_once, produced_coordinates, query, read_coordinates
from oncemore.decode.resolve import ReaderBehind
from oncemore.run import prepare, runner

pytestmark = pytest.mark.spark
UTC = datetime.timezone.utc

ORDER_V1 = {
    "type": "record", "name": "Order", "namespace": "shop", "fields": [
        {"name": "id", "type": "long"},
        {"name": "customer", "type": {"type": "record", "name": "Customer", "fields": [
            {"name": "name", "type": "string"},
            {"name": "address", "type": {"type": "record", "name": "Address", "fields": [
                {"name": "zip", "type": "string"}, {"name": "city", "type": ["null", "string"], "default": None}]}}]}},
        {"name": "lines", "type": {"type": "array", "items": {"type": "record", "name": "Line", "fields": [
            {"name": "sku", "type": "string"},
            {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}}]}}},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
        {"name": "placed", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    ]}
# v2 adds a nullable field (with a default, as Avro's resolution needs) at the top and one nested.
ORDER_V2 = json.loads(json.dumps(ORDER_V1))
ORDER_V2["fields"].append({"name": "channel", "type": ["null", "string"], "default": None})
ORDER_V2["fields"][1]["type"]["fields"][1]["type"]["fields"].append({"name": "country", "type": ["null", "string"], "default": None})


def order(i: int, v2: bool = False) -> dict:
    value = {"id": i, "customer": {"name": f"c{i}", "address": {"zip": f"{10000 + i}", "city": None if i % 2 else "Oslo"}},
             "lines": [{"sku": f"s{i}", "price": Decimal(f"{i}.25")}, {"sku": "x", "price": Decimal("0.01")}],
             "attrs": {"n": i}, "placed": datetime.datetime(2026, 11, 20, 10, 0, i % 60, tzinfo=UTC),
             "day": datetime.date(2026, 11, 1 + i % 20)}
    if v2:
        value["channel"] = "web"
        value["customer"]["address"]["country"] = "NO"
    return value


def avro_values(registry_client, topic: str, schema: dict, values: list, subject: str | None = None,
                field: str = MessageField.VALUE) -> list[bytes]:
    serializer = AvroSerializer(registry_client, json.dumps(schema), conf={
        "auto.register.schemas": True, **({"subject.name.strategy": lambda ctx, name: subject} if subject else {})})
    context = SerializationContext(topic, field)
    return [serializer(v, context) for v in values]


def accounted(pipeline) -> list[tuple[str, int, int]]:
    return read_coordinates(pipeline.sink.table_uri) + read_coordinates(pipeline.sink.quarantine_uri)


# The subject's latest version dropped `note` (required in the version before) and added `channel`.
NOTE_V1 = {"type": "record", "name": "Ticket", "namespace": "desk", "fields": [
    {"name": "id", "type": "long"}, {"name": "note", "type": "string"}]}
NOTE_V2 = {"type": "record", "name": "Ticket", "namespace": "desk", "fields": [
    {"name": "id", "type": "long"}, {"name": "channel", "type": ["null", "string"], "default": None}]}


def test_an_old_producer_after_the_latest_version_dropped_a_field_lands_and_interleaved_versions_commit_once(
        broker, topic, make_pipeline, spark, registry):
    client = SchemaRegistryClient(registry.settings())
    old = lambda ids: avro_values(client, topic, NOTE_V1, [{"id": i, "note": f"n{i}"} for i in ids])
    new = lambda ids: avro_values(client, topic, NOTE_V2, [{"id": i, "channel": "web"} for i in ids])
    old([])  # registers NOTE_V1 first: NOTE_V2 is the subject's latest
    produced = produced_coordinates(topic, broker.produce(topic, [(0, None, v, None) for v in new(range(3))]))
    pipeline = make_pipeline(topic, format={"type": "avro", "schema_registry": registry.settings()})
    runner.run(pipeline, spark_factory=lambda: spark)

    # An old producer's record right at the position, then both versions taking turns: the run
    # reads into the merge of the two, so the batch commits once, whatever the turns.
    turns = [(old if i % 2 == 0 else new)([i])[0] for i in range(3, 23)]
    produced += produced_coordinates(topic, broker.produce(topic, [(0, None, v, None) for v in turns]))
    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.written, report.quarantined, len(report.batches[0].versions)) == (20, 0, 1)
    assert_exactly_once(accounted(pipeline), produced)
    assert query(pipeline.sink.table_uri, "SELECT id, note, channel FROM {table} WHERE id IN (1, 4, 5) ORDER BY id") == [
        (1, None, "web"), (4, "n4", None), (5, None, "web")]
    # Every later run starts from the latest version again and meets the old producer again.
    produced += produced_coordinates(topic, broker.produce(topic, [(0, None, v, None) for v in old([23]) + new([24])]))
    assert runner.run(pipeline, spark_factory=lambda: spark).written == 2
    assert_exactly_once(accounted(pipeline), produced)


def test_a_record_ahead_in_its_key_behind_one_ahead_in_its_value_is_read_after_both(
        broker, topic, make_pipeline, spark, registry):
    client = SchemaRegistryClient(registry.settings())
    key_v1 = {"type": "record", "name": "Key", "fields": [{"name": "k", "type": "long"}]}
    key_v2 = {**key_v1, "fields": key_v1["fields"] + [{"name": "region", "type": ["null", "string"], "default": None}]}
    keys = (avro_values(client, topic, key_v1, [{"k": i} for i in range(4)], field=MessageField.KEY)
            + avro_values(client, topic, key_v2, [{"k": 4, "region": "eu"}], subject=f"{topic}-key-next",
                          field=MessageField.KEY))
    values = avro_values(client, topic, NOTE_V1, [{"id": i, "note": f"n{i}"} for i in range(5)])
    values[2] = avro_values(client, topic, NOTE_V2, [{"id": 2, "channel": "web"}], subject=f"{topic}-value-next")[0]
    produced = produced_coordinates(topic, broker.produce(topic, [(0, k, v, None) for k, v in zip(keys, values)]))
    pipeline = make_pipeline(topic, format={"type": "avro", "schema_registry": registry.settings()},
                             key={"type": "avro", "schema_registry": registry.settings()})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.written, report.quarantined) == (5, 0)
    assert_exactly_once(accounted(pipeline), produced)
    assert query(pipeline.sink.table_uri, "SELECT key.k, key.region, note, channel FROM {table} "
                                          "WHERE id IN (2, 4) ORDER BY id") == [(2, None, None, "web"), (4, "eu", "n4", None)]


def test_a_writer_the_table_cannot_take_is_quarantined_with_the_reason_and_the_batch_goes_on(
        broker, topic, make_pipeline, spark, registry):
    client = SchemaRegistryClient(registry.settings())
    base = {"type": "record", "name": "Reading", "fields": [
        {"name": "id", "type": "long"}, {"name": "x", "type": ["null", "long"], "default": None}]}
    branched = {**base, "fields": [base["fields"][0], {"name": "x", "type": ["null", "long", "string"], "default": None}]}
    grown = {**base, "fields": base["fields"] + [{"name": "unit", "type": ["null", "string"], "default": None}]}
    values = avro_values(client, topic, base, [{"id": 0, "x": 1}])
    values += avro_values(client, topic, branched, [{"id": 1, "x": "one"}], subject=f"{topic}-branched")
    values += avro_values(client, topic, grown, [{"id": 2, "x": 2, "unit": "kg"}], subject=f"{topic}-grown")
    values += avro_values(client, topic, base, [{"id": 3, "x": 3}])
    produced = produced_coordinates(topic, broker.produce(topic, [(0, None, v, None) for v in values]))
    branched_id = int.from_bytes(values[1][1:5], "big")
    fmt = {"type": "avro", "schema_registry": registry.settings()}
    pipeline = make_pipeline(topic, format=fmt)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    # A union gaining a branch would turn column x (BIGINT) into a struct of members: never stored,
    # its record quarantined with the reason; the records around it land, the new field too.
    assert (report.written, report.quarantined) == (3, 1)
    assert_exactly_once(accounted(pipeline), produced)
    ((offset, error),) = query(pipeline.sink.quarantine_uri, "SELECT _kafka_offset, error FROM {table}")
    assert offset == produced[1][2] and error == (
        f"writer schema {branched_id} cannot be stored in the table: column x: the table has bigint, the records have "
        "struct<member0:bigint,member1:string>; a type change needs a new table or a deliberate migration")
    assert query(pipeline.sink.table_uri, "SELECT id, unit FROM {table} ORDER BY id") == [(0, None), (2, "kg"), (3, None)]
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "no-op"

    # With schema_evolution: fail the table may not change at all: a record whose writer would
    # change it is quarantined with that reason.
    strict = make_pipeline(topic, name="strict", format=fmt, sink={"schema_evolution": "fail"})
    report = runner.run(strict, spark_factory=lambda: spark)
    assert (report.written, report.quarantined) == (2, 2)
    errors = [e for (e,) in query(strict.sink.quarantine_uri, "SELECT error FROM {table} ORDER BY _kafka_offset")]
    assert "the records' schema adds unit to the table and sink.schema_evolution is fail" in errors[1]
    assert [f.name for f in DeltaTable(strict.sink.table_uri).schema().fields if not f.name.startswith("_")] == ["id", "x"]


def test_a_record_still_ahead_of_the_reader_changed_for_it_fails_the_run_naming_it(
        broker, topic, make_pipeline, spark, registry, monkeypatch):
    client = SchemaRegistryClient(registry.settings())
    values = avro_values(client, topic, NOTE_V1, [{"id": 0, "note": "a"}])
    values += avro_values(client, topic, NOTE_V2, [{"id": 1, "channel": "web"}], subject=f"{topic}-value-next")
    broker.produce(topic, [(1, None, v, None) for v in values])
    pipeline = make_pipeline(topic, format={"type": "avro", "schema_registry": registry.settings()})
    monkeypatch.setattr(prepare, "follow", lambda pipeline, spec, role, schema_id, table: spec)  # a reader that never covers it

    with pytest.raises(ReaderBehind) as stuck:
        runner.run(pipeline, spark_factory=lambda: spark)

    schema_id = int.from_bytes(values[1][1:5], "big")
    assert str(stuck.value) == (
        f"pipeline orders: topic {topic} partition 1 offset 1: the record's value writer schema {schema_id} is still "
        "ahead of the reader the run changed for it; nothing from that offset on was read")
    assert read_coordinates(pipeline.sink.table_uri) == [(topic, 1, 0)]


def test_avro_through_the_registry_nested_values_bad_framing_and_a_newer_schema(broker, topic, make_pipeline, spark, registry):
    client = SchemaRegistryClient(registry.settings())
    v1 = avro_values(client, topic, ORDER_V1, [order(i) for i in range(30)])
    bad = [b"\x01\x00\x00\x00\x01rest", b"\x00\x00\x00\x7f\xffxx", v1[0][:8], b"\x00"]
    records = [(i % 3, None, v, None) for i, v in enumerate(v1)] + [(0, None, v, None) for v in bad]
    produced = produced_coordinates(topic, broker.produce(topic, records))
    pipeline = make_pipeline(topic, format={"type": "avro", "schema_registry": registry.settings()})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 30 and report.quarantined == 4
    assert_exactly_once(read_coordinates(pipeline.sink.table_uri) + read_coordinates(pipeline.sink.quarantine_uri), produced)
    rows = query(pipeline.sink.table_uri, "SELECT id, customer.name, customer.address.zip, customer.address.city, "
                                          "lines[1].price, attrs['n'], placed, day FROM {table} WHERE id = 4")
    assert rows == [(4, "c4", "10004", "Oslo", Decimal("4.25"), 4,
                     datetime.datetime(2026, 11, 20, 10, 0, 4, tzinfo=UTC), datetime.date(2026, 11, 5))]
    errors = [e for (e,) in query(pipeline.sink.quarantine_uri, "SELECT error FROM {table} ORDER BY _kafka_offset")]
    assert len(errors) == 4 and "magic byte" in errors[0] and "schema ID" in errors[1] and errors[3]

    # A producer moves to v2 (registered under another subject, so the table's subject still says
    # v1): the run stops the range at the first v2 record, the table gains the new fields, and the
    # batch goes on; old rows read NULL for them.
    v2 = avro_values(client, topic, ORDER_V2, [order(i, v2=True) for i in range(100, 110)], subject=f"{topic}-next")
    more = produced_coordinates(topic, broker.produce(topic, [(i % 3, None, v, None) for i, v in enumerate(v1[:6] + v2)]))
    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 16
    assert_exactly_once(read_coordinates(pipeline.sink.table_uri) + read_coordinates(pipeline.sink.quarantine_uri),
                        produced + more)
    assert query(pipeline.sink.table_uri, "SELECT count(*), count(channel), count(customer.address.country) FROM {table}") == [
        (46, 10, 10)]
    columns = [f.name for f in DeltaTable(pipeline.sink.table_uri).schema().fields]
    assert columns[:6] == ["id", "customer", "lines", "attrs", "placed", "day"] and "channel" in columns


def order_message(without: str | None = None):
    """shop.Order with a nested message, a repeated field, a map, an enum and a Timestamp, built at
    run time; ``without``: one of its fields left out."""
    proto = descriptor_pb2.FileDescriptorProto(name="shop_order.proto", package="shop", syntax="proto3",
                                               dependency=["google/protobuf/timestamp.proto"])
    status = proto.enum_type.add(name="Status")
    for number, name in enumerate(["NEW", "PAID"]):
        status.value.add(name=name, number=number)
    message = proto.message_type.add(name="Order")
    item = message.nested_type.add(name="Item")
    item.field.add(name="sku", number=1, type=Field.TYPE_STRING, label=Field.LABEL_OPTIONAL)
    item.field.add(name="qty", number=2, type=Field.TYPE_INT32, label=Field.LABEL_OPTIONAL)
    entry = message.nested_type.add(name="CountsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=Field.TYPE_STRING, label=Field.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=Field.TYPE_INT64, label=Field.LABEL_OPTIONAL)
    for field in [
        Field(name="id", number=1, type=Field.TYPE_INT64, label=Field.LABEL_OPTIONAL),
        Field(name="status", number=2, type=Field.TYPE_ENUM, type_name=".shop.Status", label=Field.LABEL_OPTIONAL),
        Field(name="items", number=3, type=Field.TYPE_MESSAGE, type_name=".shop.Order.Item", label=Field.LABEL_REPEATED),
        Field(name="counts", number=4, type=Field.TYPE_MESSAGE, type_name=".shop.Order.CountsEntry",
              label=Field.LABEL_REPEATED),
        Field(name="placed", number=5, type=Field.TYPE_MESSAGE, type_name=".google.protobuf.Timestamp",
              label=Field.LABEL_OPTIONAL),
    ]:
        if field.name != without:
            message.field.append(field)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Order"))


def test_protobuf_through_the_registry_with_message_indexes(broker, topic, make_pipeline, spark, registry):
    Order = order_message()
    serializer = ProtobufSerializer(Order, SchemaRegistryClient(registry.settings()), {"use.deprecated.format": False})
    context = SerializationContext(topic, MessageField.VALUE)
    values = []
    for i in range(40):
        message = Order(id=i, status=i % 2, items=[Order.Item(sku=f"s{i}", qty=i)], counts={"n": i})
        message.placed.FromDatetime(datetime.datetime(2026, 11, 20, 12, 0, i % 60))
        values.append(serializer(message, context))
    produced = produced_coordinates(topic, broker.produce(topic, [(i % 3, None, v, None) for i, v in enumerate(values)]
                                                          + [(1, None, b"\x00\x00\x00\x00\x09\x00garbage", None)]))
    pipeline = make_pipeline(topic, format={"type": "protobuf", "schema_registry": registry.settings()})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 40 and report.quarantined == 1
    assert_exactly_once(read_coordinates(pipeline.sink.table_uri) + read_coordinates(pipeline.sink.quarantine_uri), produced)
    assert query(pipeline.sink.table_uri, "SELECT id, status, items[1].sku, items[1].qty, counts['n'], placed FROM {table} "
                                          "WHERE id = 7") == [
        (7, "PAID", "s7", 7, 7, datetime.datetime(2026, 11, 20, 12, 0, 7, tzinfo=UTC))]


def test_protobuf_an_old_producer_after_the_latest_version_dropped_a_field_lands(
        broker, topic, make_pipeline, spark, registry):
    client = SchemaRegistryClient(registry.settings())
    context = SerializationContext(topic, MessageField.VALUE)
    Old, Latest = order_message(), order_message(without="status")
    old = ProtobufSerializer(Old, client, {"use.deprecated.format": False})
    latest = ProtobufSerializer(Latest, client, {"use.deprecated.format": False})
    first = old(Old(id=0, status=1), context)  # registers the old version first
    values = [first] + [latest(Latest(id=i), context) if i % 4 else old(Old(id=i, status=1), context) for i in range(1, 9)]
    produced = produced_coordinates(topic, broker.produce(topic, [(2, None, v, None) for v in values]))
    pipeline = make_pipeline(topic, format={"type": "protobuf", "schema_registry": registry.settings()})

    # The run starts from the latest version, which lacks status: the old record at the position
    # stops the range, the table gains status, and the run reads on. Descriptors are not merged,
    # so the reader is the old version from then on (the latest one's records resolve into it).
    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.written, report.quarantined) == (9, 0)
    assert_exactly_once(accounted(pipeline), produced)
    assert query(pipeline.sink.table_uri, "SELECT id, status FROM {table} WHERE id IN (3, 4) ORDER BY id") == [
        (3, None), (4, "PAID")]


def test_json_schema_framed_values_keys_as_structs_and_headers_in_order(broker, topic, make_pipeline, spark, registry):
    client = SchemaRegistryClient(registry.settings())
    schema = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array"}}})
    serialize = JSONSerializer(schema, client)
    context = SerializationContext(topic, MessageField.VALUE)
    headers = [("trace", b"t1"), ("hop", b"a"), ("hop", b"b")]
    records = [(i % 3, json.dumps({"region": "eu", "shard": i}).encode(), serialize({"id": i, "tags": ["x", f"t{i}"]}, context),
                None) for i in range(12)]
    records.append((0, b'{"region": "eu", "shard": "seven"}', serialize({"id": 99, "tags": []}, context), None))
    produced = produced_coordinates(topic, broker.produce(topic, records, headers=headers))
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT, tags ARRAY<STRING>", "confluent_framing": True},
                             key={"type": "json", "schema": "region STRING, shard INT"}, headers=True)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 12 and report.quarantined == 1
    assert_exactly_once(read_coordinates(pipeline.sink.table_uri) + read_coordinates(pipeline.sink.quarantine_uri), produced)
    assert query(pipeline.sink.table_uri, "SELECT key.region, key.shard, id, tags[2], "
                                          "[h.key || '=' || decode(h.value, 'utf-8') FOR h IN headers] FROM {table} WHERE id = 5") == [
        ("eu", 5, 5, "t5", ["trace=t1", "hop=a", "hop=b"])]
    (error,) = [e for (e,) in query(pipeline.sink.quarantine_uri, "SELECT error FROM {table}")]
    assert error.startswith("key: ") and "shard" in error


def test_registry_settings_go_only_to_formats_that_read_schemas_from_a_registry(topic, make_pipeline, registry):
    from oncemore.decode.resolve import registries

    secured = {**registry.settings(), "basic.auth.user.info": "svc:secret"}
    avro_value = {"type": "avro", "schema_registry": secured}
    assert registries(make_pipeline(topic, format=avro_value)) == (secured, None)
    assert registries(make_pipeline(topic, format=avro_value, key={"type": "string"})) == (secured, None)
    assert registries(make_pipeline(topic, format=avro_value, key=avro_value)) == (secured, secured)
