"""oncemore's tables beside delta-spark, the Delta the design card names (a Spark Connect server with
devtools.sparkjars' jars: delta-spark 4.4): it reads every kind of table as DuckDB does, maintains them while
oncemore ingests, streams from them downstream, turns on the features a Spark user may turn on, and
deletes from them. Every count is by (topic, partition, offset); oncemore runs on the same server.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pyspark.sql.types import StructType

from conftest import assert_exactly_once, duckdb_connection, held_positions, orders, read_pairs
from oncemore.commit.tables import ensure_table
from oncemore.config.values import OffsetBound
from oncemore.core.errors import PositionsMissing, UnsupportedTable
from oncemore.ops.delete import DeleteRefused, delete
from oncemore.ops.maintain import maintain
from oncemore.ops.reset import reset
from oncemore.plan.planner import plan_run
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def delta(delta_server):
    """One session on the server for oncemore's runs and delta-spark's statements alike."""
    from oncemore.run.session import spark_session, stop_session

    session = spark_session(remote=delta_server.url)
    yield session
    stop_session(session)
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)  # the worker's other modules use a classic session


def ingest(pipeline, delta):
    return runner.run(pipeline, spark_factory=lambda: delta)


def spark_pairs(delta, path: str) -> list[tuple[int, int]]:
    return sorted((r[0], r[1]) for r in delta.sql(f"SELECT _kafka_partition, _kafka_offset FROM delta.`{path}`").collect())


# --- reads ------------------------------------------------------------------------------------

RICH = ("id BIGINT, region STRING, amount DECIMAL(12,2), at TIMESTAMP, local_at TIMESTAMP_NTZ, "
        "tags MAP<STRING, INT>, address STRUCT<city: STRING, zip: STRING>, "
        "items ARRAY<STRUCT<sku: STRING, qty: INT>>, flag BOOLEAN, ratio FLOAT, day DATE")


def rich(i: int, evolved: bool = False) -> bytes:
    value = {"id": i, "region": ["eu", "us: east", "a%b=c/d#é"][i % 3], "amount": f"{i * 7.25:.2f}",
             "at": f"2026-11-{1 + i % 28:02d}T{i % 24:02d}:15:30.123456Z", "local_at": f"2026-06-01T{i % 24:02d}:00:00",
             "tags": {"a": i, "b": None} if i % 4 else None, "address": {"city": f"c{i}", "zip": None},
             "items": [{"sku": f"s{i}", "qty": i % 5}, {"sku": None, "qty": None}] if i % 5 else [],
             "flag": bool(i % 2), "ratio": i / 8, "day": f"2026-02-{1 + i % 28:02d}"}
    if evolved:
        value["note"] = f"n{i}"
    return json.dumps(value).encode()


DUCKDB_TYPES = {"bigint": "BIGINT", "int": "INTEGER", "integer": "INTEGER", "string": "VARCHAR", "boolean": "BOOLEAN",
                "float": "FLOAT", "double": "DOUBLE", "date": "DATE", "timestamp": "TIMESTAMP WITH TIME ZONE",
                "timestamp_ntz": "TIMESTAMP", "binary": "BLOB", "smallint": "SMALLINT", "tinyint": "TINYINT"}


def duckdb_type(data_type) -> str:
    """The type DuckDB's Delta reader gives a column of Spark type ``data_type``."""
    from pyspark.sql.types import ArrayType, DecimalType, MapType, StructType

    if isinstance(data_type, StructType):
        return "STRUCT(" + ", ".join(f"{f.name} {duckdb_type(f.dataType)}" for f in data_type.fields) + ")"
    if isinstance(data_type, ArrayType):
        return duckdb_type(data_type.elementType) + "[]"
    if isinstance(data_type, MapType):
        return f"MAP({duckdb_type(data_type.keyType)}, {duckdb_type(data_type.valueType)})"
    if isinstance(data_type, DecimalType):
        return f"DECIMAL({data_type.precision},{data_type.scale})"
    return DUCKDB_TYPES[data_type.simpleString()]


def plain(value):
    """A value as both readers can give it: structs and maps as dicts, instants as naive UTC."""
    if hasattr(value, "asDict"):
        return {k: plain(v) for k, v in value.asDict().items()}
    if isinstance(value, dict):
        if set(value) == {"key", "value"} and isinstance(value["key"], list):  # DuckDB's MAP, older form
            return {k: plain(v) for k, v in zip(value["key"], value["value"])}
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, datetime.datetime) and value.tzinfo is not None:
        return value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    if isinstance(value, float):
        return round(value, 6)
    return value


