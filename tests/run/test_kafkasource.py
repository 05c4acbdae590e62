"""The range reader on its own (the code each Spark task runs), against the real broker."""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import Consumer

from conftest import allow_any_timestamp, by_partition, keyed, orders
from oncemore.kafka import batches as records_module
from oncemore.kafka.batches import READ_SCHEMA, RangeRecords
from oncemore.kafka.clients import KafkaReadError, admin_client, consumer_config, log_bounds, range_consumer
from oncemore.kafka.fitted import FETCH_SIZES, FittedConsumer, fetch_size
from oncemore.run.kafkasource import KafkaRangeDataSource, KafkaRangeReader, offsets_option


def records(pipeline, partition, start, end, stall=20.0, max_bytes=None, consumer=None) -> RangeRecords:
    consumer = consumer or Consumer(consumer_config(pipeline))
    return RangeRecords(consumer, pipeline.source.topic, partition, start, end, stall,
                        f"pipeline {pipeline.name}: {pipeline.source.topic}/{partition}", max_bytes)


def read(pipeline, partition, start, end, stall=20.0, consumer=None) -> pa.Table:
    return pa.Table.from_batches(list(records(pipeline, partition, start, end, stall, consumer=consumer)),
                                 schema=READ_SCHEMA)


def test_one_consumer_reads_range_after_range_exactly(broker, topic, make_pipeline):
    broker.produce(topic, orders(0, 3_000))  # 1,000 a partition: prefetching runs ahead of each range
    pipeline = make_pipeline(topic)
    with range_consumer(consumer_config(pipeline), pipeline.name) as consumer:
        for partition, start, end in [(0, 0, 10), (1, 500, 510), (0, 10, 400), (2, 999, 1_000), (0, 5, 6), (1, 0, 3)]:
            offsets = read(pipeline, partition, start, end, consumer=consumer).column("offset").to_pylist()
            partitions = set(read(pipeline, partition, start, end, consumer=consumer).column("partition").to_pylist())
            assert offsets == list(range(start, end)) and partitions == {partition}


def test_fetch_sizes_follow_a_ranges_bytes_between_64_kib_and_1_mib():
    assert fetch_size(1_000, None) == 1 << 20  # the record size unknown: librdkafka's default
    assert fetch_size(1_000, 203) == fetch_size(20_000, 203) == 64 << 10  # 4 MB: 16 fetches of 254 KB
    assert fetch_size(21_000, 203) == 256 << 10
    assert fetch_size(250_000, 203) == fetch_size(10_000_000, 203) == 1 << 20
    assert fetch_size(1, 50) == 64 << 10


def test_a_tasks_consumer_fits_its_fetches_to_each_range_and_reads_each_exactly(broker, topic, make_pipeline):
    broker.produce(topic, [(0, None, b"%07d" % i + b"x" * 993, None) for i in range(6_000)])  # 1,000 B each
    pipeline = make_pipeline(topic)
    with FittedConsumer(consumer_config(pipeline), pipeline.name) as consumers:
        made = []
        # Unknown sizes, then 100 KB, 5 MB and 10 KB ranges: 1 MiB, 64 KiB, 256 KiB, 64 KiB fetches.
        for start, end, size in [(0, 10, 1 << 20), (10, 110, 64 << 10), (110, 5_110, 256 << 10), (5_110, 5_120, 64 << 10)]:
            consumer = consumers.for_range(end - start)
            assert consumers.size == size
            made.append(consumer)
            table = read(pipeline, 0, start, end, consumer=consumer)
            assert table.column("offset").to_pylist() == list(range(start, end))
            consumers.read(end - start, sum(map(len, table.column("value").to_pylist())))
        assert len({id(c) for c in made}) == 4  # a consumer per fetch size
        assert consumers.for_range(100) is made[-1]  # the same size: the same consumer


@pytest.mark.parametrize("key", ["max.partition.fetch.bytes", "fetch.message.max.bytes"])
def test_a_fetch_size_the_user_set_is_kept_for_every_range(broker, topic, make_pipeline, key):
    broker.produce(topic, orders(0, 300, partitions=1))
    pipeline = make_pipeline(topic, source={"kafka_options": {key: "100000"}})
    config = consumer_config(pipeline)
    assert config[key] == "100000" and FETCH_SIZES[-1] != 100000
    with FittedConsumer(config, pipeline.name) as consumers:
        first = consumers.for_range(10)
        assert read(pipeline, 0, 0, 10, consumer=first).num_rows == 10
        consumers.read(10, 1_000)
        assert consumers.for_range(290) is first and consumers.size is None  # librdkafka takes the user's
        assert read(pipeline, 0, 10, 300, consumer=first).column("offset").to_pylist() == list(range(10, 300))


