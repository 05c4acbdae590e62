"""A bounded soak with faults on Apache Kafka: a producer writing all along (plain batches,
transactions, some aborted, some malformed records), runs every few seconds with small batches,
some SIGKILLed at random, maintenance looping beside them, and the broker restarted twice from its
data directory. At the end every committed record is in the table or the quarantine exactly once,
no aborted one is, and ``oncemore verify`` agrees. The figures go to the test log."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from conftest import assert_exactly_once, oncemore_command, order, produced_coordinates, read_coordinates
from oncemore.ops.maintain import maintain
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark

SOAK_SECONDS = float(os.environ.get("ONCEMORE_SOAK_SECONDS", "270"))
TOPIC = "soak"


class Producer(threading.Thread):
    """Writes batches of 30 to 90 records until stopped; a lock keeps each batch whole and
    outside a broker restart, so what was committed and what was aborted is known for certain."""

    def __init__(self, broker, lock: threading.Lock, rng: random.Random):
        super().__init__(daemon=True)
        self.broker, self.lock, self.rng = broker, lock, rng
        self.committed: list[tuple[int, int]] = []
        self.aborted: list[tuple[int, int]] = []
        self.batches = {"plain": 0, "transaction": 0, "aborted": 0}
        self.stop = threading.Event()
        self.next_id = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # the test fails on it, not a thread dying unseen
            self.error = exc

    def _produce(self) -> None:
        while not self.stop.is_set():
            count = self.rng.randint(30, 90)
            records = [(i % 3, None, b"{broken" if i % 40 == 7 else order(i), None)
                       for i in range(self.next_id, self.next_id + count)]
            self.next_id += count
            kind = self.rng.choice(["plain", "plain", "transaction", "transaction", "aborted"])
            with self.lock:
                pairs = self.broker.produce(TOPIC, records, transactional_id=None if kind == "plain" else "soak",
                                            abort=kind == "aborted")
            (self.aborted if kind == "aborted" else self.committed).extend(pairs)
            self.batches[kind] += 1
            self.stop.wait(self.rng.uniform(0.1, 0.5))


def test_a_soak_of_runs_kills_maintenance_and_broker_restarts_ends_exact(own_broker, make_pipeline, spark):
    rng = random.Random(20261124)
    broker = own_broker()
    broker.create_topic(TOPIC, 3)
    pipeline = make_pipeline(TOPIC, source={"bootstrap_servers": broker.bootstrap_servers},
                             limits={"max_records_per_commit": 150})
    lock = threading.Lock()
    producer = Producer(broker, lock, rng)
    figures = {"runs": 0, "committed": 0, "no-op": 0, "failed": 0, "killed": 0, "restarts": 0, "maintenance": 0}
    failures: list[str] = []
    stop = threading.Event()

    def maintenance():
        while not stop.wait(15):
            try:
                maintain(pipeline)
            except Exception as exc:
                failures.append(f"maintenance: {type(exc).__name__}: {exc}")
            figures["maintenance"] += 1

    def restarts():
        for at in (SOAK_SECONDS / 3, 2 * SOAK_SECONDS / 3):
            if stop.wait(max(0.0, started + at - time.monotonic())):
                return
            with lock:
                broker.restart()
            figures["restarts"] += 1

    started = time.monotonic()
    helpers = [producer, threading.Thread(target=maintenance, daemon=True), threading.Thread(target=restarts, daemon=True)]
    for helper in helpers:
        helper.start()
    running: list[tuple[object, float | None]] = []  # (process, when to kill it or None)
    while time.monotonic() - started < SOAK_SECONDS or running:
        now = time.monotonic()
        for process, kill_at in list(running):
            if process.poll() is None and kill_at is not None and now >= kill_at:
                os.killpg(process.pid, signal.SIGKILL)
            if process.poll() is None:
                if now - started > SOAK_SECONDS + 600:
                    pytest.fail("a run has not ended ten minutes after the soak: it hangs")
                continue
            out, err = process.communicate()
            running.remove((process, kill_at))
            if process.returncode == -signal.SIGKILL:
                figures["killed"] += 1
            elif process.returncode == 0:
                figures["no-op" if "no-op" in out else "committed"] += 1
            else:
                figures["failed"] += 1  # one line naming the pipeline, as every failed run must say
                last = err.strip().splitlines()[-1] if err.strip() else ""
                if not last.startswith("oncemore: error: pipeline orders: "):
                    failures.append(last or f"exit {process.returncode} without a line")
        if now - started < SOAK_SECONDS and len(running) < 2:
            kill_at = now + rng.uniform(2, 14) if rng.random() < 0.3 else None
            running.append((oncemore_command(pipeline), kill_at))
            figures["runs"] += 1
        time.sleep(rng.uniform(2, 4))
    producer.stop.set()
    stop.set()
    for helper in helpers:
        helper.join(timeout=120)

    # Every failure said what it was; then a run without faults ingests the rest.
    assert producer.error is None, producer.error
    assert not failures, failures[:5]
    assert runner.run(pipeline, spark_factory=lambda: spark).status in ("committed", "no-op")
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "no-op"
    landed = read_coordinates(pipeline.sink.table_uri) + read_coordinates(pipeline.sink.quarantine_uri)
    assert_exactly_once(landed, produced_coordinates(TOPIC, producer.committed))
    assert not set(landed) & set(produced_coordinates(TOPIC, producer.aborted))
    report = verify(pipeline, lambda: spark)
    assert report.ok, report.discrepancies[:5]

    figures.update(records=len(producer.committed), aborted_records=len(producer.aborted), **producer.batches,
                   quarantined=len(read_coordinates(pipeline.sink.quarantine_uri)),
                   seconds=round(time.monotonic() - started))
    print(f"\nsoak figures: {figures}")
    assert figures["restarts"] == 2 and figures["killed"] >= 1 and figures["committed"] >= 5, figures
    assert figures["maintenance"] >= SOAK_SECONDS // 30 and producer.batches["aborted"] >= 1, figures
