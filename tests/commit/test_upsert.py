"""Upserts counted against a fold of the produced events, key by key (devtools/changefeed.py is the
reference, written apart from oncemore's MERGE): offset order, sequence order with late events and
re-creates after deletes, the two-partition refusal, the counts in each commit's record."""

from __future__ import annotations

import json
import time
import uuid

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from conftest import held_positions, oncemore, oncemore_commits, query
from devtools.changefeed import debezium_events, fold, produce, project, read_back, source_state, table_state
from oncemore.commit.merge import COUNTS, KeyInTwoPartitions
from oncemore.commit.sequencing import SequenceChanged
from oncemore.run.runner import run

ROW = "id BIGINT, name STRING, balance BIGINT"
COLUMNS = ("id", "name", "balance")


# upsert.merge: the tests of exactly-once run on both paths; "cluster" runs its rewrite as a Spark
# job on the tests' local session (what differs is that the rewrite is a Spark job, not how many
# workers run it; scripts/benchmark upsert --cluster runs it on two workers).
MERGES = ("local", "cluster")


def debezium(make_pipeline, topic, sequence_by=None, merge="local", **overrides):
    upsert = {"keys": ["id"], "envelope": "debezium", "merge": merge,
              **({"sequence_by": sequence_by} if sequence_by else {})}
    return make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                         format={"type": "json", "schema": ROW}, upsert=upsert, **overrides)


def assert_folded(pipeline, broker, topic, sequence=None, skip: bytes | None = None, skip_invalid: bool = False):
    """The table equals the fold of everything in the topic (but values ``skip``, and with
    ``skip_invalid`` those whose ``sequence`` is None: quarantined), key by key, coordinates included."""
    records = [r for r in read_back(broker.bootstrap_servers, topic) if skip is None or r[4] != skip]
    if skip_invalid:
        records = [r for r in records if r[4] is None or sequence(json.loads(r[4])) is not None]
    expected = fold(records, "debezium", ("id",), sequence=sequence)
    found = table_state(pipeline.sink.table_uri, ("id",))
    assert set(found) == set(expected)
    for key, row in expected.items():
        assert {c: found[key][c] for c in row} == row, key
    return found


def accounted(pipeline, gapless: bool = True) -> int:
    """Every commit's record accounts for every record of its ranges (``gapless``: each offset of
    them holds one; a compacted topic's do not); returns the records the commits account for."""
    total = 0
    for _, record in oncemore_commits(pipeline.sink.table_uri):
        if not record.ranges:  # a resequence's
            continue
        counts = record.records
        read = sum(e - s for partitions in record.ranges.values() for s, e in partitions.values())
        assert counts["written"] == sum(counts[c] for c in COUNTS), counts
        assert not gapless or counts["written"] + counts["quarantined"] + counts["filtered"] == read, (counts, read)
        total += counts["written"] + counts["quarantined"] + counts["filtered"]
    return total


@pytest.mark.parametrize("merge", MERGES)
def test_debezium_in_offset_order_lands_the_source_tables_state(merge, spark, broker, topic, make_pipeline):
    events = debezium_events(keys=40, changes=300, seed=1)
    produce(broker.bootstrap_servers, topic, events[:200], "key")
    pipeline = debezium(make_pipeline, topic, merge=merge)
    run(pipeline, spark_factory=lambda: spark)
    produce(broker.bootstrap_servers, topic, events[200:], "key")
    report = run(pipeline, spark_factory=lambda: spark)
    found = assert_folded(pipeline, broker, topic)
    assert project(found, COLUMNS) == source_state(events)
    accounted(pipeline)
    assert report.batches[0].status == "committed"
    # A MERGE's rows written (no bytes: delta-rs's MERGE writes its files): those its events inserted or updated.
    (merged,) = [c for c in DeltaTable(pipeline.sink.table_uri).history(1)]
    (_, record), = oncemore_commits(pipeline.sink.table_uri)[-1:]
    assert report.added["main"] == {"rows": record.records["inserted"] + record.records["updated"]} != {"rows": 0}
    if merge == "local":
        metrics = merged["operationMetrics"]
        assert report.added["main"] == {"rows": metrics["num_target_rows_inserted"] + metrics["num_target_rows_updated"]}
    else:  # one commit of the touched files' removes, the new files' adds and the positions
        assert merged["operation"] == "WRITE" and held_positions(pipeline.sink.table_uri, "accounts", topic) == {
            p: sum(1 for e in read_back(broker.bootstrap_servers, topic) if e[1] == p) for p in (0, 1, 2)}
    again = run(pipeline, spark_factory=lambda: spark)
    assert all(b.status != "committed" for b in again.batches)


