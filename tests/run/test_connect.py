"""Runs on a resident Spark through Spark Connect (devtools.sparkconnect's server from the pip
PySpark): the records are read, decoded and written by the server's workers, the positions are
re-checked right before the one Delta commit, and exactly-once is counted by (partition, offset)
across a server restarted between runs and a server that dies mid-run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import assert_exactly_once, held_positions, orders, read_pairs
from oncemore.core.errors import TaskFailed
from oncemore.run import jobs, runner

pytestmark = pytest.mark.spark

INCLUDE = str(Path(__file__).resolve().parents[2] / "include")


def malformed_every(produced: list[tuple[int, bytes, bytes, None]], step: int):
    return [(p, k, b"{not json" if i % step == 0 else v, h) for i, (p, k, v, h) in enumerate(produced)]


def cluster_jobs(server) -> int:
    """How many mapInArrow jobs (an upsert MERGE's key scan or rewrite, run/rewritejob.py) the
    server's event log has recorded."""
    recorded = "".join(path.read_text(errors="replace") for path in server.event_dir.rglob("*") if path.is_file())
    return recorded.count('function_name: \\"each\\"')


def test_spark_remote_in_the_environment_runs_the_cli_on_the_server_exactly_once(
        broker, topic, make_pipeline, connect_server):
    produced = broker.produce(topic, malformed_every(orders(0, 3_000), 7))
    # An option librdkafka ignores without SSL, a secret: it must not reach what the server records
    # of the session's statements (its event log, its UI), where the ingest job's tasks are named.
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 1_200},
                             source={"kafka_options": {"ssl.key.password": "hunter2-never-shown"}})
    # A master nobody listens on: a run that ignored SPARK_REMOTE would fail.
    env = {**os.environ, "PYTHONPATH": INCLUDE, "SPARK_REMOTE": connect_server.url,
           "ONCEMORE_SPARK_MASTER": "spark://127.0.0.1:9"}

    done = subprocess.run([sys.executable, "-m", "oncemore.cli", "run", "--config", pipeline.origin],
                          env=env, capture_output=True, text=True, timeout=600)

    assert done.returncode == 0, done.stderr[-3000:]
    assert "committed" in done.stdout
    main, quarantined = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    assert len(quarantined) == len(range(0, 3_000, 7))
    assert_exactly_once(main + quarantined, produced)
    recorded = "".join(path.read_text(errors="replace") for path in connect_server.event_dir.rglob("*")
                       if path.is_file())
    assert "ConnectOperationStarted" in recorded and 'function_name: \\"IngestTasks\\"' in recorded
    assert "hunter2" not in recorded


def test_the_clients_debug_log_shows_no_credential_of_a_merge_on_the_cluster(
        broker, topic, make_pipeline, connect_server, s3_server, s3_bucket, tmp_path, monkeypatch):
    """SPARK_CONNECT_LOG_LEVEL=debug: PySpark's Connect client logs each request in full, the data
    source options (a Kafka password) and the closure of the cluster MERGE's tasks (the object
    store's secret key) unmasked; oncemore logs that client at INFO, and says so."""
    from devtools.changefeed import debezium_events, produce

    s3_secret, kafka_secret = f"s3-{uuid.uuid4().hex}", f"kafka-{uuid.uuid4().hex}"
    monkeypatch.setenv("ONCEMORE_TEST_KEY_PASSWORD", kafka_secret)
    monkeypatch.setenv("ONCEMORE_TEST_S3_SECRET", s3_secret)
    produce(broker.bootstrap_servers, topic, debezium_events(keys=30, changes=60, seed=3), "key")
    pipeline = make_pipeline(
        topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
        format={"type": "json", "schema": "id BIGINT, name STRING, balance BIGINT"},
        upsert={"keys": ["id"], "envelope": "debezium", "merge": "cluster"},
        source={"kafka_options": {"ssl.key.password": "${ONCEMORE_TEST_KEY_PASSWORD}"}},
        sink={"table_uri": f"{s3_bucket}/accounts", "quarantine_uri": f"{s3_bucket}/accounts_quarantine",
              "storage_options": {**s3_server.storage_options(), "AWS_SECRET_ACCESS_KEY": "${ONCEMORE_TEST_S3_SECRET}"}})
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": INCLUDE, "SPARK_REMOTE": connect_server.url, "SPARK_CONNECT_LOG_LEVEL": "debug",
           "TMPDIR": str(tmp_path / "tmp"), "XDG_CACHE_HOME": str(tmp_path / "cache")}

    merges_before = cluster_jobs(connect_server)

    done = subprocess.run([sys.executable, "-m", "oncemore.cli", "run", "--config", pipeline.origin],
                          env=env, capture_output=True, text=True, timeout=600)

    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"accounts: committed 1 batch\(es\), \d+ inserted", done.stdout), done.stdout
    assert cluster_jobs(connect_server) > merges_before  # the MERGE's tasks ran on the server
    files = [path for path in (tmp_path / "tmp").rglob("*") if path.is_file()]  # Spark's output of the run
    for text in [done.stdout, done.stderr, *(path.read_text(errors="replace") for path in files)]:
        assert s3_secret not in text and kafka_secret not in text
    assert "SPARK_CONNECT_LOG_LEVEL=debug" in done.stderr  # the cap is said


