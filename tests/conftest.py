"""Fixtures: a real broker, a real local Spark, real Delta tables on disk, and an independent reader.

The broker is a local Tansu (memory storage) unless ONCEMORE_TEST_BOOTSTRAP names a real
Kafka cluster, in which case tests that Tansu's bugs make fail run for real there.
"""

from __future__ import annotations

import gc
import glob
import json
import logging
import os
import uuid
from pathlib import Path

import duckdb
import duckdb_extension_delta
import pytest
import yaml

from oncemore import devbroker
from oncemore.config import Pipeline, load_pipeline

EXTERNAL_BOOTSTRAP = os.environ.get("ONCEMORE_TEST_BOOTSTRAP")
# py4j logs at INFO while the interpreter shuts down, after pytest closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)
ON_TANSU = not EXTERNAL_BOOTSTRAP


def tansu_bug(reason: str):
    """Marks a test that Tansu 0.6.0 fails for the broker's own reason (runs for real on Kafka)."""
    return pytest.mark.xfail(ON_TANSU, reason=f"Tansu 0.6.0: {reason}", strict=True)


@pytest.fixture(scope="session")
def broker():
    if EXTERNAL_BOOTSTRAP:
        yield devbroker.DevBroker(EXTERNAL_BOOTSTRAP)
        return
    with devbroker.running() as local:
        yield local
        # Destroy lingering client handles first, or their reconnect errors print after pytest's summary.
        gc.collect()


@pytest.fixture(scope="session")
def spark():
    from oncemore.runner import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()


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


def order(i: int) -> bytes:
    return json.dumps({"id": i, "customer": f"customer-{i % 97}", "amount": round(i * 1.25, 2)}).encode()


def orders(start: int, count: int, partitions: int = 3) -> list[tuple[int, bytes, bytes, None]]:
    return [(i % partitions, str(i).encode(), order(i), None) for i in range(start, start + count)]


def _duckdb() -> duckdb.DuckDBPyConnection:
    extension = glob.glob(str(Path(duckdb_extension_delta.__file__).parent / "extensions" / "*" / "delta.duckdb_extension"))[0]
    connection = duckdb.connect(config={"allow_unsigned_extensions": "true"})
    connection.execute(f"LOAD '{extension}'")
    return connection


def read_pairs(table_uri: str) -> list[tuple[int, int]]:
    """Every (partition, offset) in the table, read by DuckDB's Delta reader (not delta-rs)."""
    if not Path(table_uri, "_delta_log").exists():
        return []
    rows = _duckdb().execute(
        f"SELECT _kafka_partition, _kafka_offset FROM delta_scan('{table_uri}')"
    ).fetchall()
    return sorted(rows)


def query(table_uri: str, sql: str) -> list[tuple]:
    """Runs ``sql`` with ``{table}`` standing for the Delta table, through DuckDB."""
    return _duckdb().execute(sql.format(table=f"delta_scan('{table_uri}')")).fetchall()


def assert_exactly_once(pairs: list[tuple[int, int]], expected: list[tuple[int, int]]) -> None:
    """Counts: no (partition, offset) twice, none missing, none outside the expected set."""
    duplicates = len(pairs) - len(set(pairs))
    assert duplicates == 0, f"{duplicates} duplicated (partition, offset) pairs"
    missing = set(expected) - set(pairs)
    extra = set(pairs) - set(expected)
    assert not missing, f"{len(missing)} records missing, e.g. {sorted(missing)[:5]}"
    assert not extra, f"{len(extra)} records outside the committed ranges, e.g. {sorted(extra)[:5]}"
    assert len(pairs) == len(expected)