@pytest.mark.parametrize("merge", MERGES)
def test_late_events_and_recreates_after_deletes_follow_the_sequence(merge, spark, broker, topic, make_pipeline):
    events = debezium_events(keys=30, changes=400, seed=7)
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn", merge=merge)
    half = len(events) // 2
    produce(broker.bootstrap_servers, topic, events[:half], "shuffled", seed=3)
    run(pipeline, spark_factory=lambda: spark)
    produce(broker.bootstrap_servers, topic, events[half:], "shuffled", seed=4)
    run(pipeline, spark_factory=lambda: spark)
    found = assert_folded(pipeline, broker, topic, sequence=lambda value: value["source"]["lsn"])
    assert project(found, COLUMNS) == source_state(events)
    accounted(pipeline)


def test_a_key_in_two_partitions_without_a_sequence_commits_nothing(spark, broker, topic, make_pipeline):
    events = debezium_events(keys=5, changes=40, seed=2)
    broker.produce(topic, [(0, key(1), b"{broken", None)])  # would be quarantined: not even that is committed
    produce(broker.bootstrap_servers, topic, events, "shuffled", seed=1)
    pipeline = debezium(make_pipeline, topic)
    pattern = rf"pipeline accounts: key \{{'id': \d+\}} has events in partitions {topic}/\d, {topic}/\d.* \(at {topic}/\d offset \d+, "
    with pytest.raises(KeyInTwoPartitions, match=pattern):
        run(pipeline, spark_factory=lambda: spark)
    assert oncemore_commits(pipeline.sink.table_uri) == oncemore_commits(pipeline.sink.quarantine_uri) == []


def envelope(op, row=None, before=None, lsn=0):
    return json.dumps({"before": before, "after": row, "op": op, "ts_ms": 1, "source": {"lsn": lsn}}).encode()


def key(i: int) -> bytes:
    return json.dumps({"id": i}).encode()


@pytest.mark.parametrize("merge", MERGES)
def test_a_late_event_never_overwrites_a_newer_row_nor_brings_a_deleted_one_back_across_runs(
        merge, spark, broker, topic, make_pipeline):
    row = lambda i, name: {"id": i, "name": name, "balance": i}  # noqa: E731
    broker.produce(topic, [
        (0, key(1), envelope("c", row(1, "one"), lsn=10), None),
        (0, key(1), envelope("d", before=row(1, "one"), lsn=30), None),
        (0, key(2), envelope("u", row(2, "two-new"), lsn=50), None),
        (0, key(3), envelope("c", row(3, "tie-first"), lsn=70), None),
        (1, key(3), envelope("u", row(3, "tie-second"), lsn=70), None),  # equal sequence: (partition, offset) decides
        (0, key(4), envelope("c", row(4, "four"), lsn=5), None),
        (0, key(4), None, None),  # its partition's row below it: deleted (as if its d was compacted away)
    ])
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn", merge=merge)
    run(pipeline, spark_factory=lambda: spark)
    broker.produce(topic, [
        (1, key(1), envelope("u", row(1, "late-update"), lsn=20), None),  # older than the delete: stays deleted
        (2, key(2), envelope("u", row(2, "two-old"), lsn=40), None),  # older than the row: stale
        (2, key(5), envelope("d", before=row(5, "five"), lsn=90), None),  # a delete of a key never seen
        (1, key(5), envelope("c", row(5, "five-late"), lsn=80), None),  # its older create arrives after it
        (2, key(6), envelope("c", row(6, "six"), lsn=60), None),
        (2, key(6), envelope("d", before=row(6, "six"), lsn=61), None),
        (1, key(6), envelope("c", row(6, "six-again"), lsn=62), None),  # a re-create after its delete
        (1, key(7), envelope("u", row(7, "seven"), lsn=None), None),
        (1, key(8), envelope("x", row(8, "eight"), lsn=1), None),
        (1, key(9), envelope("u", {"id": None, "name": "no key", "balance": 0}, lsn=1), None),
    ])
    run(pipeline, spark_factory=lambda: spark)
    def applicable_lsn(value):  # None for the three records oncemore must quarantine
        valid = value["op"] in "crud" and isinstance(value["source"]["lsn"], int) and (value["after"] or {}).get(
            "id", value["op"] == "d") is not None
        return value["source"]["lsn"] if valid else None

    rows = {k[0]: r["name"] for k, r in assert_folded(pipeline, broker, topic, applicable_lsn, skip_invalid=True).items()}
    assert rows == {2: "two-new", 3: "tie-second", 6: "six-again"}
    last = oncemore_commits(pipeline.sink.table_uri)[-1][1].records
    assert {k: last[k] for k in ("stale", "quarantined", "noop_deletes", "inserted", "deleted", "superseded")} == {
        "stale": 2, "quarantined": 3, "noop_deletes": 1, "inserted": 1, "deleted": 0, "superseded": 3}, last
    reasons = sorted(r[0] for r in query(pipeline.sink.quarantine_uri, "SELECT error FROM {table}"))
    assert reasons == ["Debezium op 'x' is not c, r, u, d or t", "key column id is NULL",
                       "sequence_by source.lsn is NULL or not a number"]
    # Only a stale event: the MERGE changes nothing, and the positions are committed alone.
    before = DeltaTable(pipeline.sink.table_uri).version()
    broker.produce(topic, [(2, key(2), envelope("u", row(2, "two-older"), lsn=45), None)])
    run(pipeline, spark_factory=lambda: spark)
    version, record = oncemore_commits(pipeline.sink.table_uri)[-1]
    assert version == before + 1 and record.records["stale"] == 1 and record.ranges[topic]["2"][1] == 5
    assert DeltaTable(pipeline.sink.table_uri).get_add_actions().num_rows == \
        DeltaTable(pipeline.sink.table_uri, version=before).get_add_actions().num_rows
    accounted(pipeline)


