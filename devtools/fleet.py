"""Many pipelines on few topics, cheaply, for the tests and the benchmark of the views of every
pipeline (report/fleet.py, the oncemore page's index): pipeline files in a directory, each with a
small table of a few oncemore commits made the way a reset commits (positions and a batch record,
no data files: the views read the logs, never the rows)."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from oncemore.commit.committer import commit_positions
from oncemore.commit.tables import ensure_tables
from oncemore.config.loading import load_pipeline
from oncemore.config.model import Pipeline
from oncemore.core.coordinates import KafkaPartition
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger


def write_fleet(directory: Path, tables: Path, bootstrap_servers: str, topics: dict[str, int], count: int,
                commits: int = 2, tags: tuple[str, ...] = ("even", "odd")) -> list[Pipeline]:
    """``count`` pipelines named fleet_000, fleet_001, ... in ``directory``, pipeline i reading
    topic i mod len(topics) (``topics``: {name: partitions}), tagged with tags[i mod len(tags)]
    and ``fleet``, with an airflow block whose schedule starts next year (no run is ever
    scheduled). Pipeline i's table holds ``commits`` commits (none for every tenth: never run),
    the k-th at offset k + 1 of every partition, quarantining i mod 3 records each (at most one a partition)."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(topics)
    start = f"{time.gmtime().tm_year + 1}-01-01T00:00:00"
    pipelines = []
    for i in range(count):
        name, topic = f"fleet_{i:03d}", names[i % len(names)]
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "name": name, "source": {"bootstrap_servers": bootstrap_servers, "topic": topic, "stall_timeout_seconds": 20},
            "sink": {"table_uri": str(tables / name)}, "format": {"type": "raw"},
            "airflow": {"schedule": "@daily", "start_date": start, "tags": ["fleet", tags[i % len(tags)]]},
        }))
        pipeline = load_pipeline(path)
        pipelines.append(pipeline)
        if i % 10 == 9:
            continue
        ensure_tables(pipeline, pipeline.static_columns())
        ledger = Ledger(pipeline.sink.table_uri, name)
        partitions = [KafkaPartition(topic, p) for p in range(topics[topic])]
        quarantined = min(i % 3, len(partitions))
        for k in range(commits):
            commit_positions(ledger, {p: k + 1 for p in partitions}, CommitInfo(
                pipeline=name, run_id=f"run-{k}", batch_seq=0,
                ranges={topic: {str(p.partition): [k, k + 1] for p in partitions}},
                records={"written": len(partitions) - quarantined, "quarantined": quarantined, "filtered": 0}, duration_ms=100))
    return pipelines