def both_readers(delta, path: str) -> tuple[dict, dict]:
    """The table's rows by (topic, partition, offset), read by delta-spark and by DuckDB, after
    each reader's column types are checked against the table's own schema."""
    frame = delta.read.format("delta").load(path)
    described = duckdb_connection().execute(f"DESCRIBE SELECT * FROM delta_scan('{path}')").fetchall()
    assert [(f.name, duckdb_type(f.dataType)) for f in frame.schema.fields] == [(r[0], r[1]) for r in described]
    written = StructType.fromJson(json.loads(DeltaTable(path).schema().to_json()))
    assert [(f.name, f.dataType) for f in frame.schema.fields] == [(f.name, f.dataType) for f in written.fields]
    names = frame.schema.names
    key = ("_kafka_topic", "_kafka_partition", "_kafka_offset")

    def by_key(rows):
        found = {}
        for row in rows:
            record = dict(zip(names, (plain(v) for v in row)))
            found[tuple(record[k] for k in key)] = record
        assert len(found) == len(rows), "a (topic, partition, offset) twice"
        return found

    return (by_key([tuple(r) for r in frame.collect()]),
            by_key(duckdb_connection().execute(f"SELECT * FROM delta_scan('{path}')").fetchall()))


def test_a_table_at_writer_version_7_lists_the_invariants_delta_spark_takes_not_null_columns_for(tmp_path):
    # delta-rs creates a table with a TIMESTAMP_NTZ column at writer version 7 listing timestampNtz
    # alone; delta-spark refused to read it (DELTA_FEATURES_PROTOCOL_METADATA_MISMATCH: invariants).
    schema = pa.schema([pa.field("_kafka_offset", pa.int64(), nullable=False), pa.field("at", pa.timestamp("us"))])
    ensure_table(str(tmp_path / "t"), schema, (), "t", "a TIMESTAMP_NTZ column")
    protocol = DeltaTable(str(tmp_path / "t")).protocol()
    assert protocol.min_writer_version == 7 and {"timestampNtz", "invariants"} <= set(protocol.writer_features)
    # A table an older oncemore left without it gets it at the next run's check.
    DeltaTable.create(str(tmp_path / "old"), schema)
    assert "invariants" not in DeltaTable(str(tmp_path / "old")).protocol().writer_features
    ensure_table(str(tmp_path / "old"), schema, (), "old", "made by an older oncemore")
    assert "invariants" in DeltaTable(str(tmp_path / "old")).protocol().writer_features


def test_delta_spark_reads_every_kind_of_table_as_duckdb_does(broker, topic, make_pipeline, delta):
    broker.produce(topic, [(i % 3, str(i).encode(), rich(i), None) for i in range(90)]
                   + [(0, b"bad", b"{not json", None), (1, b"bad", b'{"id": "x"}', None)])
    config = {"format": {"type": "json", "schema": RICH}, "sink": {"partition_by": ["region"]}}
    ingest(make_pipeline(topic, **config), delta)
    # The schema evolves: a column added, the table's older files without it.
    broker.produce(topic, [(i % 3, str(i).encode(), rich(i, evolved=True), None) for i in range(90, 120)])
    evolved = make_pipeline(topic, **{**config, "format": {"type": "json", "schema": RICH + ", note STRING"}})
    ingest(evolved, delta)

    main, quarantine = evolved.sink.table_uri, evolved.sink.quarantine_uri
    spark_rows, duckdb_rows = both_readers(delta, main)
    assert spark_rows == duckdb_rows
    assert len(spark_rows) == 120 and sum(r["note"] is not None for r in spark_rows.values()) == 30
    one = next(r for r in spark_rows.values() if r["id"] == 13)
    assert one["amount"] == Decimal("94.25") and one["at"] == datetime.datetime(2026, 11, 14, 13, 15, 30, 123456)
    assert one["local_at"] == datetime.datetime(2026, 6, 1, 13) and one["tags"] == {"a": 13, "b": None}
    assert one["items"] == [{"sku": "s13", "qty": 3}, {"sku": None, "qty": None}] and one["region"] == "us: east"
    for region, count in (("eu", 40), ("us: east", 40), ("a%b=c/d#é", 40)):  # partition pruning, escaped paths
        assert delta.sql(f"SELECT count(*) FROM delta.`{main}` WHERE region = '{region}'").first()[0] == count
    spark_bad, duckdb_bad = both_readers(delta, quarantine)
    assert spark_bad == duckdb_bad and len(spark_bad) == 2
    assert_exactly_once(spark_pairs(delta, main) + spark_pairs(delta, quarantine),
                        read_pairs(main) + read_pairs(quarantine))