def test_envelope_none_deletes_by_tombstone_and_by_delete_when_in_offset_order(spark, broker, topic, make_pipeline):
    value = lambda i, name, deleted="false": json.dumps(  # noqa: E731
        {"id": i, "name": name, "balance": i, "__deleted": deleted}).encode()
    broker.produce(topic, [(0, key(1), value(1, "a"), None), (0, key(2), value(2, "b"), None),
                           (0, key(1), None, None), (0, key(2), value(2, "b", "true"), None),
                           (0, key(3), value(3, "c"), None), (0, key(3), value(3, "c2"), None),
                           (1, key(4), None, None)])
    pipeline = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                             format={"type": "json", "schema": ROW + ", __deleted STRING"},
                             upsert={"keys": ["id"], "delete_when": "__deleted = 'true'"})
    run(pipeline, spark_factory=lambda: spark)
    found = table_state(pipeline.sink.table_uri, ("id",))
    assert {k: r["name"] for k, r in found.items()} == {(3,): "c2"}
    assert found[(3,)]["_kafka_offset"] == 5
    last = oncemore_commits(pipeline.sink.table_uri)[-1][1].records
    assert {k: last[k] for k in ("inserted", "superseded", "noop_deletes", "tombstones")} == {
        "inserted": 1, "superseded": 3, "noop_deletes": 3, "tombstones": 0}, last
    accounted(pipeline)


def test_a_debezium_truncate_fails_the_run_naming_it_and_commits_nothing(spark, broker, topic, make_pipeline):
    broker.produce(topic, [(0, key(1), envelope("c", {"id": 1, "name": "a", "balance": 1}, lsn=1), None),
                           (0, None, envelope("t", lsn=2), None)])
    pipeline = debezium(make_pipeline, topic)
    with pytest.raises(Exception, match=rf"pipeline accounts: {topic}/0 offset 1: a Debezium truncate \(op t\)"):
        run(pipeline, spark_factory=lambda: spark)
    assert oncemore_commits(pipeline.sink.table_uri) == []


VALUE = {"type": "record", "name": "Value", "namespace": "shop.public.accounts", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": ["null", "string"], "default": None},
    {"name": "balance", "type": ["null", "long"], "default": None}]}
