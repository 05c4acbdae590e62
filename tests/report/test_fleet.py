"""Every pipeline at once (report/fleet.py, kafka/cluster.py): a row per pipeline from its table's
log and Kafka, each broken pipeline beside the others naming itself, and Kafka asked once per
cluster however many pipelines read it."""

from __future__ import annotations

import uuid

import pytest
import yaml

from devtools.fleet import write_fleet
from oncemore.config.loading import load_pipeline
from oncemore.kafka import clients
from oncemore.report import fleet

PER_PARTITION = 10


@pytest.fixture
def counted(monkeypatch):
    """The admin clients made and the cluster metadata requests made, by asking pipeline."""
    made, asked = [], []
    real_admin, real_metadata = clients.admin_client, clients.cluster_metadata
    monkeypatch.setattr(clients, "admin_client", lambda p: made.append(p.name) or real_admin(p))
    monkeypatch.setattr(clients, "cluster_metadata", lambda admin, p: asked.append(p.name) or real_metadata(admin, p))
    return made, asked


def _pipeline_file(directory, name: str, **config):
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "format": {"type": "raw"}, **config}))
    return load_pipeline(path)


def test_a_row_per_pipeline_with_one_admin_client_and_one_metadata_request_for_the_cluster(broker, tmp_path, counted):
    suffix = uuid.uuid4().hex[:8]
    topics = {f"fleet_a_{suffix}": 3, f"fleet_b_{suffix}": 2}
    for topic, partitions in topics.items():
        broker.create_topic(topic, partitions)
        broker.produce(topic, [(i % partitions, None, b"x", None) for i in range(PER_PARTITION * partitions)])
    pipelines = write_fleet(tmp_path / "pipelines", tmp_path / "delta", broker.bootstrap_servers, topics, 20)
    source = {"bootstrap_servers": broker.bootstrap_servers, "stall_timeout_seconds": 20}
    missing = _pipeline_file(tmp_path / "pipelines", "fleet_missing", source={**source, "topic": f"nope_{suffix}"},
                             sink={"table_uri": str(tmp_path / "delta" / "missing")})
    alerting = _pipeline_file(tmp_path / "pipelines", "fleet_alert", source={**source, "topic": f"fleet_a_{suffix}"},
                              sink={"table_uri": str(tmp_path / "delta" / "alert")}, alert={"max_lag_records": 5})
    made, asked = counted

    found = fleet.overviews([*pipelines, missing, alerting])

    assert len(made) == 1, f"one admin client for the cluster, not one per pipeline: {made}"
    assert len(asked) == 1, f"one metadata request for the cluster: {asked}"
    assert [d["pipeline"] for d in found] == [p.name for p in [*pipelines, missing, alerting]]
    rows = {d["pipeline"]: d["row"] for d in found}
    for i, pipeline in enumerate(pipelines):
        row, partitions = rows[pipeline.name], topics[pipeline.source.topic]
        assert row["tags"] == ["fleet", ("even", "odd")[i % 2]] and row["verify"] is None
        if i % 10 == 9:  # never run: the whole topic is behind, nothing committed
            assert (row["state"], row["lag"], row["last_commit"], row["quarantined_24h"]) == \
                ("new", PER_PARTITION * partitions, None, 0), row
        else:  # two commits, each of offset k of every partition
            assert (row["state"], row["lag"]) == ("ok", (PER_PARTITION - 2) * partitions), row
            assert 0 <= row["last_commit_age_seconds"] < 600 and row["lag_seconds"] > 0
            assert row["quarantined_24h"] == 2 * min(i % 3, partitions) and row["quarantined_24h_complete"]
    assert rows["fleet_missing"]["state"] == "error"
    assert rows["fleet_missing"]["why"].startswith(f"KafkaSourceError: pipeline fleet_missing: topic 'nope_{suffix}'")
    assert rows["fleet_alert"]["state"] == "alert" and f"fleet_a_{suffix}/0: 10 records behind (limit 5" in \
        rows["fleet_alert"]["why"]
    lines = fleet.format_rows([d["row"] for d in found]).splitlines()
    assert lines[0].split() == list(fleet.COLUMNS) and len(lines) == 1 + len(found)
    assert lines[1].split()[:3] == ["fleet_000", "ok", str((PER_PARTITION - 2) * 3)]


def test_an_unreachable_cluster_fails_each_of_its_pipelines_naming_it_at_once(tmp_path, counted):
    source = {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "stall_timeout_seconds": 60}
    pipelines = [_pipeline_file(tmp_path, f"down_{i}", source=source, sink={"table_uri": str(tmp_path / f"t{i}")})
                 for i in range(4)]
    made, asked = counted

    rows = [d["row"] for d in fleet.overviews(pipelines)]  # within the timeout: refused connections fail at once

    assert len(made) == 1 and len(asked) == 1
    for pipeline, row in zip(pipelines, rows):
        assert row["state"] == "error"
        assert row["why"].startswith(f"KafkaSourceError: pipeline {pipeline.name}: cannot reach Kafka at 127.0.0.1:1")
