"""Command line: ``oncemore run | plan | status``.

Progress goes to stderr, results to stdout; a failure exits non-zero with a one-line cause.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from . import kafka
from .config import ConfigError, OffsetBound, Pipeline, format_timestamp_ms, load_pipeline, resolve_config_path
from .kafka import KafkaSourceError
from .ledger import Ledger
from .planner import Plan, PlanError, describe, plan_run
from .sink import CommitConflict, InvalidDataFile

EXIT_FAILURE, EXIT_USAGE = 1, 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    try:
        pipeline = _pipeline(args)
        return args.handler(pipeline, args)
    except (ConfigError, ValueError) as exc:
        print(f"oncemore: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (PlanError, KafkaSourceError, CommitConflict, InvalidDataFile) as exc:
        print(f"oncemore: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # Spark and Kafka failures arrive wrapped; name the root cause
        print(f"oncemore: error: {root_cause(exc)}", file=sys.stderr)
        return EXIT_FAILURE


def root_cause(exc: BaseException) -> str:
    """One line for an exception, digging the Python error out of a Spark task failure."""
    text = str(exc)
    found = re.findall(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception|Conflict)): (.+)$", text, re.M)
    if found:
        name, message = found[-1]
        return f"{name}: {message.strip()}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oncemore", description="Exactly-once batch ingestion from Kafka into Delta Lake.")
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str, handler) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("pipeline", nargs="?", help="pipeline name (a YAML file in the pipelines directory)")
        command.add_argument("--config", type=Path, help="the pipeline's YAML file, instead of a name")
        command.set_defaults(handler=handler)
        return command

    until_help = "where the run ends: latest (default), an ISO-8601 timestamp, or offsets JSON like '{\"0\": 100}'"
    run = add("run", "ingest up to --until and commit exactly once", _run)
    run.add_argument("--until", default="latest", help=until_help)
    run.add_argument("--run-id", help="recorded in the commit metadata (default: generated)")
    run.add_argument("--plan-file", type=Path, help="ingest this plan (JSON from `plan --json`) instead of planning")
    run.add_argument("--master", help="Spark master (default: ONCEMORE_SPARK_MASTER or Spark's default)")
    plan = add("plan", "print what a run would ingest (no Spark)", _plan)
    plan.add_argument("--until", default="latest", help=until_help)
    plan.add_argument("--json", action="store_true", help="machine-readable plan")
    status = add("status", "positions, log bounds and lag per partition", _status)
    status.add_argument("--json", action="store_true")
    return parser


def _pipeline(args) -> Pipeline:
    if args.config is not None:
        pipeline = load_pipeline(args.config)
        if args.pipeline and args.pipeline != pipeline.name:
            raise ConfigError(str(args.config), "name", f"is {pipeline.name!r}, not {args.pipeline!r}")
        return pipeline
    if not args.pipeline:
        raise ConfigError("<command line>", "", "name a pipeline or pass --config FILE")
    return load_pipeline(resolve_config_path(args.pipeline))


def _until(text: str) -> OffsetBound:
    try:
        return OffsetBound.parse(text, allowed=("latest",))
    except ValueError as exc:
        raise ValueError(f"--until {exc}") from None


def _run(pipeline: Pipeline, args) -> int:
    from .runner import run, spark_session

    plan = Plan.from_json(args.plan_file.read_text()) if args.plan_file else None
    if plan is not None and plan.pipeline != pipeline.name:
        raise ValueError(f"--plan-file is for pipeline {plan.pipeline}, not {pipeline.name}")
    report = run(pipeline, _until(args.until), run_id=args.run_id, plan=plan,
                 spark_factory=lambda: spark_session(args.master))
    print(report.summary())
    return 0


def _plan(pipeline: Pipeline, args) -> int:
    plan = plan_run(pipeline, _until(args.until))
    print(plan.to_json() if args.json else describe(plan))
    return 0


def _status(pipeline: Pipeline, args) -> int:
    print(json.dumps(status(pipeline), indent=2) if args.json else format_status(status(pipeline)))
    return 0


def status(pipeline: Pipeline) -> dict:
    topic = pipeline.source.topic
    admin = kafka.admin_client(pipeline)
    partitions = kafka.topic_partitions(admin, pipeline)
    bounds = kafka.log_bounds(admin, pipeline, partitions)
    main = Ledger(pipeline.sink.table_uri, pipeline.name, topic)
    positions = main.committed_positions(partitions)
    quarantine_positions = Ledger(pipeline.sink.quarantine_uri, pipeline.name, topic).committed_positions(partitions)
    last_commit: dict[int, int] = {}
    for entry in main.recent_batches(limit=50):
        for partition in entry.batch.ranges.get(topic, {}):
            last_commit.setdefault(int(partition), entry.timestamp_ms)
    rows = []
    for p in partitions:
        position = positions[p]
        lag = bounds[p].latest - (position if position is not None else bounds[p].earliest)
        rows.append({
            "partition": p,
            "position": position,
            "quarantine_position": quarantine_positions[p],
            "log_start": bounds[p].earliest,
            "log_end": bounds[p].latest,
            "lag": max(lag, 0),
            "last_commit": format_timestamp_ms(last_commit.get(p)) if p in last_commit else None,
        })
    return {"pipeline": pipeline.name, "topic": topic, "table_uri": pipeline.sink.table_uri, "partitions": rows}


def format_status(data: dict) -> str:
    lines = [f"pipeline {data['pipeline']}: topic {data['topic']} -> {data['table_uri']}"]
    header = ("partition", "position", "log_start", "log_end", "lag", "last_commit")
    lines.append("  ".join(f"{h:>12}" for h in header))
    for row in data["partitions"]:
        lines.append("  ".join(f"{str(row[h] if row[h] is not None else '-'):>12}" for h in header))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