# As Debezium's Avro converter registers an envelope (trimmed to the fields these events carry).
ENVELOPE = {"type": "record", "name": "Envelope", "namespace": "shop.public.accounts", "fields": [
    {"name": "before", "type": ["null", VALUE], "default": None},
    {"name": "after", "type": ["null", "shop.public.accounts.Value"], "default": None},
    {"name": "source", "type": {"type": "record", "name": "Source", "namespace": "io.debezium.connector.postgresql",
                                "fields": [{"name": "connector", "type": "string"}, {"name": "lsn", "type": "long"}]}},
    {"name": "op", "type": "string"}, {"name": "ts_ms", "type": ["null", "long"], "default": None}]}
KEY = {"type": "record", "name": "Key", "namespace": "shop.public.accounts", "fields": [{"name": "id", "type": "long"}]}


def test_avro_envelopes_through_the_registry_land_the_fold(spark, broker, topic, make_pipeline, registry):
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    client = SchemaRegistryClient(registry.settings())
    values = AvroSerializer(client, json.dumps(ENVELOPE))
    keys = AvroSerializer(client, json.dumps(KEY))
    events = debezium_events(keys=30, changes=200, seed=5)
    records = []
    for event in events:
        value = None if event.value is None else {
            **{k: event.value[k] for k in ("before", "after", "op", "ts_ms")},
            "source": {"connector": "postgresql", "lsn": event.lsn}}
        records.append((event.key["id"] % 3, keys(event.key, SerializationContext(topic, MessageField.KEY)),
                        values(value, SerializationContext(topic, MessageField.VALUE)), None))
    coordinates = broker.produce(topic, records)
    settings = {"type": "avro", "schema_registry": registry.settings()}
    pipeline = make_pipeline(topic, name="accounts", key=settings, format=settings,
                             upsert={"keys": ["id"], "envelope": "debezium"})
    run(pipeline, spark_factory=lambda: spark)
    # The reference fold reads the same events as JSON, at the coordinates they were produced at
    # (in order within a partition; the delivery reports come partition by partition).
    as_json = []
    for partition in range(3):
        offsets = sorted(o for p, o in coordinates if p == partition)
        mine = [e for e in events if e.key["id"] % 3 == partition]
        as_json += [(topic, partition, o, json.dumps(e.key).encode(),
                     None if e.value is None else json.dumps(e.value).encode()) for o, e in zip(offsets, mine)]
    expected = fold(as_json, "debezium", ("id",))
    found = table_state(pipeline.sink.table_uri, ("id",))
    assert found.keys() == expected.keys() and expected
    assert all({c: found[k][c] for c in row} == row for k, row in expected.items())
    assert project(found, COLUMNS) == source_state(events)
    accounted(pipeline)


def test_a_compacted_topic_lands_the_fold_of_what_the_cleaner_left(spark, broker, make_pipeline):
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    topic = f"compacted_{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 2, {"cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01",
                                   "min.compaction.lag.ms": "0"})  # tombstones kept a day, as by default
    events = debezium_events(keys=20, changes=300, seed=9)
    produce(broker.bootstrap_servers, topic, events[:100], "key")
    pipeline = debezium(make_pipeline, topic)
    run(pipeline, spark_factory=lambda: spark)  # before any cleaning
    first = read_back(broker.bootstrap_servers, topic)
    produce(broker.bootstrap_servers, topic, events[100:], "key")
    ends = {p: max(o for _, q, o, _, _ in first if q == p) + 1 for p in (0, 1)}
    produced = len(events) - 100
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        later = [r for r in read_back(broker.bootstrap_servers, topic) if r[2] >= ends[r[1]]]
        if len(later) < produced * 0.8:
            break
        time.sleep(0.5)
        produce(broker.bootstrap_servers, topic, [], "key")
        broker.produce(topic, [(0, b'{"id": 1000}', None, None)])  # rolls the active segment (a tombstone)
        produced += 1
    for done in broker.admin().incremental_alter_configs([ConfigResource("topic", topic, incremental_configs=[
            ConfigEntry("min.compaction.lag.ms", "3600000", incremental_operation=AlterConfigOpType.SET)])]).values():
        done.result(timeout=30)
    time.sleep(2)  # a cleaning under way ends
    later = [r for r in read_back(broker.bootstrap_servers, topic) if r[2] >= ends[r[1]]]
    assert len(later) < produced, "the cleaner removed records of the second run's ranges"

    run(pipeline, spark_factory=lambda: spark)

    expected = fold(first + later, "debezium", ("id",))
    found = table_state(pipeline.sink.table_uri, ("id",))
    assert found.keys() == expected.keys()
    assert all({c: found[k][c] for c in row} == row for k, row in expected.items())
    assert project(found, COLUMNS) == source_state(events)  # compaction keeps each key's last change
    assert accounted(pipeline, gapless=False) == len(first) + len(later)


