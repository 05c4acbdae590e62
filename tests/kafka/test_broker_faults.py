"""Faults at the broker: SASL SCRAM end to end with the password kept out of everything a person or
another process can see, a wrong password or a broker that is down failing clearly within the
configured timeout, a broker restarted mid-read, one killed mid-run (the run fails saying what to do,
the rerun carries on), and records deleted (DeleteRecords) before a run."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from conftest import assert_exactly_once, oncemore, oncemore_commits, orders, process_list_watcher, read_pairs
from oncemore.core.errors import DataLoss, TaskFailed
from oncemore.run import runner

PASSWORD = "pw-7d1e0c4a9b"  # random-looking, so finding it anywhere means it leaked
SCRAM = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "ingest",
         "sasl.password": "${ONCEMORE_TEST_KAFKA_PASSWORD}"}


@pytest.mark.spark
def test_sasl_scram_run_is_exactly_once_and_the_password_never_shows(own_broker, make_pipeline, monkeypatch):
    monkeypatch.setenv("ONCEMORE_TEST_KAFKA_PASSWORD", PASSWORD)
    local = own_broker(sasl="SCRAM-SHA-256", user="ingest", password=PASSWORD)
    local.create_topic("secured", 3)
    produced = local.produce("secured", orders(0, 600))
    pipeline = make_pipeline("secured", source={"bootstrap_servers": local.bootstrap_servers, "kafka_options": SCRAM})
    leaked: list[str] = []
    stop = process_list_watcher([PASSWORD], leaked)
    try:
        result = oncemore("run", "--config", pipeline.origin)
        status = oncemore("status", "--config", pipeline.origin, check_no_spark=True)
    finally:
        stop.set()

    assert result.returncode == 0, result.stderr[-3000:]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert status.returncode == 0 and "lag" in status.stdout
    assert not leaked, "the password showed in the process list (the local broker's own start included)"
    for output in (result.stdout, result.stderr, status.stdout, status.stderr):
        assert PASSWORD not in output
    for log_file in Path(pipeline.sink.table_uri, "_delta_log").glob("*.json"):
        assert PASSWORD not in log_file.read_text()


def test_a_wrong_password_fails_clearly_within_the_timeout(own_broker, make_pipeline, monkeypatch):
    monkeypatch.setenv("ONCEMORE_TEST_KAFKA_PASSWORD", PASSWORD)
    local = own_broker(sasl="SCRAM-SHA-256", user="ingest", password=PASSWORD)
    local.create_topic("secured", 1)
    pipeline = make_pipeline("secured", source={"bootstrap_servers": local.bootstrap_servers, "kafka_options": SCRAM,
                                                "stall_timeout_seconds": 5})

    started = time.monotonic()
    result = oncemore("plan", "--config", pipeline.origin, env={"ONCEMORE_TEST_KAFKA_PASSWORD": "wrong-" + PASSWORD},
                      check_no_spark=True)

    assert result.returncode == 1 and time.monotonic() - started < 30
    line, = result.stderr.strip().splitlines()
    assert "pipeline orders" in line and local.bootstrap_servers in line and "uthenticat" in line, line
    assert PASSWORD not in result.stderr


def test_a_broker_that_is_down_or_a_host_that_does_not_resolve_fails_at_once(own_broker, make_pipeline):
    local = own_broker()
    local.stop()
    for servers, cause in ((local.bootstrap_servers, "Connection refused"),
                           ("no-such-host.invalid:9092", "Failed to resolve 'no-such-host.invalid:9092'")):
        pipeline = make_pipeline("orders", source={"bootstrap_servers": servers, "stall_timeout_seconds": 60})

        started = time.monotonic()
        result = oncemore("plan", "--config", pipeline.origin, check_no_spark=True)

        assert result.returncode == 1 and time.monotonic() - started < 15, "not the 60 s stall timeout"
        line, = result.stderr.strip().splitlines()
        assert f"pipeline orders: cannot reach Kafka at {servers}: " in line and cause in line, line


def test_a_broker_that_does_not_answer_fails_within_the_stall_timeout(make_pipeline):
    silent = socket.socket()  # accepts connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    servers = f"127.0.0.1:{silent.getsockname()[1]}"
    pipeline = make_pipeline("orders", source={"bootstrap_servers": servers, "stall_timeout_seconds": 4})

    started = time.monotonic()
    result = oncemore("plan", "--config", pipeline.origin, check_no_spark=True)

    assert result.returncode == 1 and 4 <= time.monotonic() - started < 30
    line, = result.stderr.strip().splitlines()
    assert f"cannot reach Kafka at {servers} within 4s (source.stall_timeout_seconds)" in line, line
    silent.close()


@pytest.mark.spark
def test_a_broker_restarted_mid_read_is_waited_out_and_the_rerun_is_exact(own_broker, make_pipeline, spark):
    local = own_broker()  # persisted under the test's data directory: a restart keeps the log
    local.create_topic("restarted", 3)
    produced = local.produce("restarted", orders(0, 30_000))
    pipeline = make_pipeline("restarted", source={"bootstrap_servers": local.bootstrap_servers},
                             limits={"max_records_per_commit": 3_000})
    log_dir = Path(pipeline.sink.table_uri, "_delta_log")

    restarted_at: list[int] = []

    def restart_after_the_first_commits():
        deadline = time.monotonic() + 120
        while len(list(log_dir.glob("*.json"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        restarted_at.append(len(list(log_dir.glob("*.json"))))
        local.restart()

    restarter = threading.Thread(target=restart_after_the_first_commits)
    restarter.start()
    report = runner.run(pipeline, spark_factory=lambda: spark)
    restarter.join()

    assert report.written == 30_000 and len(report.batches) == 10
    assert restarted_at[0] < len(list(log_dir.glob("*.json"))), "the broker restarted while the run was reading"
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    again = runner.run(pipeline, spark_factory=lambda: spark)
    assert again.written == 0 and again.status == "no-op"
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


@pytest.mark.spark
def test_a_broker_killed_mid_run_fails_once_the_stall_timeout_passes_saying_what_to_do_and_the_rerun_carries_on(
        own_broker, make_pipeline, spark):
    local = own_broker()
    local.create_topic("killed", 3)
    produced = local.produce("killed", orders(0, 30_000))
    pipeline = make_pipeline("killed", source={"bootstrap_servers": local.bootstrap_servers, "stall_timeout_seconds": 4},
                             limits={"max_records_per_commit": 3_000})
    log_dir = Path(pipeline.sink.table_uri, "_delta_log")
    killed_at: list[float] = []

    def kill_after_the_first_commits():
        deadline = time.monotonic() + 120
        while len(list(log_dir.glob("*.json"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        local.kill()
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_after_the_first_commits)
    killer.start()
    with pytest.raises(TaskFailed) as failed:
        runner.run(pipeline, spark_factory=lambda: spark)
    waited = time.monotonic() - killed_at[0]
    killer.join()

    message = str(failed.value)
    assert "no progress for 4s (source.stall_timeout_seconds) at offset " in message, message
    assert "the broker is unreachable (" in message, message
    assert message.endswith("start it (or restore the connection to it), then run again: what was committed stays, "
                            "and the rerun carries on from there"), message
    # The setting bounds the wait: its 4 s, telling the causes apart (3 s at most) and Spark ending the job.
    assert 4 <= waited < 4 + 3 + 10, waited
    committed = read_pairs(pipeline.sink.table_uri)
    assert 0 < len(committed) < len(produced)

    local.restart()
    again = runner.run(pipeline, spark_factory=lambda: spark)

    assert again.written == len(produced) - len(committed)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


@pytest.mark.spark
def test_records_deleted_past_the_position_fail_the_run_or_are_recorded_as_a_gap(broker, topic, make_pipeline, spark):
    first = broker.produce(topic, orders(0, 150))  # offsets 0..49 of each partition
    strict, lenient = make_pipeline(topic), make_pipeline(topic, name="lenient", fail_on_data_loss=False)
    for pipeline in (strict, lenient):
        runner.run(pipeline, spark_factory=lambda: spark)
    second = broker.produce(topic, orders(150, 150))  # offsets 50..99
    broker.delete_records(topic, {0: 90})  # DeleteRecords: offsets 50..89 of partition 0 were never ingested

    with pytest.raises(DataLoss, match=rf"pipeline orders: {topic}/0: offsets \[50, 90\) are no longer in the log"):
        runner.run(strict, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(strict.sink.table_uri), first)

    report = runner.run(lenient, spark_factory=lambda: spark)

    assert report.written == 110
    assert_exactly_once(read_pairs(lenient.sink.table_uri), first + [(p, o) for p, o in second if p != 0 or o >= 90])
    (_, record), = oncemore_commits(lenient.sink.table_uri)[-1:]
    assert [(g.partition, g.start, g.end) for g in record.gaps] == [(0, 50, 90)]
