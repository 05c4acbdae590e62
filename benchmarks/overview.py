"""How long the oncemore page takes to read a pipeline whose table has many commits: builds a
table of N oncemore batch commits (positions and batch records, as ingestion writes them; no data
files, which the page never reads) on a local Apache Kafka broker's topic, then times the
overview of the list page and of the pipeline page, and the pipeline page's HTML. With
``--pipelines N``, instead: N pipelines on 4 topics of one broker (devtools/fleet.py: small
tables of a few commits, every tenth pipeline never run), and the time of the index page's server
side (the directory loaded, every pipeline's row read, the HTML rendered), its first view (each
table opened) and later ones, with the HTML's size; and of ``oncemore status`` with no pipeline.

    scripts/benchmark overview [--commits 5000]
    scripts/benchmark overview --pipelines 100

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
    parser.add_argument("--pipelines", type=int, help="time the index page of this many pipelines instead")
    args = parser.parse_args()
    if args.pipelines:
        return index_page(args.pipelines)
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


def index_page(count: int) -> None:
    import os
    import subprocess

    from devtools.fleet import write_fleet
    from oncemore.config.loading import load_all
    from oncemore.report import fleet

    work = Path(tempfile.mkdtemp(prefix="oncemore-index-"))
    topics = {f"fleet_{t}": 3 for t in range(4)}
    with kafkabroker.running(kafkabroker.start_kafka()) as broker:
        for topic, partitions in topics.items():
            broker.create_topic(topic, partitions)
            broker.produce(topic, [(i % partitions, None, b"{}", None) for i in range(100 * partitions)])
        started = time.monotonic()
        write_fleet(work / "pipelines", work / "delta", broker.bootstrap_servers, topics, count)
        print(f"built {count} pipelines in {time.monotonic() - started:.0f}s")
        os.environ["ONCEMORE_PIPELINES_DIR"] = str(work / "pipelines")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
        from oncemore_airflow.ui import templates  # imports Airflow: after the build

        def view() -> str:
            pipelines, broken = load_all()
            found = fleet.overviews(pipelines)
            for data in found:
                data["dag_id"] = f"oncemore__{data['pipeline']}"
            return templates.get_template("index.html").render(
                pipelines=found, tags=sorted({t for d in found for t in d["row"]["tags"]}), broken_configs=broken,
                seconds=0.0)

        begin = time.monotonic()
        html = view()
        print(f"index page, {count} pipelines, first view (every table opened): {time.monotonic() - begin:.3f}s, "
              f"{len(html.encode()) / 1024:.0f} KB of HTML")
        times = []
        for _ in range(5):
            begin = time.monotonic()
            view()
            times.append(time.monotonic() - begin)
        print(f"index page, {count} pipelines, later views: median {statistics.median(times):.3f}s, "
              f"max {max(times):.3f}s over 5")
        begin = time.monotonic()
        shown = subprocess.run([sys.executable, "-m", "oncemore.cli", "status"], capture_output=True, text=True,
                               env=os.environ, check=True)
        print(f"oncemore status (every pipeline, a process of its own): {time.monotonic() - begin:.3f}s, "
              f"{len(shown.stdout.splitlines()) - 1} lines")


if __name__ == "__main__":
    main()