def test_reads_exactly_the_range_across_transaction_markers(broker, topic, make_pipeline):
    produced = []
    for start in range(0, 600, 100):  # six transactions: a marker offset after each
        produced += broker.produce(topic, [(0, None, v, None) for _, _, v, _ in orders(start, 100)], transactional_id="tx")
    pipeline = make_pipeline(topic)
    offsets = [o for _, o in produced]
    end = next(iter(log_bounds(admin_client(pipeline), pipeline, keyed(topic, {0: 0})).values())).latest
    assert end == offsets[-1] + 2  # the last offset is the commit marker

    whole = read(pipeline, 0, 0, end)
    assert whole.column("offset").to_pylist() == offsets
    middle = read(pipeline, 0, offsets[150], offsets[420])
    assert middle.column("offset").to_pylist() == offsets[150:420]
    # A range ending on a marker offset completes: the position moves past markers.
    marker = offsets[99] + 1
    assert read(pipeline, 0, 0, marker + 1).num_rows == 100
    assert whole.column("partition").unique().to_pylist() == [0]
    assert whole.column("topic").unique().to_pylist() == [topic]
    assert whole.schema.field("timestamp").type == pa.timestamp("us", tz="UTC")


def test_missing_records_fail_after_the_stall_timeout_naming_partition_and_offset(broker, topic, make_pipeline):
    broker.produce(topic, [(1, None, b"{}", None)] * 5)
    pipeline = make_pipeline(topic)
    with pytest.raises(KafkaReadError, match=rf"pipeline orders: {topic}/1: no progress for 2s "
                                             rf"\(source.stall_timeout_seconds\) at offset 5 of range \[0, 50\): "
                                             "the records are missing from the broker"):
        read(pipeline, 1, 0, 50, stall=2.0)


def test_records_deleted_while_planned_fail_the_read_naming_the_offsets(broker, topic, make_pipeline):
    produced = broker.produce(topic, [(0, None, b"{}", None)] * 50)
    pipeline = make_pipeline(topic)
    broker.delete_records(topic, {0: 30})
    with pytest.raises(KafkaReadError, match=rf"pipeline orders: {topic}/0: read failed at offset 10 of range \[10, 50\)"):
        read(pipeline, 0, 10, len(produced))


def test_aborted_transactions_are_never_read(broker, topic, make_pipeline):
    kept = broker.produce(topic, orders(0, 30, partitions=1), transactional_id="tx")
    broker.produce(topic, orders(30, 30, partitions=1), transactional_id="tx", abort=True)
    kept += broker.produce(topic, orders(60, 30, partitions=1), transactional_id="tx")
    pipeline = make_pipeline(topic)
    end = next(iter(log_bounds(admin_client(pipeline), pipeline, keyed(pipeline.source.topic, {0: 0})).values())).latest
    assert read(pipeline, 0, 0, end).column("offset").to_pylist() == by_partition(kept)[0]


def test_a_byte_budget_stops_after_the_record_reaching_it_and_says_where(broker, topic, make_pipeline):
    values = [bytes([65 + i % 26]) * 1_000 for i in range(40)]
    produced = broker.produce(topic, [(0, None, v, None) for v in values])
    pipeline = make_pipeline(topic)
    offsets = by_partition(produced)[0]

    cut = records(pipeline, 0, 0, offsets[-1] + 1, max_bytes=10_500)
    table = pa.Table.from_batches(list(cut), schema=READ_SCHEMA)
    assert table.column("offset").to_pylist() == offsets[:11]
    assert (cut.reached, cut.bytes_read) == (offsets[10] + 1, 11_000)
    # A record larger than the whole budget is still read: a run always moves on.
    one = records(pipeline, 0, offsets[11], offsets[-1] + 1, max_bytes=10)
    assert [b.num_rows for b in one] == [1] and one.reached == offsets[11] + 1
    whole = records(pipeline, 0, 0, offsets[-1] + 1)
    assert sum(b.num_rows for b in whole) == 40 and whole.reached == offsets[-1] + 1