def test_a_transform_runs_on_the_server_and_its_part_commits_in_the_client(broker, topic, make_pipeline,
                                                                             connect_session):
    produced = broker.produce(topic, malformed_every(orders(0, 900), 5))
    pipeline = make_pipeline(topic, transform="SELECT * FROM records WHERE id % 3 <> 0")
    session = connect_session()
    report = runner.run(pipeline, spark_factory=lambda: session)

    bad = {i for i in range(900) if i % 5 == 0}
    filtered = {i for i in range(900) if i % 3 == 0 and i not in bad}
    assert (report.written, report.quarantined) == (900 - len(bad) - len(filtered), len(bad))
    order_id = {(p, o): p + 3 * o for p, o in produced}  # orders() puts order i at partition i % 3, in order
    kept = [pair for pair in produced if order_id[pair] not in bad | filtered]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), kept)
    assert_exactly_once(read_pairs(pipeline.sink.quarantine_uri), [pair for pair in produced if order_id[pair] in bad])


def test_a_server_restarted_between_runs_and_one_dying_mid_run_leave_every_rerun_exact(
        broker, topic, make_pipeline, connect_server, connect_session, monkeypatch):
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 600})
    produced = broker.produce(topic, orders(0, 1_200))
    first = connect_session()
    assert runner.run(pipeline, spark_factory=lambda: first).written == 1_200

    connect_server.stop()
    connect_server.start()  # an operator's restart: the old session is gone, a new run opens its own
    produced += broker.produce(topic, orders(1_200, 1_800))
    real_job, calls = jobs.ingest_job, []

    def dies_before_the_second_batch(spark, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first batch committed; the server dies and comes back under the second
            connect_server.kill()
            connect_server.start()
        return real_job(spark, *args, **kwargs)

    monkeypatch.setattr(runner, "ingest_job", dies_before_the_second_batch)
    second = connect_session()
    with pytest.raises(TaskFailed) as failure:
        runner.run(pipeline, spark_factory=lambda: second)
    assert "pipeline orders" in str(failure.value) and topic in str(failure.value)
    # The first batch of the run landed, the second did not: the table holds exactly the records
    # below its positions.
    positions = held_positions(pipeline.sink.table_uri, pipeline.name, topic)
    below = [(p, o) for p, o in produced if o < positions[p]]
    assert 1_200 < len(below) < 3_000
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), below)

    monkeypatch.undo()
    rerun = connect_session()
    runner.run(pipeline, spark_factory=lambda: rerun)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert held_positions(pipeline.sink.table_uri, pipeline.name, topic) == {0: 1_000, 1: 1_000, 2: 1_000}


def test_runs_take_turns_in_this_hosts_sessions_and_a_session_the_server_closed_is_replaced(
        broker, topic, make_pipeline, connect_session, monkeypatch, tmp_path):
    # A reused session keeps its Python workers and the package's artifact: a run in one took
    # 0.5 s here, a run in a new one 4 to 7 s. The transform's view `records` lives in the session.
    from oncemore.run.session import stop_session

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pipeline = make_pipeline(topic, transform="SELECT * FROM records WHERE id % 2 = 0")
    produced = []

    def run_in(session, start: int) -> None:
        produced.extend(broker.produce(topic, orders(start, 300)))
        assert runner.run(pipeline, spark_factory=lambda: session).written == 150

    first = connect_session()
    run_in(first, 0)
    stop_session(first)
    second = connect_session()
    assert second.session_id == first.session_id, "the next run reuses the session"
    meanwhile = connect_session()  # a run while the session is taken: a session of its own
    assert meanwhile.session_id != second.session_id
    run_in(meanwhile, 300)
    run_in(second, 600)
    stop_session(meanwhile)
    stop_session(second)

    closed = connect_session()
    assert closed.session_id == first.session_id
    closed.release_session_on_close = True  # as the server's idle timeout does: the id is refused from now on
    stop_session(closed)
    replaced = connect_session()
    assert replaced.session_id not in (first.session_id, meanwhile.session_id)
    run_in(replaced, 900)

    even = [(p, o) for p, o in produced if (p + 3 * o) % 2 == 0]  # orders() puts order i at i % 3, in order
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), even)


