"""Upserts counted against a fold of the produced events, key by key (devtools/changefeed.py is the
reference, written apart from oncemore's MERGE): offset order, sequence order with late events and
re-creates after deletes, the two-partition refusal, the counts in each commit's record."""

from __future__ import annotations

import pytest

from conftest import oncemore_commits
from devtools.changefeed import debezium_events, fold, produce, project, read_back, source_state, table_state
from oncemore.commit.merge import COUNTS, KeyInTwoPartitions
from oncemore.run.runner import run

ROW = "id BIGINT, name STRING, balance BIGINT"
COLUMNS = ("id", "name", "balance")


def debezium(make_pipeline, topic, sequence_by=None, **overrides):
    upsert = {"keys": ["id"], "envelope": "debezium", **({"sequence_by": sequence_by} if sequence_by else {})}
    return make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                         format={"type": "json", "schema": ROW}, upsert=upsert, **overrides)


def assert_folded(pipeline, broker, topic, sequence=None):
    """The table equals the fold of everything in the topic, key by key, coordinates included."""
    expected = fold(read_back(broker.bootstrap_servers, topic), "debezium", ("id",), sequence=sequence)
    found = table_state(pipeline.sink.table_uri, ("id",))
    assert set(found) == set(expected)
    for key, row in expected.items():
        assert {c: found[key][c] for c in row} == row, key
    return found


def accounted(pipeline):
    """Every commit's record accounts for every record of its ranges."""
    for _, record in oncemore_commits(pipeline.sink.table_uri):
        if record.run_id.startswith("oncemore-"):
            counts = record.records
            read = sum(e - s for partitions in record.ranges.values() for s, e in partitions.values())
            assert counts["written"] == sum(counts[c] for c in COUNTS), counts
            assert counts["written"] + counts["quarantined"] + counts["filtered"] == read, (counts, read)


def test_debezium_in_offset_order_lands_the_source_tables_state(spark, broker, topic, make_pipeline):
    events = debezium_events(keys=40, changes=300, seed=1)
    produce(broker.bootstrap_servers, topic, events[:200], "key")
    pipeline = debezium(make_pipeline, topic)
    run(pipeline, spark_factory=lambda: spark)
    produce(broker.bootstrap_servers, topic, events[200:], "key")
    report = run(pipeline, spark_factory=lambda: spark)
    found = assert_folded(pipeline, broker, topic)
    assert project(found, COLUMNS) == source_state(events)
    accounted(pipeline)
    assert report.batches[0].status == "committed"
    again = run(pipeline, spark_factory=lambda: spark)
    assert all(b.status != "committed" for b in again.batches)


def test_late_events_and_recreates_after_deletes_follow_the_sequence(spark, broker, topic, make_pipeline):
    events = debezium_events(keys=30, changes=400, seed=7)
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn")
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
    produce(broker.bootstrap_servers, topic, events, "shuffled", seed=1)
    pipeline = debezium(make_pipeline, topic)
    with pytest.raises(KeyInTwoPartitions, match=r"pipeline accounts: key \{'id': \d+\} has events in partitions"):
        run(pipeline, spark_factory=lambda: spark)
    assert oncemore_commits(pipeline.sink.table_uri) == []
