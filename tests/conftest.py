"""Fixtures: a real broker, a real local Spark, real Delta tables on disk or on a local S3 API
server (moto), and an independent reader.

The broker is Apache Kafka (devtools.kafkabroker.start_kafka, from the jars scripts/setup brings),
one per test session (per xdist worker), each test on topics of its own;
ONCEMORE_TEST_BOOTSTRAP points the suite at an external Kafka cluster instead. Tests that need a
broker of their own (SASL, restarts, a second cluster) start one with ``own_broker``.
"""

from __future__ import annotations

import gc
import glob
import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Sequence

import duckdb
import duckdb_extension_delta
import pyarrow as pa
import pytest
import yaml
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient
from deltalake import DeltaTable

from devtools import kafkabroker
from oncemore.commit.groupmirror import group_id
from oncemore.config.loading import load_pipeline
from oncemore.config.model import Pipeline
from oncemore.core.coordinates import KafkaPartition
from oncemore.plan.commitinfo import METADATA_KEY, CommitInfo
from oncemore.plan.ledger import Ledger

ROOT = Path(__file__).resolve().parents[1]
EXTERNAL_BOOTSTRAP = os.environ.get("ONCEMORE_TEST_BOOTSTRAP")
# py4j logs at INFO while the interpreter shuts down, after pytest closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)


