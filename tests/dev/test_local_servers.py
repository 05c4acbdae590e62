"""scripts/kafka and scripts/registry: a developer's own broker and registry, run detached on a
fixed port with their data kept between starts (devtools.processes.serve_main). Each test starts its
server itself, through the script a user runs, and stops it whatever happens."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
from pathlib import Path

import psutil
from confluent_kafka import Consumer, TopicPartition

from devtools.kafkabroker import DevBroker, free_port
from devtools.processes import port_taken, running_pid

ROOT = Path(__file__).resolve().parents[2]


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    # Captured output: a server that kept the script's pipes open would hang this call to its timeout.
    return subprocess.run([str(ROOT / "scripts" / name), *args], capture_output=True, text=True, timeout=240)


def assert_gone(pid: int, port: int) -> None:
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not port_taken(port)


def read_all(bootstrap: str, topic: str, partitions: int, expected: int) -> list[tuple[int, int, bytes]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "read-all", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    read = []
    for _ in range(100):
        read += [(m.partition(), m.offset(), m.value()) for m in consumer.consume(expected, 0.5) if not m.error()]
        if len(read) >= expected:
            break
    consumer.close()
    return sorted(read)


def test_scripts_kafka_serves_on_its_port_keeps_the_records_between_starts_and_stop_leaves_no_process(tmp_path):
    data_dir, port = tmp_path / "kafka", free_port()
    where = ["--data-dir", str(data_dir)]
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            busy_port = taken.getsockname()[1]
            busy = script("kafka", "start", "--port", str(busy_port), *where)
        assert busy.returncode == 1 and f"port {busy_port} of 127.0.0.1 is taken" in busy.stderr
        assert running_pid(data_dir) is None

        started = script("kafka", "start", "--port", str(port), *where)
        assert started.returncode == 0, started.stderr
        assert f"running at 127.0.0.1:{port}" in started.stdout
        first_pid = running_pid(data_dir)
        assert first_pid is not None and port_taken(port)
        assert script("kafka", "status", *where).returncode == 0
        again = script("kafka", "start", "--port", str(port), *where)
        assert again.returncode == 0 and "already running" in again.stdout
        assert running_pid(data_dir) == first_pid
        elsewhere = script("kafka", "start", "--port", str(free_port()), *where)
        assert elsewhere.returncode == 1 and f"serves on port {port}" in elsewhere.stderr

        broker = DevBroker(f"127.0.0.1:{port}")
        broker.create_topic("mine", 2)
        values = [f"record-{i}".encode() for i in range(100)]
        delivered = broker.produce("mine", [(i % 2, None, value, None) for i, value in enumerate(values)])
        del broker

        stopped = script("kafka", "stop", *where)
        assert stopped.returncode == 0 and f"stopped (pid {first_pid})" in stopped.stdout
        assert_gone(first_pid, port)
        assert script("kafka", "status", *where).returncode == 3

        assert script("kafka", "start", "--port", str(port), *where).returncode == 0
        second_pid = running_pid(data_dir)
        read = read_all(f"127.0.0.1:{port}", "mine", 2, len(values))
        assert [(p, o) for p, o, _ in read] == delivered
        assert sorted(v for _, _, v in read) == sorted(values)

        assert script("kafka", "stop", *where).returncode == 0
        assert_gone(second_pid, port)
        assert not (data_dir / "server.pid").exists()
    finally:
        script("kafka", "stop", *where)


def test_scripts_kafka_starts_a_data_directory_only_as_the_release_that_formatted_it(tmp_path):
    # Nothing starts: the release is checked before any JVM (a 4.4 directory fails on 3.9 deep in its metadata).
    made_by = {"kafka-44": None, "kafka-39": "3.9"}  # directories from before the version file are 4.4's
    for name, version in made_by.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "server.properties").write_text("listener.security.protocol.map=PLAINTEXT:PLAINTEXT\n")
        if version:
            (tmp_path / name / "kafka-version").write_text(f"{version}\n")
    port = free_port()
    as_39 = script("kafka", "--kafka-version", "3.9", "start", "--port", str(port), "--data-dir", str(tmp_path / "kafka-44"))
    assert as_39.returncode == 1
    assert "holds a Kafka 4.4 broker's data: start it as Kafka 4.4, or Kafka 3.9 on another data directory" in as_39.stderr
    as_44 = script("kafka", "start", "--port", str(port), "--data-dir", str(tmp_path / "kafka-39"))
    assert as_44.returncode == 1 and "holds a Kafka 3.9 broker's data" in as_44.stderr
    assert not port_taken(port)


def test_scripts_registry_keeps_its_schemas_between_starts_and_stop_leaves_no_process(tmp_path):
    data_dir, port = tmp_path / "registry", free_port()
    where = ["--port", str(port), "--data-dir", str(data_dir)]
    url = f"http://127.0.0.1:{port}/apis/ccompat/v7"
    try:
        started = script("registry", "start", *where)
        assert started.returncode == 0, started.stderr
        assert url in started.stdout
        first_pid = running_pid(data_dir)
        request = urllib.request.Request(f"{url}/subjects/mine-value/versions", method="POST",
                                         data=json.dumps({"schema": json.dumps({"type": "string"})}).encode(),
                                         headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            schema_id = json.load(answer)["id"]
        assert script("registry", "stop", *where).returncode == 0
        assert_gone(first_pid, port)
        assert script("registry", "status", *where).returncode == 3

        assert script("registry", "start", *where).returncode == 0
        second_pid = running_pid(data_dir)
        with urllib.request.urlopen(f"{url}/subjects/mine-value/versions/1", timeout=30) as answer:
            assert json.load(answer)["id"] == schema_id
        assert script("registry", "stop", *where).returncode == 0
        assert_gone(second_pid, port)
    finally:
        script("registry", "stop", *where)
