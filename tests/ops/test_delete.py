"""`oncemore delete`: rows removed on purpose, each table's commit recording the offsets it
removed, so `verify` still passes; a deletion by another writer is named by `verify` with its
partition, offsets and version. Counted by (topic, partition, offset)."""

from __future__ import annotations

import threading

import pytest
from deltalake import DeltaTable

from conftest import assert_exactly_once, oncemore, orders, read_pairs
from oncemore.config.values import OffsetBound
from oncemore.ops.delete import DeleteRefused, delete
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark


def malformed_every(records, step: int):
    return [(p, k, b"{not json" if i % step == 0 else v, h) for i, (p, k, v, h) in enumerate(records)]


def order_id(pair: tuple[int, int]) -> int:
    return pair[0] + 3 * pair[1]  # orders() puts order i at partition i % 3, in order


def test_a_deletion_is_recorded_and_verify_accounts_for_it(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, malformed_every(orders(0, 300), 50))
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 150})
    runner.run(pipeline, spark_factory=lambda: spark)
    version = DeltaTable(pipeline.sink.table_uri).version()

    dry = oncemore("delete", "--config", pipeline.origin, "--where", "id % 10 = 3", "--dry-run", check_no_spark=True)
    assert dry.returncode == 0, dry.stderr
    assert f"orders: main table: would delete, 30 rows at offsets {{\"{topic}\": " in dry.stdout
    assert "orders: quarantine table: left as it is: the predicate names a column it lacks" in dry.stdout
    assert DeltaTable(pipeline.sink.table_uri).version() == version

    done = oncemore("delete", "--config", pipeline.origin, "--where", "id % 10 = 3", check_no_spark=True)

    assert done.returncode == 0, done.stderr
    assert f"orders: main table: deleted (table version {version + 1}), 30 rows" in done.stdout
    deleted = {pair for pair in produced if order_id(pair) % 10 == 3}
    main, quarantined = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    assert_exactly_once(main + quarantined, sorted(set(produced) - deleted))
    # By coordinates, the quarantine table too: a record's every row, wherever it landed.
    both = delete(pipeline, "_kafka_partition = 0 AND _kafka_offset < 20")
    # Offsets 0-19 of partition 0: offset 0 malformed, 1 and 11 (orders 3 and 33) deleted already.
    assert both["tables"]["main"]["rows"] == 17 and both["tables"]["quarantine"]["rows"] == 1
    report = verify(pipeline, lambda: spark)
    assert report.ok, report.describe()
    assert report.rows["deleted"] == 48
    assert "48 deleted since by oncemore delete" in report.describe()
    # Ingestion goes on; the deleted rows stay deleted.
    more = broker.produce(topic, orders(300, 30))
    runner.run(pipeline, spark_factory=lambda: spark)
    gone = deleted | {(0, o) for o in range(20)}
    assert_exactly_once(read_pairs(pipeline.sink.table_uri) + read_pairs(pipeline.sink.quarantine_uri),
                        sorted(set(produced + more) - gone))
    assert verify(pipeline, lambda: spark).ok


def test_a_deletion_by_another_writer_is_named_by_partition_offset_and_version(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    outside = DeltaTable(pipeline.sink.table_uri)
    outside.delete("id = 7")  # order 7: partition 1, offset 2, deleted with no record

    report = verify(pipeline, lambda: spark)

    assert not report.ok
    (count,) = [d for d in report.discrepancies if d.kind == "count"]
    assert (count.topic, count.partition) == (topic, 1)
    assert count.detail.endswith(f": offset(s) 2 of {topic}/1 are in Kafka and in neither table"), count.detail
    assert f"rows were removed outside oncemore by version(s) {outside.version()} (DELETE)" in count.detail
    assert len(read_pairs(pipeline.sink.table_uri)) == len(produced) - 1


def test_a_deletion_racing_ingestion_removes_only_what_it_records(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 3_000))
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 300})
    runner.run(pipeline, until=OffsetBound.parse('{"0": 300, "1": 300, "2": 300}'), spark_factory=lambda: spark)
    ingesting = threading.Thread(target=lambda: runner.run(pipeline, spark_factory=lambda: spark))
    ingesting.start()
    done = delete(pipeline, "id % 7 = 0")  # rows committed meanwhile are not the deletion's to remove
    ingesting.join()

    recorded = done["tables"]["main"]["offsets"][topic]
    removed = {(int(p), o) for p, runs in recorded.items() for s, e in runs for o in range(s, e)}
    assert removed and all(order_id(pair) % 7 == 0 for pair in removed)
    landed = read_pairs(pipeline.sink.table_uri)
    assert_exactly_once(landed, sorted(set(produced) - removed))
    report = verify(pipeline, lambda: spark)
    assert report.ok, report.describe()


def test_a_predicate_that_does_not_resolve_is_refused_naming_it(broker, topic, make_pipeline, spark):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    with pytest.raises(DeleteRefused, match=r"pipeline orders: delete --where 'nope = 1' on .*: .*nope"):
        delete(pipeline, "nope = 1")
    assert len(read_pairs(pipeline.sink.table_uri)) == 30
    said = oncemore("delete", "--config", pipeline.origin, "--where", "nope = 1", check_no_spark=True)
    assert said.returncode == 1 and said.stderr.strip().splitlines()[-1].startswith("oncemore: error: pipeline orders")


def test_the_rows_a_predicate_matches_are_the_rows_deleted_and_recorded(broker, topic, make_pipeline, spark):
    # delta-rs's delete coerces 2.501 to the column's DECIMAL(10,2), 2.50, where its query engine does
    # not: deleting by the predicate kept order 2 (amount 2.50) while the record named it removed.
    produced = broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT, customer STRING, amount DECIMAL(10,2)"})
    runner.run(pipeline, spark_factory=lambda: spark)

    done = delete(pipeline, "id < 10 AND amount <> 2.501")

    assert done["tables"]["main"]["rows"] == 10
    removed = {pair for pair in produced if order_id(pair) < 10}
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), sorted(set(produced) - removed))
    report = verify(pipeline, lambda: spark)
    assert report.ok and report.rows["deleted"] == 10, report.describe()