def pytest_sessionstart(session):
    if not EXTERNAL_BOOTSTRAP:
        try:
            kafkabroker.kafka_jars_dir()
        except FileNotFoundError as exc:
            pytest.exit(f"no Kafka broker for the tests: {exc} (scripts/test does; it needs Java 17 and Maven), or "
                        "point the suite at a Kafka cluster with ONCEMORE_TEST_BOOTSTRAP=host:port.",
                        returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(scope="session")
def broker():
    if EXTERNAL_BOOTSTRAP:
        yield kafkabroker.DevBroker(EXTERNAL_BOOTSTRAP)
        return
    with kafkabroker.running(kafkabroker.start_kafka()) as local:
        yield local
        # Destroy lingering client handles first, or their reconnect errors print after pytest's summary.
        gc.collect()


@pytest.fixture
def own_broker(tmp_path):
    """A Kafka broker of this test's own, persisted under tmp_path (restartable); arguments as
    kafkabroker.start_kafka's."""
    started = []

    def start(**kwargs) -> kafkabroker.DevBroker:
        kwargs.setdefault("data_dir", str(tmp_path / f"broker-{len(started)}"))
        started.append(kafkabroker.start_kafka(**kwargs))
        return started[-1]

    yield start
    for local in started:
        local.stop()
    gc.collect()


@pytest.fixture(scope="session")
def s3_server():
    """A local S3 API server (moto) for the session, stopped with it."""
    from devtools.s3server import start_s3_server

    server = start_s3_server()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket per test: ``s3://<bucket>``."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    return f"s3://{bucket}"


@pytest.fixture(scope="session")
def hive_metastore(tmp_path_factory):
    """A Hive Metastore (devtools.hivemetastore: Apache Hive's standalone server on Derby) for the session."""
    from devtools.hivemetastore import start_metastore

    metastore = start_metastore(data_dir=tmp_path_factory.mktemp("metastore"))
    yield metastore
    metastore.stop()


def hive_table(metastore, database: str, name: str):
    """The table as the metastore holds it (its Thrift object)."""
    from pymetastore.hive_metastore import ThriftHiveMetastore
    from pymetastore.hive_metastore.ttypes import GetTableRequest
    from thrift.protocol.TBinaryProtocol import TBinaryProtocol
    from thrift.transport import TSocket, TTransport

    transport = TTransport.TBufferedTransport(TSocket.TSocket("127.0.0.1", metastore.port))
    transport.open()
    try:
        return ThriftHiveMetastore.Client(TBinaryProtocol(transport)).get_table_req(
            GetTableRequest(dbName=database, tblName=name)).table
    finally:
        transport.close()


@pytest.fixture(scope="session")
def spark():
    from oncemore.run.session import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """A Spark Connect server (devtools.sparkconnect) for the session; a test may restart or kill it
    and leaves it running."""
    from devtools.sparkconnect import start_connect_server

    server = start_connect_server("local[2]", log_dir=str(tmp_path_factory.mktemp("connect")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def delta_server(tmp_path_factory):
    """A Spark Connect server with the Spark packages a Spark user adds (devtools.sparkjars: delta-spark,
    spark-avro, the Kafka source), on one core, for the worker's modules that play a Spark user."""
    from devtools.sparkjars import start_delta_connect_server

    server = start_delta_connect_server("local[1]", log_dir=str(tmp_path_factory.mktemp("delta-connect")),
                                        conf={"spark.sql.shuffle.partitions": "2", "spark.sql.session.timeZone": "UTC"})
    yield server
    server.stop()


@pytest.fixture
def connect_session(connect_server):
    """``connect_session()`` opens a session on the Connect server. PySpark marks a process that
    opened one as Connect-only (SPARK_CONNECT_MODE_ENABLED, which also steers pyspark.sql.functions
    and every later session builder); at the end the sessions are stopped and the mark removed, so
    the other tests' classic session works again."""
    from oncemore.run.session import spark_session, stop_session

    opened = []

    def open_session():
        opened.append(spark_session(remote=connect_server.url))
        return opened[-1]

    yield open_session
    for session in opened:
        try:
            stop_session(session)
        except Exception:  # a session of a server the test killed
            pass
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)


@pytest.fixture
def topic(broker):
    """A fresh 3-partition topic per test."""
    name = f"t_{uuid.uuid4().hex[:10]}"
    broker.create_topic(name, 3)
    return name


@pytest.fixture
def make_pipeline(tmp_path, broker):
    """Writes a pipeline YAML into a temporary pipelines dir and loads it like a user's would be."""

    def make(topic: str, name: str = "orders", **overrides) -> Pipeline:
        config = {
            "name": name,
            "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": topic, "stall_timeout_seconds": 20},
            "sink": {"table_uri": str(tmp_path / "delta" / name), "quarantine_uri": str(tmp_path / "delta" / f"{name}_quarantine")},
            "format": {"type": "json", "schema": "id BIGINT, customer STRING, amount DOUBLE"},
        }
        for key, value in overrides.items():
            if key in ("source", "sink"):  # merged; other sections replace
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        directory = tmp_path / "pipelines"
        directory.mkdir(exist_ok=True)
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return load_pipeline(path)

    return make


def allow_any_timestamp(broker, topic: str) -> None:
    """Lets ``topic`` take records stamped at any time: Kafka 4 refuses a record stamped more than
    an hour ahead of its clock (INVALID_TIMESTAMP) unless the topic's message.timestamp.after.max.ms
    allows it, as a topic of far-future or mis-scaled timestamps must."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    entry = ConfigEntry("message.timestamp.after.max.ms", str(2**63 - 1), incremental_operation=AlterConfigOpType.SET)
    for done in broker.admin().incremental_alter_configs(
            [ConfigResource("topic", topic, incremental_configs=[entry])]).values():
        done.result(timeout=30)


def held_positions(table_uri: str, pipeline: str, topic: str, partitions=(0, 1, 2)) -> dict[int, int | None]:
    """A pipeline's positions for one topic in a table, by partition number."""
    found = Ledger(table_uri, pipeline).positions(KafkaPartition(topic, p) for p in partitions)
    return {key.partition: value for key, value in found.items()}


def keyed(topic: str, values: dict[int, object]) -> dict[KafkaPartition, object]:
    """Values by partition number of ``topic``, keyed as oncemore keys them."""
    return {KafkaPartition(topic, p): v for p, v in values.items()}


def order(i: int) -> bytes:
    return json.dumps({"id": i, "customer": f"customer-{i % 97}", "amount": round(i * 1.25, 2)}).encode()


def orders(start: int, count: int, partitions: int = 3) -> list[tuple[int, bytes, bytes, None]]:
    return [(i % partitions, str(i).encode(), order(i), None) for i in range(start, start + count)]


def by_partition(pairs: list[tuple[int, int]]) -> dict[int, list[int]]:
    """The offsets of (partition, offset) pairs, per partition, in order."""
    found: dict[int, list[int]] = {}
    for partition, offset in sorted(pairs):
        found.setdefault(partition, []).append(offset)
    return found


def duckdb_connection() -> duckdb.DuckDBPyConnection:
    """DuckDB with its Delta reader loaded from the wheel (no download)."""
    extension = glob.glob(str(Path(duckdb_extension_delta.__file__).parent / "extensions" / "*" / "delta.duckdb_extension"))[0]
    connection = duckdb.connect(config={"allow_unsigned_extensions": "true"})
    connection.execute(f"LOAD '{extension}'")
    return connection


def read_pairs(table_uri: str) -> list[tuple[int, int]]:
    """Every (partition, offset) in the table, read by DuckDB's Delta reader (not delta-rs)."""
    if not Path(table_uri, "_delta_log").exists():
        return []
    rows = duckdb_connection().execute(
        f"SELECT _kafka_partition, _kafka_offset FROM delta_scan('{table_uri}')"
    ).fetchall()
    return sorted(rows)


def query(table_uri: str, sql: str) -> list[tuple]:
    """Runs ``sql`` with ``{table}`` standing for the Delta table, through DuckDB."""
    return duckdb_connection().execute(sql.format(table=f"delta_scan('{table_uri}')")).fetchall()


def assert_exactly_once(pairs: list[tuple[int, int]], expected: list[tuple[int, int]]) -> None:
    """Counts: no (partition, offset) twice, none missing, none outside the expected set."""
    duplicates = len(pairs) - len(set(pairs))
    assert duplicates == 0, f"{duplicates} duplicated (partition, offset) pairs"
    missing = set(expected) - set(pairs)
    extra = set(pairs) - set(expected)
    assert not missing, f"{len(missing)} records missing, e.g. {sorted(missing)[:5]}"
    assert not extra, f"{len(extra)} records outside the committed ranges, e.g. {sorted(extra)[:5]}"
    assert len(pairs) == len(expected)


def read_coordinates(table_uri: str) -> list[tuple[str, int, int]]:
    """Every (topic, partition, offset) in the table, read by DuckDB's Delta reader."""
    if not Path(table_uri, "_delta_log").exists():
        return []
    return sorted(duckdb_connection().execute(
        f"SELECT _kafka_topic, _kafka_partition, _kafka_offset FROM delta_scan('{table_uri}')").fetchall())


def produced_coordinates(topic: str, pairs: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
    return [(topic, p, o) for p, o in pairs]


def oncemore_command(pipeline: Pipeline, command: str = "run", fault: str | None = None,
                     whole_run: bool = True, args: Sequence[str] = ()) -> subprocess.Popen:
    """``oncemore COMMAND --config`` of ``pipeline`` (and ``args``) started in its own process on
    ``local[1]``; with ``fault``, dying at that core/crashpoints.py step: the whole run (its own
    process group), or with ``whole_run=False`` only the process reaching it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEMORE_FAULTS")}
    env.update(PYTHONPATH=str(ROOT / "include"), ONCEMORE_SPARK_MASTER="local[1]", **({"ONCEMORE_FAULTS": fault} if fault else {}))
    return subprocess.Popen([sys.executable, "-m", "oncemore.cli", command, "--config", pipeline.origin, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=whole_run)


def run_with_fault(pipeline: Pipeline, fault: str, whole_run: bool = True) -> subprocess.CompletedProcess:
    """``oncemore run`` of ``pipeline`` dying at the core/crashpoints.py step ``fault`` (oncemore_command)."""
    process = oncemore_command(pipeline, "run", fault, whole_run)
    out, err = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.fixture
def crash_before_main_commit(monkeypatch):
    """``crash_before_main_commit(pipeline, spark)`` runs the pipeline, which dies (SystemExit)
    right after a part's quarantine commit, before its main commit."""
    from oncemore.commit import part
    from oncemore.run import runner

    real_commit = part.commit

    def run(pipeline: Pipeline, spark) -> None:
        def crash_on_main(ledger, *args, **kwargs):
            if ledger.table_uri == pipeline.sink.table_uri:
                raise SystemExit("injected crash after the quarantine commit")
            return real_commit(ledger, *args, **kwargs)

        monkeypatch.setattr(part, "commit", crash_on_main)
        with pytest.raises(SystemExit):
            runner.run(pipeline, spark_factory=lambda: spark)
        monkeypatch.undo()

    return run


@pytest.fixture(scope="session")
def registry():
    """Apicurio Registry (devtools.schemaregistry), Confluent-compatible over HTTP, for the session."""
    from devtools.schemaregistry import start_registry

    local = start_registry()
    yield local
    local.stop()


def decode_in_child(settings: dict, kind: str, reader: tuple[str, int | str], values: list[bytes | None]):
    """Runs in a spawned process: decodes ``values`` of ``kind`` (avro, or protobuf's first
    message) into the registry's (subject, version), with nothing inherited, as a Spark worker."""
    from oncemore.decode.avro.decoder import AvroDecoder
    from oncemore.decode.decoder import SchemaAhead
    from oncemore.decode.protobuf.decoder import ProtobufDecoder
    from oncemore.decode.registry import Registry, RegistryError

    registry = Registry(settings)
    subject, version = reader
    fmt = "serialized" if kind == "protobuf" else None
    try:
        found = registry.latest(subject, fmt=fmt) if version == "latest" else registry.version(subject, version, fmt=fmt)
        decoder = (AvroDecoder(registry, found.schema) if kind == "avro"
                   else ProtobufDecoder(registry, found.schema, "shop.Order"))
        decoded = decoder.decode(pa.array(values, pa.binary()))
    except SchemaAhead as ahead:  # its constructor's arguments are not its args: it does not pickle
        return "ahead", ahead.index, ahead.schema_id, str(ahead)
    except RegistryError as exc:
        return "registry", str(exc)
    return "decoded", decoded.table, decoded.errors


@pytest.fixture(scope="session")
def spawned():
    """Runs a function in another Python process (spawned: nothing inherited, as a Spark worker)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda function, *args: pool.submit(function, *args).result()


def oncemore(*args: str, env: dict | None = None, check_no_spark: bool = False) -> subprocess.CompletedProcess:
    code = "import sys; from oncemore.cli import main; rc = main(sys.argv[1:]); "
    if check_no_spark:
        code += "assert 'pyspark' not in sys.modules, 'Spark was imported'; "
    code += "sys.exit(rc)"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "include"), "ONCEMORE_SPARK_MASTER": "local[2]", **(env or {})})


def process_list_watcher(secrets: list[str], found: list[str]) -> threading.Event:
    """Samples every process's command line until the returned event is set; lines holding one of
    ``secrets`` go to ``found``."""
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
            found.extend(line for line in listing.splitlines() if any(secret in line for secret in secrets))
            stop.wait(0.2)

    threading.Thread(target=watch, daemon=True).start()
    return stop


def oncemore_commits(table_uri: str) -> list[tuple[int, CommitInfo]]:
    commits = [c for c in DeltaTable(table_uri).history() if METADATA_KEY in c]
    return sorted(((c["version"], CommitInfo.from_json(c[METADATA_KEY])) for c in commits), key=lambda c: c[0])


def committed_offsets(broker, pipeline) -> dict[int, int]:
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    request = ConsumerGroupTopicPartitions(group_id(pipeline), [TopicPartition(pipeline.source.topic, p) for p in (0, 1, 2)])
    (future,) = admin.list_consumer_group_offsets([request]).values()
    return {tp.partition: tp.offset for tp in future.result(timeout=30).topic_partitions}