def test_batches_end_at_the_record_reaching_either_bound_and_carry_every_field(broker, topic, make_pipeline, monkeypatch):
    monkeypatch.setattr(records_module, "BATCH_ROWS", 7)
    monkeypatch.setattr(records_module, "BATCH_BYTES", 3_000)
    sizes = [(i * 397) % 1_300 for i in range(60)]
    stamps = [1_700_000_000_000 + i for i in range(59)] + [2**62]  # the last: no microsecond timestamp holds it
    sent = [(0, None if i % 5 == 0 else f"k{i}".encode(), bytes([97 + i % 26]) * sizes[i], stamps[i]) for i in range(60)]
    allow_any_timestamp(broker, topic)
    headers = [("trace", b"a"), ("trace", None), ("tenant", b"t1")]
    offsets = by_partition(broker.produce(topic, sent, headers=headers))[0]
    pipeline = make_pipeline(topic)

    whole = RangeRecords(Consumer(consumer_config(pipeline)), topic, 0, 0, offsets[-1] + 1, 20.0, "test", headers=True)
    batches = list(whole)
    assert [b.num_rows for b in batches] and all(b.num_rows <= 7 for b in batches)
    for batch in batches[:-1]:  # each ends with the record that reaches a bound, never later
        lengths = [len(k or b"") + len(v) for k, v in zip(batch.column("key").to_pylist(), batch.column("value").to_pylist())]
        assert batch.num_rows == 7 or (sum(lengths) >= 3_000 and sum(lengths) - lengths[-1] < 3_000)
    table = pa.Table.from_batches(batches, schema=READ_SCHEMA)
    assert table.column("offset").to_pylist() == offsets
    assert table.column("key").to_pylist() == [k for _, k, _, _ in sent]
    assert table.column("value").to_pylist() == [v for _, _, v, _ in sent]
    assert table.column("timestamp_ms").to_pylist() == stamps
    assert table.column("timestamp").cast(pa.int64()).to_pylist() == [s * 1000 for s in stamps[:-1]] + [None]
    assert set(table.column("timestampType").to_pylist()) == {0}  # CreateTime
    assert table.column("headers").to_pylist() == [[{"key": k, "value": v} for k, v in headers]] * 60
    assert (whole.reached, whole.bytes_read) == (offsets[-1] + 1, sum(len(k or b"") + len(v) for _, k, v, _ in sent))

    budget = sum(len(k or b"") + len(v) for _, k, v, _ in sent[:23]) - 1  # reached by record 22
    cut = RangeRecords(Consumer(consumer_config(pipeline)), topic, 0, 0, offsets[-1] + 1, 20.0, "test", budget)
    assert pa.Table.from_batches(list(cut), schema=READ_SCHEMA).column("offset").to_pylist() == offsets[:23]
    assert cut.reached == offsets[22] + 1


def test_reader_splits_ranges_into_sub_ranges():
    reader = KafkaRangeReader({
        "startingOffsets": offsets_option(keyed("t", {0: 0, 1: 5})), "endingOffsets": offsets_option(keyed("t", {0: 250, 1: 6})),
        "maxRecordsPerPartition": "100",
    })
    assert [(p.partition, p.start, p.end) for p in reader.partitions()] == [(0, 0, 100), (0, 100, 200), (0, 200, 250), (1, 5, 6)]


@pytest.mark.spark
def test_spark_reads_a_range_as_records_with_the_kafka_source_columns(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 600))
    pipeline = make_pipeline(topic)
    by_partition = {p: sorted(o for q, o in produced if q == p) for p in (0, 1, 2)}
    spark.dataSource.register(KafkaRangeDataSource)
    reader = (spark.read.format(KafkaRangeDataSource.name())
              .option("startingOffsets", offsets_option(keyed(topic, {0: by_partition[0][10], 2: 0})))
              .option("endingOffsets", offsets_option(keyed(topic, {0: by_partition[0][20], 2: by_partition[2][-1] + 1})))
              .option("maxRecordsPerPartition", "50"))
    for key, value in consumer_config(pipeline).items():
        reader = reader.option(f"kafka.{key}", value)
    frame = reader.load()

    assert frame.columns == ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType"]
    rows = sorted((r.partition, r.offset) for r in frame.select("partition", "offset").collect())
    assert rows == [(0, o) for o in by_partition[0][10:20]] + [(2, o) for o in by_partition[2]]



def test_a_task_function_of_megabytes_reaches_no_file_with_the_credentials_it_holds(spark):
    # PySpark broadcast a function whose pickle passed 1 MiB: a file under spark.local.dir, on the
    # driver and each executor, which a killed run leaves behind. The ingest job's function holds
    # the Kafka and storage credentials and all its tasks' ranges (kafkasource.IngestTasks).
    secret = f"hunter2-{uuid.uuid4().hex}"
    options = {"kafka.sasl.password": secret, "tasks": "x" * 2_000_000}

    def each(batches):
        for batch in batches:
            yield pa.RecordBatch.from_pylist([{"n": len(options["tasks"])}] * batch.num_rows)

    assert [r.n for r in spark.range(0, 2, 1, 2).mapInArrow(each, "n long").collect()] == [2_000_000] * 2
    written = [path for path in Path(spark.sparkContext._temp_dir).rglob("*")
               if path.is_file() and secret.encode() in path.read_bytes()]
    assert not written
