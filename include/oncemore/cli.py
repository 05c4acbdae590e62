"""Command line: ``oncemore run | plan | status``.

Progress goes to stderr, results to stdout; a failure exits non-zero with a one-line cause.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

from .config import (
    ConfigError, OffsetBound, Pipeline, load_pipeline, resolve_config_path, with_kafka_overrides,
)
from .kafka import KafkaSourceError
from .planner import Plan, PlanError, describe, plan_run
from .report import format_status, status
from .sink import CommitConflict, InvalidDataFile

EXIT_FAILURE, EXIT_USAGE = 1, 2
KAFKA_OVERRIDES_ENV = "ONCEMORE_KAFKA_OVERRIDES"


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
    run.add_argument("--plan", help="ingest this plan (the JSON `plan --json` prints) instead of planning")
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
    elif args.pipeline:
        pipeline = load_pipeline(resolve_config_path(args.pipeline))
    else:
        raise ConfigError("<command line>", "", "name a pipeline or pass --config FILE")
    # Kafka settings from an Airflow connection reach Spark jobs this way, never on a command line.
    overrides = os.environ.get(KAFKA_OVERRIDES_ENV)
    if overrides:
        try:
            pipeline = with_kafka_overrides(pipeline, json.loads(overrides))
        except json.JSONDecodeError as exc:
            raise ConfigError(KAFKA_OVERRIDES_ENV, "", f"not valid JSON: {exc}") from None
    return pipeline


def _until(text: str) -> OffsetBound:
    try:
        return OffsetBound.parse(text, allowed=("latest",))
    except ValueError as exc:
        raise ValueError(f"--until {exc}") from None


def _run(pipeline: Pipeline, args) -> int:
    from .runner import run, spark_session

    plan = Plan.from_json(args.plan) if args.plan else None
    if plan is not None and plan.pipeline != pipeline.name:
        raise ValueError(f"--plan is for pipeline {plan.pipeline}, not {pipeline.name}")
    report = run(pipeline, _until(args.until), run_id=args.run_id, plan=plan,
                 spark_factory=lambda: spark_session(args.master))
    print(report.summary())
    return 0


def _plan(pipeline: Pipeline, args) -> int:
    plan = plan_run(pipeline, _until(args.until))
    print(plan.to_json() if args.json else describe(plan))
    return 0


def _status(pipeline: Pipeline, args) -> int:
    data = status(pipeline)
    print(json.dumps(data, indent=2) if args.json else format_status(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