def where_workers_import_from(batches):
    """A Python worker's parent process (its daemon's command line) and where its task imports
    oncemore from."""
    import os

    import pyarrow as pa

    import oncemore.run.tasks

    with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
        parent = cmdline.read().replace(b"\0", b" ").decode()
    for _ in batches:
        yield pa.RecordBatch.from_pylist([{"parent": parent, "tasks": oncemore.run.tasks.__file__}])


def test_the_servers_workers_fork_from_oncemores_daemon_and_import_oncemore_from_their_session(connect_session):
    from pyspark import cloudpickle

    session = connect_session()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the server cannot import this test module
    try:
        rows = session.range(0, 2, 1, 2).mapInArrow(where_workers_import_from, "parent string, tasks string").collect()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])

    assert len(rows) == 2
    for row in rows:
        assert "-m oncemore.run.workerdaemon" in row.parent
        # The daemon imported the server's own oncemore to run; its workers never use that copy.
        assert "oncemore.zip" in row.tasks and not row.tasks.startswith(INCLUDE), row.tasks


def test_a_server_whose_workers_cannot_import_the_daemon_fails_the_run_saying_why(
        broker, topic, make_pipeline, connect_session, monkeypatch, tmp_path):
    # A cluster whose executors lack the oncemore package: Spark cannot start their Python workers.
    from devtools import sparkconnect
    from oncemore.run.session import spark_session, stop_session

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sparkconnect, "WORKER_DAEMON", "oncemore.nosuchdaemon")
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    server = sparkconnect.start_connect_server("local[1]", log_dir=str(tmp_path / "connect"))
    try:
        session = spark_session(remote=server.url)
        try:
            with pytest.raises(TaskFailed, match=rf"pipeline orders: the Spark task reading {topic}/0 \[0, 10\), .* failed: "
                                                 r"Python worker failed to start: \S+: No module named oncemore\.nosuchdaemon$"):
                runner.run(pipeline, spark_factory=lambda: session)
        finally:
            stop_session(session)
    finally:
        server.stop()
    assert read_pairs(pipeline.sink.table_uri) == []


def test_the_worker_daemon_loads_the_tasks_libraries_and_forgets_oncemore_before_it_forks():
    probe = ("import sys, oncemore.run.workerdaemon as daemon; daemon.preload(); "
             "print(sorted(set(daemon.PRELOADED) - set(sys.modules))); "
             "print(sorted(n for n in sys.modules if n.split('.')[0] == 'oncemore'))")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": INCLUDE},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["[]", "[]"]


def test_a_slot_session_id_joins_the_urls_own_parameters_and_no_error_shows_the_token(monkeypatch, tmp_path):
    from pyspark.sql import SparkSession

    from oncemore.core.errors import SparkConnectError
    from oncemore.run.session import connect_session

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    asked = []

    def refuse(builder, url):
        asked.append(url)
        raise RuntimeError(f"cannot reach {url}")  # as PySpark's messages do, the URL quoted

    monkeypatch.setattr(SparkSession.Builder, "remote", refuse)
    for remote in ("sc://connect:15002/", "sc://connect:15002/;token=s3cr3t", "sc://connect:15002/;token=s3cr3t;user_id=etl",
                   "sc://connect:15002/;session_id=8c7e6a3e-63a8-4cf4-9d55-45a9a0a4b1c1"):
        with pytest.raises(SparkConnectError) as refused:
            connect_session(remote)
        assert "s3cr3t" not in str(refused.value) and str(refused.value).startswith(
            "no Spark Connect session on sc://connect:15002:")
    plain, with_token, as_user, own = asked
    assert plain.startswith("sc://connect:15002/;session_id=")
    assert as_user.startswith("sc://connect:15002/;token=s3cr3t;user_id=etl;session_id=")
    assert own == "sc://connect:15002/;session_id=8c7e6a3e-63a8-4cf4-9d55-45a9a0a4b1c1", "the user's session as given"
    session = {url: url.rsplit("session_id=", 1)[1] for url in asked}
    assert session[plain] == session[with_token], "a token (rotated) does not change the session"
    assert session[as_user] != session[plain], "another Spark user gets a session of its own"


def test_two_cache_directories_never_share_a_session_and_a_renewed_slot_never_meets_an_old_id(tmp_path, monkeypatch):
    # Two containers may share a host name and a user, each with its cache (and so its locks).
    from oncemore.run.connectslots import take_slot

    held = []
    for cache in ("one", "two"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / cache))
        held.append(take_slot("sc://connect:15002", b"the package"))
    assert held[0].index == held[1].index == 0 and held[0].session_id != held[1].session_id
    seen = {held[0].session_id}
    for _ in range(3):
        held[0].renew()
        assert held[0].session_id not in seen
        seen.add(held[0].session_id)
    for slot in held:
        slot.release()
