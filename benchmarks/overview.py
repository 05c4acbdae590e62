"""How long the oncemore page takes to read a pipeline whose table has many commits: builds a
table of N oncemore batch commits (positions and batch records, as ingestion writes them; no data
files, which the page never reads) on a local Apache Kafka broker's topic, then times the
overview of the list page and of the pipeline page, and the pipeline page's HTML.

    scripts/benchmark overview [--commits 5000]

Prints seconds (median of 5). Not a test: figures, not verdicts. The target: well under a second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from devtools import kafkabroker
from oncemore.commit.committer import commit_positions
from oncemore.commit.tables import ensure_tables
from oncemore.config.loading import parse_pipeline
from oncemore.core.coordinates import KafkaPartition
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.report.overview import pipeline_overview

PARTITIONS = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commits", type=int, default=5_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="oncemore-overview-"))
    with kafkabroker.running(kafkabroker.start_kafka()) as broker:
        broker.create_topic("events", PARTITIONS)
        broker.produce("events", [(i % PARTITIONS, None, b"{}", None) for i in range(args.commits * PARTITIONS + 800)])
        pipeline = parse_pipeline({
            "name": "events", "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": "events"},
            "sink": {"table_uri": str(work / "events")}, "format": {"type": "raw"},
        }, "<benchmark>", {})
        ensure_tables(pipeline, pipeline.static_columns())
        ledger = Ledger(pipeline.sink.table_uri, "events")
        started = time.monotonic()
        for n in range(args.commits):
            ranges = {str(p): [n, n + 1] for p in range(PARTITIONS)}
            commit_positions(ledger, {KafkaPartition("events", p): n + 1 for p in range(PARTITIONS)}, CommitInfo(
                pipeline="events", run_id=f"run-{n // 10}", batch_seq=n % 10, ranges={"events": ranges},
                records={"written": PARTITIONS, "quarantined": 0, "filtered": 0},
                log_end={"events": {p: args.commits + 100 for p in ranges}}, duration_ms=400))
        print(f"built {args.commits} commits in {time.monotonic() - started:.0f}s; "
              f"checkpoints: {len(list((work / 'events' / '_delta_log').glob('*.checkpoint.parquet')))}")

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
        from oncemore_airflow.ui import templates  # imports Airflow: after the build

        def render():
            data = pipeline_overview(pipeline, detail=True)
            return templates.get_template("pipeline.html").render(**data, charts={}, seconds=0.0, dag_id="x")

        for name, call in (("list page (overview)", lambda: pipeline_overview(pipeline)),
                           ("pipeline page (overview with history, plots' data, quarantine sample)",
                            lambda: pipeline_overview(pipeline, detail=True)),
                           ("pipeline page HTML", render)):
            times = []
            for _ in range(5):
                begin = time.monotonic()
                call()
                times.append(time.monotonic() - begin)
            print(f"{name}: median {statistics.median(times):.3f}s, max {max(times):.3f}s over 5")


if __name__ == "__main__":
    main()