# --- maintenance and a downstream stream ----------------------------------------------------------

def test_optimize_vacuum_and_checkpoints_by_delta_spark_beside_ingestion(broker, topic, make_pipeline, delta,
                                                                      delta_server):
    from pyspark.sql import SparkSession

    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 60})
    path = pipeline.sink.table_uri
    produced = broker.produce(topic, orders(0, 120))
    ingest(pipeline, delta)
    other = SparkSession.builder.remote(delta_server.url).create()  # the Spark user's own session
    other.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    failures, done = [], threading.Event()

    def optimize_meanwhile():  # twice at most: on one core each OPTIMIZE holds the runs back
        try:
            for _ in range(2):
                if not done.wait(1):
                    other.sql(f"OPTIMIZE delta.`{path}` ZORDER BY (id)").collect()
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            failures.append(exc)

    optimizer = threading.Thread(target=optimize_meanwhile)
    optimizer.start()
    try:
        for start in (120, 240, 360):
            produced += broker.produce(topic, orders(start, 120))
            ingest(pipeline, delta)
    finally:
        done.set()
        optimizer.join()
    assert not failures, failures
    # Checkpoints written by delta-spark: every commit of its from now on writes one.
    other.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.checkpointInterval' = '1')")
    vacuumed = other.sql(f"VACUUM delta.`{path}` LITE RETAIN 0 HOURS").collect()
    other.stop()

    log = Path(path, "_delta_log")
    newest = json.loads((log / "_last_checkpoint").read_text())["version"]
    assert newest == DeltaTable(path).version()
    assert "parquet-mr" in pq.ParquetFile(log / f"{newest:020d}.checkpoint.parquet").metadata.created_by
    assert vacuumed and len(DeltaTable(path).file_uris()) == len(list(Path(path).glob("*.parquet")))
    # The positions come from delta-spark's checkpoint: a rerun finds nothing to do.
    assert held_positions(path, "orders", topic) == {0: 160, 1: 160, 2: 160}
    assert ingest(pipeline, delta).written == 0
    produced += broker.produce(topic, orders(480, 30))
    ingest(pipeline, delta)

    assert_exactly_once(read_pairs(path), produced)
    assert_exactly_once(spark_pairs(delta, path), produced)
    report = verify(pipeline, lambda: delta)
    assert report.ok, report.describe()


def test_a_downstream_delta_stream_sees_every_committed_row_once(broker, topic, make_pipeline, delta, tmp_path):
    pipeline = make_pipeline(topic)
    bronze, silver = pipeline.sink.table_uri, str(tmp_path / "silver")
    produced = []

    def silver_job() -> None:  # bronze to silver, as a Spark user schedules one after each ingestion
        query = (delta.readStream.format("delta").load(bronze).where("amount >= 0")
                 .writeStream.format("delta").option("checkpointLocation", str(tmp_path / "silver_checkpoint"))
                 .trigger(availableNow=True).start(silver))
        query.awaitTermination()

    for round_ in range(3):
        produced += broker.produce(topic, orders(100 * round_, 100))
        ingest(pipeline, delta)
        if round_ == 1:  # compaction rewrites bronze's files (dataChange false): no row is streamed again
            delta.sql(f"OPTIMIZE delta.`{bronze}`").collect()
        silver_job()
    silver_job()  # nothing new

    assert_exactly_once(read_pairs(silver), produced)
    assert_exactly_once(spark_pairs(delta, silver), produced)