@pytest.mark.parametrize("merge", MERGES)  # on the cluster, files written before the column gain it as NULL
def test_a_column_added_to_the_row_follows_add_columns_and_old_rows_keep_theirs(merge, spark, broker, topic,
                                                                                make_pipeline):
    upsert = {"keys": ["id"], "merge": merge}
    broker.produce(topic, [(0, key(1), b'{"id": 1, "name": "a", "balance": 1}', None),
                           (0, key(2), b'{"id": 2, "name": "b", "balance": 2}', None)])
    pipeline = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                             format={"type": "json", "schema": ROW}, upsert=upsert)
    run(pipeline, spark_factory=lambda: spark)
    broker.produce(topic, [(0, key(2), b'{"id": 2, "name": "b2", "balance": 3, "tier": "gold"}', None),
                           (0, key(3), b'{"id": 3, "name": "c", "balance": 4, "tier": "silver"}', None)])
    wider = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                          format={"type": "json", "schema": ROW + ", tier STRING"}, upsert=upsert)
    run(wider, spark_factory=lambda: spark)
    found = table_state(wider.sink.table_uri, ("id",))
    assert {k[0]: (r["name"], r["tier"]) for k, r in found.items()} == {1: ("a", None), 2: ("b2", "gold"),
                                                                         3: ("c", "silver")}
    accounted(wider)


def test_a_value_field_named_key_is_a_row_column_when_the_pipeline_reads_no_kafka_key(spark, broker, topic,
                                                                                        make_pipeline):
    broker.produce(topic, [(0, None, b'{"key": "k1", "v": 1}', None), (0, None, b'{"key": "k1", "v": 2}', None),
                           (0, None, b'{"key": "k2", "v": 3}', None)])
    pipeline = make_pipeline(topic, name="by_value_key", format={"type": "json", "schema": "key STRING, v BIGINT"},
                             upsert={"keys": ["key"]})
    run(pipeline, spark_factory=lambda: spark)
    assert table_state(pipeline.sink.table_uri, ("key",)).keys() == {("k1",), ("k2",)}
    assert query(pipeline.sink.table_uri, "SELECT key, v FROM {table} ORDER BY key") == [("k1", 2), ("k2", 3)]


