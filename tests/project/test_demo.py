"""The demo path on its embedded broker (Apache Kafka, brought by scripts/setup): `scripts/demo` as a new
user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, read_pairs

pytestmark = pytest.mark.spark


def test_the_demo_ingests_every_record_once_on_kafka_and_its_reruns_are_noops(tmp_path):
    env = {**os.environ, "ONCEMORE_DATA_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(ROOT / "include"), str(ROOT)])}
    env.pop("ONCEMORE_PIPELINES_DIR", None)
    demo = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], env=env, capture_output=True,
                          text=True, timeout=900)

    assert demo.returncode == 0, demo.stderr[-3000:]
    # Quiet by default: oncemore's lines, none of Spark's or Airflow's start-up warnings or library chatter
    # (librdkafka's lines name their client: "GETPID [rdkafka#producer-3] ...").
    for noise in ("WARN", "warning", "Deprecat", "HTTP Request", "log4j", "rdkafka"):
        assert noise not in demo.stdout + demo.stderr, noise
    assert "together 20000 of 20000 produced" in demo.stdout
    assert "no-op (nothing new to ingest)" in demo.stdout
    assert "run: DAG run success; ingest success" in demo.stdout
    assert "rerun: DAG run success; ingest skipped" in demo.stdout
    pairs = read_pairs(str(tmp_path / "delta" / "orders")) + read_pairs(str(tmp_path / "delta" / "orders_quarantine"))
    assert len(pairs) == len(set(pairs)) == 25_000
    assert {p for p, _ in pairs} == {0, 1, 2}
    # The Avro example through the local registry: every record, nested columns from the registered schema.
    assert "delta/avro: 1000 rows; columns from the registered schema: key, id, customer, amount, placed" in demo.stdout
    avro = read_pairs(str(tmp_path / "delta" / "avro"))
    assert len(avro) == len(set(avro)) == 1_000
    # The Debezium example: late and out-of-order change events land as the source table's state.
    assert "delta/debezium_accounts: " in demo.stdout and "equal, key by key" in demo.stdout