def test_positions_delta_spark_expired_and_cleaned_up_are_refused_never_read_again(broker, topic, make_pipeline, delta):
    """delta#1167: delta-spark leaves the txn actions older than delta.setTransactionRetentionDuration out
    of its snapshots, so out of the checkpoints it writes, and its log cleanup deletes the commit files
    older than delta.logRetentionDuration. Positions gone either way are never taken for a new table's:
    a rerun, and a rerun of the first run's plan (an old task of Airflow's run again), are refused and
    add no row; the reset the error names continues exactly once."""
    pipeline = make_pipeline(topic)
    path = pipeline.sink.table_uri
    produced = broker.produce(topic, orders(0, 90))
    handed = plan_run(pipeline)  # built on no position, as Airflow's plan task hands it to the run
    runner.run(pipeline, plan=handed, spark_factory=lambda: delta)
    produced += broker.produce(topic, orders(90, 30))
    ingest(pipeline, delta)
    assert held_positions(path, "orders", topic) == {0: 40, 1: 40, 2: 40}
    time.sleep(2)  # the positions' lastUpdated is older than the retention set next
    # Every commit of delta-spark's from here on writes a checkpoint of its snapshot.
    delta.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.setTransactionRetentionDuration' = "
              "'interval 1 seconds', 'delta.checkpointInterval' = '1')")
    # A longer retention brings nothing back: the checkpoint left the positions out.
    delta.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.setTransactionRetentionDuration' = 'interval 30 days')")
    assert held_positions(path, "orders", topic) == {0: None, 1: None, 2: None}
    more = broker.produce(topic, orders(120, 30))

    def refused() -> str:
        said = []
        for plan in (None, handed):
            with pytest.raises(PositionsMissing) as missing:
                runner.run(pipeline, plan=plan, spark_factory=lambda: delta)
            said.append(str(missing.value))
        assert_exactly_once(read_pairs(path), produced)  # nothing read again
        return said[0]

    hint = json.dumps({topic: {"0": 40, "1": 40, "2": 40}}, sort_keys=True)
    assert f"left positions at {hint}" in refused()
    # Log cleanup: its cut-off is a day boundary, so the commit files are dated back first.
    log = Path(path, "_delta_log")
    past = time.time() - 3 * 86_400
    for old in [*log.glob("*.json"), *log.glob("*.checkpoint.parquet")]:
        os.utime(old, (past, past))
    delta.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.logRetentionDuration' = 'interval 1 days', "
              "'delta.deletedFileRetentionDuration' = 'interval 1 days')")  # at most the log's, delta-spark requires
    assert not (log / f"{1:020d}.json").exists(), "delta-spark cleaned up the log"
    said = refused()
    assert "its log no longer keeps the commits before version" in said and f"Its rows reach offsets {hint}" in said

    reset(pipeline, OffsetBound.parse(hint))
    ingest(pipeline, delta)
    assert_exactly_once(read_pairs(path), produced + more)
    assert_exactly_once(spark_pairs(delta, path), produced + more)
    report = verify(pipeline, lambda: delta)
    assert report.ok, report.describe()


# --- features a delta-spark user may turn on ----------------------------------------------------------