def test_on_a_compacted_topic_a_tombstone_whose_d_the_cleaner_removed_deletes_the_row(spark, broker, make_pipeline):
    """The issue's case: c(1) ingested; d(1) and its tombstone produced; the cleaner compacts the d
    away (well within delete.retention.ms) before the next run. The tombstone deletes the row (it
    came from the tombstone's partition at a lower offset), and verify --replay agrees; a table
    that kept the row is named."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource
    from deltalake import write_deltalake

    from oncemore.report.verify import verify

    topic = f"compacted_{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1, {"cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01",
                                   "min.compaction.lag.ms": "0"})  # tombstones kept a day, as by default
    row = lambda i, name: {"id": i, "name": name, "balance": i}  # noqa: E731
    broker.produce(topic, [(0, key(1), envelope("c", row(1, "one"), lsn=10), None),
                           (0, key(2), envelope("c", row(2, "two"), lsn=11), None)])
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn")
    run(pipeline, spark_factory=lambda: spark)
    first = read_back(broker.bootstrap_servers, topic)
    kept = table_state(pipeline.sink.table_uri)[(1,)]
    broker.produce(topic, [(0, key(1), envelope("d", before=row(1, "one"), lsn=20), None), (0, key(1), None, None),
                           (0, key(2), envelope("u", row(2, "two-b"), lsn=21), None)])
    deadline = time.monotonic() + 60
    while any(v is not None and json.loads(v)["op"] == "d" for *_, v in read_back(broker.bootstrap_servers, topic)):
        assert time.monotonic() < deadline, "the cleaner did not remove the d"
        broker.produce(topic, [(0, b'{"id": 1000}', None, None)])  # rolls the active segment (a tombstone)
        time.sleep(0.5)
    for done in broker.admin().incremental_alter_configs([ConfigResource("topic", topic, incremental_configs=[
            ConfigEntry("min.compaction.lag.ms", "3600000", incremental_operation=AlterConfigOpType.SET)])]).values():
        done.result(timeout=30)
    time.sleep(2)  # a cleaning under way ends
    later = [r for r in read_back(broker.bootstrap_servers, topic) if r[2] > first[-1][2]]
    assert [r[4] for r in later if r[3] == key(1)] == [None], "only the tombstone of key 1 is left"

    run(pipeline, spark_factory=lambda: spark)

    expected = fold(first + later, "debezium", ("id",), sequence=lambda value: value["source"]["lsn"])
    found = table_state(pipeline.sink.table_uri)
    assert set(found) == set(expected) == {(2,)}
    assert all({c: found[k][c] for c in r} == r for k, r in expected.items())
    last = oncemore_commits(pipeline.sink.table_uri)[-1][1].records
    assert last["deleted"] == 1 and last["updated"] == 1, last
    held = DeltaTable(pipeline.sink.tombstones_uri).to_pyarrow_table().to_pylist()
    tombstone = next(r for r in later if r[3] == key(1))
    assert [(r["id"], r["_sequence"], r["_kafka_offset"]) for r in held] == [(1, 10, tombstone[2])]
    assert verify(pipeline, lambda: spark, replay=True).ok

    # A table that kept the row (as before this rule) is named by the replay.
    DeltaTable(pipeline.sink.tombstones_uri).delete()
    write_deltalake(pipeline.sink.table_uri, pa.Table.from_pylist(
        [kept], schema=pa.schema(DeltaTable(pipeline.sink.table_uri).schema().to_arrow())), mode="append")
    wrong = verify(pipeline, lambda: spark, replay=True)
    assert not wrong.ok and wrong.counts == {"replay": 1}, wrong.describe()
    assert wrong.discrepancies[0].detail.startswith("key {'id': 1}: the table holds a row (from this event) that the "
                                                    f"replay does not: the replay deletes the key ({topic}/0 offset "
                                                    f"{tombstone[2]})"), wrong.discrepancies[0].detail


def test_envelope_none_under_a_sequence_deletes_by_tombstone(spark, broker, topic, make_pipeline):
    """With the old rule nothing could delete here (no delete_when, tombstones ignored)."""
    value = lambda i, version: json.dumps({"id": i, "name": f"v{version}", "balance": version}).encode()  # noqa: E731
    broker.produce(topic, [(0, key(1), value(1, 1), None), (0, key(1), None, None),  # deleted
                           (0, key(2), value(2, 5), None), (1, key(2), None, None),  # another partition: stays
                           (0, key(3), value(3, 7), None), (0, key(3), None, None),
                           (1, key(3), value(3, 6), None)])  # older than the deleted row
    pipeline = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                             format={"type": "json", "schema": ROW}, upsert={"keys": ["id"], "sequence_by": "balance"})
    run(pipeline, spark_factory=lambda: spark)
    records = read_back(broker.bootstrap_servers, topic)
    expected = fold(records, "none", ("id",), sequence=lambda v: v["balance"])
    found = table_state(pipeline.sink.table_uri)
    assert set(found) == set(expected) == {(2,)}
    assert all({c: found[k][c] for c in r} == r for k, r in expected.items())
    last = oncemore_commits(pipeline.sink.table_uri)[-1][1].records
    assert {k: last[k] for k in ("inserted", "noop_deletes", "superseded", "tombstones")} == {
        "inserted": 1, "noop_deletes": 2, "superseded": 3, "tombstones": 1}, last
    accounted(pipeline)


def test_a_changed_sequence_by_is_refused_until_resequence_accepts_it(spark, broker, topic, make_pipeline):
    """The issue's switch from source.ts_ms to source.lsn (whose numbers are smaller): refused,
    naming both, before anything is committed; `oncemore resequence` clears the rows' sequences
    and the held deletes, after which each key's next event wins; verify --replay weighs the rows
    of before the change as the table holds them. A table ordered by offsets that gains a
    sequence is refused the same way."""
    from oncemore.report.verify import verify

    def event(op, i, name, lsn, ts):
        image = {"id": i, "name": name, "balance": i}
        return json.dumps({"before": image if op == "d" else None, "after": None if op == "d" else image, "op": op,
                           "ts_ms": ts, "source": {"lsn": lsn, "ts_ms": ts}}).encode()

    broker.produce(topic, [(0, key(1), event("c", 1, "one", 100, 1_790_000_000_000), None),
                           (0, key(2), event("c", 2, "two", 101, 1_790_000_000_001), None),
                           (0, key(2), event("d", 2, "two", 102, 1_790_000_000_002), None)])
    by_time = debezium(make_pipeline, topic, sequence_by="source.ts_ms")
    run(by_time, spark_factory=lambda: spark)
    assert DeltaTable(by_time.sink.table_uri).metadata().configuration["oncemore.upsert.sequence_by"] == "source.ts_ms"
    broker.produce(topic, [(0, key(1), event("u", 1, "one-b", 200, 1_790_000_000_100), None),
                           (0, key(2), event("c", 2, "two-again", 201, 1_790_000_000_101), None)])
    by_lsn = debezium(make_pipeline, topic, sequence_by="source.lsn")
    before = len(oncemore_commits(by_lsn.sink.table_uri))
    with pytest.raises(SequenceChanged, match=r"pipeline accounts: table .* was ordered by sequence_by "
                                              r"'source.ts_ms', the pipeline says sequence_by 'source.lsn'"):
        run(by_lsn, spark_factory=lambda: spark)
    assert len(oncemore_commits(by_lsn.sink.table_uri)) == before
    said = oncemore("run", "--config", by_lsn.origin)
    assert said.returncode == 1 and "'source.ts_ms'" in said.stderr and "'source.lsn'" in said.stderr, said.stderr

    done = oncemore("resequence", "--config", by_lsn.origin)
    assert done.returncode == 0, done.stderr
    assert {k: v for k, v in json.loads(done.stdout).items() if k != "version"} == {
        "pipeline": "accounts", "status": "resequenced", "from": "source.ts_ms", "to": "source.lsn",
        "rows_cleared": 1, "deletes_forgotten": 1}, done.stdout
    assert json.loads(oncemore("resequence", "--config", by_lsn.origin).stdout)["status"] == "unchanged"
    assert [r["_sequence"] for r in DeltaTable(by_lsn.sink.table_uri).to_pyarrow_table().to_pylist()] == [None]
    report = run(by_lsn, spark_factory=lambda: spark)
    assert {k[0]: r["name"] for k, r in table_state(by_lsn.sink.table_uri).items()} == {1: "one-b", 2: "two-again"}
    assert {k: report.batches[0].events[k] for k in ("inserted", "updated", "stale")} == {
        "inserted": 1, "updated": 1, "stale": 0}
    assert "1 inserted, 1 updated, 0 deleted, 0 stale" in report.summary()
    assert verify(by_lsn, lambda: spark, replay=True).ok

    offsets = make_pipeline(topic, name="by_offsets", key={"type": "json", "schema": "id BIGINT"},
                            format={"type": "json", "schema": ROW}, upsert={"keys": ["id"], "envelope": "debezium"})
    run(offsets, spark_factory=lambda: spark)
    sequenced = make_pipeline(topic, name="by_offsets", key={"type": "json", "schema": "id BIGINT"},
                              format={"type": "json", "schema": ROW},
                              upsert={"keys": ["id"], "envelope": "debezium", "sequence_by": "source.lsn"})
    broker.produce(topic, [(0, key(3), event("c", 3, "three", 300, 1_790_000_000_200), None)])
    with pytest.raises(SequenceChanged, match="was ordered by no sequence_by .*, the pipeline says sequence_by "
                                              "'source.lsn'"):
        run(sequenced, spark_factory=lambda: spark)


def test_an_update_that_changes_the_key_is_quarantined_not_applied_by_its_new_key(spark, broker, topic, make_pipeline):
    """Suspected from reading, confirmed: a u whose before key differs from its after key upserted
    the new key and left the old one (two rows for one source row). It is quarantined, named."""
    row = lambda i, name: {"id": i, "name": name, "balance": i}  # noqa: E731
    broker.produce(topic, [(0, key(1), envelope("c", row(1, "one"), lsn=1), None),
                           (0, key(5), envelope("u", row(5, "five"), before=row(1, "one"), lsn=2), None),
                           (0, key(2), envelope("u", row(2, "two"), before=row(2, "two-was"), lsn=3), None)])
    pipeline = debezium(make_pipeline, topic)
    run(pipeline, spark_factory=lambda: spark)
    rekey = envelope("u", row(5, "five"), before=row(1, "one"), lsn=2)
    found = assert_folded(pipeline, broker, topic, skip=rekey)
    assert set(found) == {(1,), (2,)}
    (reason,) = query(pipeline.sink.quarantine_uri, "SELECT error FROM {table}")
    assert reason[0].startswith("Debezium op u changes the key (before {\"id\":1,"), reason
    accounted(pipeline)


def test_a_sequence_finer_than_decimal_38_6_is_quarantined_not_tied(spark, broker, topic, make_pipeline):
    """Suspected from reading, confirmed: seconds with nanoseconds rounded to 6 places tied (the
    offset then decided), and 34 digits were quarantined as 'not a number'."""
    value = lambda i, name, at: json.dumps({"id": i, "name": name, "balance": 0, "at": at}).encode()  # noqa: E731
    broker.produce(topic, [(0, key(1), value(1, "later", "1700000000.123456789"), None),
                           (0, key(1), value(1, "earlier", "1700000000.123456788"), None),
                           (0, key(2), value(2, "fits", "1700000000.1234560"), None),
                           (0, key(3), value(3, "huge", "1" * 34), None)])
    pipeline = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                             format={"type": "json", "schema": ROW + ", at STRING"},
                             upsert={"keys": ["id"], "sequence_by": "at"})
    run(pipeline, spark_factory=lambda: spark)
    assert {k[0]: r["name"] for k, r in table_state(pipeline.sink.table_uri).items()} == {2: "fits"}
    reasons = sorted(r[0] for r in query(pipeline.sink.quarantine_uri, "SELECT error FROM {table}"))
    assert len(reasons) == 3 and all(r.startswith("sequence_by at = ") and "does not fit DECIMAL(38,6) exactly" in r
                                     for r in reasons), reasons
    accounted(pipeline)


def test_debeziums_placeholder_keeps_the_stored_value_and_verify_replays_it(spark, broker, topic, make_pipeline):
    """REPLICA IDENTITY DEFAULT: an update carries the placeholder for an unchanged TOASTed column;
    the 5,000-character value stays (from the table's row, or the key's earlier event in the part);
    a create whose column is the placeholder stores NULL, counted."""
    from oncemore.report.verify import verify

    placeholder, big = "__debezium_unavailable_value", "x" * 5000
    row = lambda i, name, balance: {"id": i, "name": name, "balance": balance}  # noqa: E731
    broker.produce(topic, [(0, key(1), envelope("c", row(1, big, 1), lsn=1), None)])
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn")
    run(pipeline, spark_factory=lambda: spark)
    broker.produce(topic, [(0, key(1), envelope("u", row(1, placeholder, 2), lsn=2), None),
                           (0, key(2), envelope("c", row(2, "two", 3), lsn=3), None),
                           (0, key(2), envelope("u", row(2, placeholder, 4), lsn=4), None),
                           (0, key(3), envelope("c", row(3, placeholder, 5), lsn=5), None)])
    report = run(pipeline, spark_factory=lambda: spark)
    expected = fold(read_back(broker.bootstrap_servers, topic), sequence=lambda value: value["source"]["lsn"])
    assert {k: r["name"] for k, r in expected.items()} == {(1,): placeholder, (2,): placeholder, (3,): placeholder}
    for id_, kept in ((1, big), (2, "two"), (3, None)):  # the fold with each placeholder resolved
        expected[(id_,)]["name"] = kept
    found = table_state(pipeline.sink.table_uri)
    assert set(found) == set(expected)
    assert all({c: found[k][c] for c in r} == r for k, r in expected.items())
    last = oncemore_commits(pipeline.sink.table_uri)[-1][1].records
    assert {k: last[k] for k in ("inserted", "updated", "superseded", "unavailable")} == {
        "inserted": 2, "updated": 1, "superseded": 1, "unavailable": 1}, last
    assert "1 unavailable" in report.summary()
    assert verify(pipeline, lambda: spark, replay=True).ok
    accounted(pipeline)