# Each feature as delta-spark turns it on over a table oncemore wrote, and whether oncemore goes on
# ingesting (read back by delta-spark) or refuses before writing, naming it.
FEATURES = {
    "deletion vectors": ("SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')", None),
    "change data feed": ("SET TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')", None),
    "append-only": ("SET TBLPROPERTIES ('delta.appendOnly' = 'true')", None),
    "v2 checkpoints": ("SET TBLPROPERTIES ('delta.checkpointPolicy' = 'v2')", None),
    "column mapping": ("SET TBLPROPERTIES ('delta.columnMapping.mode' = 'name')", "column mapping (mode name)"),
    "row tracking": ("SET TBLPROPERTIES ('delta.enableRowTracking' = 'true')", "row tracking (writer feature rowTracking)"),
    "liquid clustering": ("CLUSTER BY (id)", "liquid clustering (writer feature clustering)"),
    "in-commit timestamps": ("SET TBLPROPERTIES ('delta.enableInCommitTimestamps' = 'true')",
                             "in-commit timestamps (writer feature inCommitTimestamp)"),
    "CHECK constraint": ("ADD CONSTRAINT known_id CHECK (id >= 0)", "CHECK constraint known_id (id >= 0)"),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_a_feature_turned_on_by_delta_spark_is_honoured_or_refused_by_name(broker, topic, make_pipeline, delta,
                                                                          feature):
    statement, refusal = FEATURES[feature]
    pipeline = make_pipeline(topic)
    path = pipeline.sink.table_uri
    produced = broker.produce(topic, orders(0, 60))
    ingest(pipeline, delta)
    delta.sql(f"ALTER TABLE delta.`{path}` {statement}")
    version, positions = DeltaTable(path).version(), held_positions(path, "orders", topic)
    more = broker.produce(topic, orders(60, 60))

    if refusal:
        with pytest.raises(UnsupportedTable) as refused:
            ingest(pipeline, delta)
        message = str(refused.value)
        assert "\n" not in message and f"table {path} asks its writers" in message and refusal in message, message
        assert DeltaTable(path).version() == version and held_positions(path, "orders", topic) == positions
        return
    report = ingest(pipeline, delta)
    assert report.written == 60
    assert_exactly_once(spark_pairs(delta, path), produced + more)
    if feature == "change data feed":  # delta-spark's change feed holds oncemore's rows as inserts
        changes = delta.sql(f"SELECT _kafka_partition, _kafka_offset, _change_type FROM "
                            f"table_changes_by_path('{path}', {version + 1})").collect()
        assert sorted((r[0], r[1]) for r in changes) == sorted(more) and {r[2] for r in changes} == {"insert"}
    if feature == "append-only":  # a deletion would break the table's promise: refused before either table
        with pytest.raises(DeleteRefused, match=f"table {path} is append-only"):
            delete(pipeline, "id = 7")
    if feature == "v2 checkpoints":  # oncemore's maintenance writes a V2-spec checkpoint delta-spark reads
        maintain(pipeline)
        assert delta.sql(f"SELECT count(*) FROM delta.`{path}`").first()[0] == 120
    assert verify(pipeline, lambda: delta).ok


def test_a_generated_column_is_refused_before_anything_is_created(broker, topic, make_pipeline, delta):
    pipeline = make_pipeline(topic)
    path = pipeline.sink.table_uri
    delta.sql(f"CREATE TABLE delta.`{path}` (id BIGINT, amount DOUBLE, doubled DOUBLE GENERATED ALWAYS AS (amount * 2)) USING delta")
    broker.produce(topic, orders(0, 30))

    with pytest.raises(UnsupportedTable, match=f"table {path} asks its writers for what oncemore does not do: "
                                               "generated column doubled"):
        ingest(pipeline, delta)
    assert DeltaTable(path).version() == 0 and not Path(pipeline.sink.quarantine_uri).exists()


# --- deletions -------------------------------------------------------------------------------------

def test_rows_deleted_by_delta_spark_are_named_by_verify_and_ingestion_goes_on(broker, topic, make_pipeline, delta):
    pipeline = make_pipeline(topic)
    path = pipeline.sink.table_uri
    produced = broker.produce(topic, orders(0, 300))
    ingest(pipeline, delta)
    assert verify(pipeline, lambda: delta).ok  # deletion vectors on, none written yet
    delta.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    # Rows of one commit in two partitions: verify names each partition's own offsets.
    assert delta.sql(f"DELETE FROM delta.`{path}` WHERE (_kafka_partition = 2 AND _kafka_offset IN (7, 8)) "
                     "OR (_kafka_partition = 1 AND _kafka_offset = 8)").first()[0] == 3
    deleted_at = DeltaTable(path).version()
    assert DeltaTable(path).deletion_vectors().read_all().num_rows >= 1  # the rows are masked, their files kept

    more = broker.produce(topic, orders(300, 300))
    ingest(pipeline, delta)

    kept = sorted(set(produced + more) - {(2, 7), (2, 8), (1, 8)})
    assert_exactly_once(spark_pairs(delta, path), kept)
    assert_exactly_once(read_pairs(path), kept)
    report = verify(pipeline, lambda: delta)
    assert not report.ok and set(report.counts) == {"count"}, report.describe()
    assert [(d.topic, d.partition, d.detail.split(f"version(s) {deleted_at} (DELETE): ")[-1])
            for d in report.discrepancies] == [
        (topic, 1, f"offset(s) 8 of {topic}/1 are in Kafka and in neither table"),
        (topic, 2, f"offset(s) 7, 8 of {topic}/2 are in Kafka and in neither table")], report.describe()


def test_a_file_delta_spark_wrote_under_a_non_ascii_partition_is_never_removed_by_delta_rs_until_rewritten(
        broker, topic, make_pipeline, delta):
    """delta-spark spells such a path raw in its log (customer=é), delta-rs spells a remove's
    customer=%C3%A9: its delete, compaction and MERGE left the file live beside its rewrite, and
    said they had removed it (delta-kernel-rs issue 2423). oncemore refuses them, naming the file;
    delta-spark's rewrite under random prefixes (the way out the refusal names) lets them go on."""
    from oncemore.commit.removable import UnremovableFile, unremovable

    produced = broker.produce(topic, [(i % 3, str(i).encode(), json.dumps(
        {"id": i, "customer": "é" if i % 2 else "e", "amount": 1.0}).encode(), None) for i in range(40)])
    pipeline = make_pipeline(topic, sink={"partition_by": ["customer"]})
    path = pipeline.sink.table_uri
    ingest(pipeline, delta)
    delta.sql(f"OPTIMIZE delta.`{path}` WHERE customer = 'é' ZORDER BY (id)").collect()
    assert [add["path"].split("/")[0] for add in unremovable(DeltaTable(path))] == ["customer=é"]
    ids = {(i % 3, i // 3): i for i in range(40)}  # record i at partition i % 3, offset i // 3 (a new topic)
    assert set(ids) == set(produced)

    with pytest.raises(UnremovableFile, match=r"^pipeline orders: delete --where .* file customer=é/.* holds a "
                                              r"matched row.*nothing was deleted from it.*randomizeFilePrefixes"):
        delete(pipeline, "customer = 'é' AND id < 10")
    assert delete(pipeline, "customer = 'e' AND id < 10")["tables"]["main"]["rows"] == 5  # delta-rs's own files
    with pytest.raises(UnremovableFile, match=r"^pipeline orders: maintain: main table .*: file customer=é/.*"
                                              r"checkpointed and vacuumed only .*randomizeFilePrefixes"):
        maintain(pipeline)
    kept = [pair for pair in produced if not (ids[pair] < 10 and ids[pair] % 2 == 0)]
    assert_exactly_once(read_pairs(path), kept)
    assert_exactly_once(spark_pairs(delta, path), kept)

    delta.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.randomizeFilePrefixes' = 'true')")
    delta.sql(f"OPTIMIZE delta.`{path}` WHERE customer = 'é' ZORDER BY (id)").collect()
    assert unremovable(DeltaTable(path)) == []
    assert maintain(pipeline)["tables"]["main"]["status"] == "maintained"
    assert delete(pipeline, "customer = 'é' AND id < 10")["tables"]["main"]["rows"] == 5
    kept = [pair for pair in kept if ids[pair] >= 10]
    assert_exactly_once(read_pairs(path), kept)
    assert_exactly_once(spark_pairs(delta, path), kept)


def test_an_upsert_merged_on_the_cluster_through_spark_connect_lands_the_fold(broker, topic, make_pipeline, delta):
    """upsert.merge cluster's rewrite job (spark.range + mapInArrow) on a Connect session, as on a
    classic one; delta-spark reads the table it commits with one row per key."""
    from devtools.changefeed import debezium_events, fold, produce, read_back, table_state

    events = debezium_events(keys=40, changes=300, seed=7)
    pipeline = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                             format={"type": "json", "schema": "id BIGINT, name STRING, balance BIGINT"},
                             upsert={"keys": ["id"], "envelope": "debezium", "merge": "cluster"})
    path = pipeline.sink.table_uri
    produce(broker.bootstrap_servers, topic, events[:200], "key")
    ingest(pipeline, delta)
    produce(broker.bootstrap_servers, topic, events[200:], "key")
    report = ingest(pipeline, delta)
    assert report.batches[0].status == "committed" and report.batches[0].events["updated"] > 0
    version = DeltaTable(path).version()  # the copy-on-write's one commit: the touched files' removes
    actions = [json.loads(line) for line in Path(path, "_delta_log", f"{version:020d}.json").read_text().splitlines()]
    assert DeltaTable(path).history(1)[0]["operation"] == "WRITE" and any("remove" in a for a in actions)
    expected = fold(read_back(broker.bootstrap_servers, topic), "debezium", ("id",))
    found = table_state(path, ("id",))
    assert set(found) == set(expected)
    assert all({c: found[key][c] for c in row} == row for key, row in expected.items())
    ids = [r[0] for r in delta.sql(f"SELECT id FROM delta.`{path}`").collect()]
    assert sorted(ids) == sorted(key[0] for key in expected)
