"""Command line: ``oncemore run | plan | status | reset | resequence | maintain | delete | verify | check | list | schema``.

Progress goes to stderr, results to stdout; a failure exits non-zero with a one-line cause.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from oncemore import __version__
from oncemore.config.loading import broken_line, load_all, load_named, load_pipeline, shared_tables, with_kafka_overrides
from oncemore.config.model import Pipeline, json_schema
from oncemore.config.values import ConfigError, OffsetBound
from oncemore.core import crashpoints
from oncemore.core.coordinates import nested
from oncemore.core.errors import OncemoreError, interrupted_by, root_cause
from oncemore.core.stopwatch import as_table
from oncemore.kafka.clients import CLIENT_LOG, KafkaReadError, KafkaSourceError
from oncemore.plan.planner import Plan, describe, plan_run
from oncemore.report.status import format_status, status

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130  # 130: a shell's code for a command ended by Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    crashpoints.arm()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    # A line per gateway call or registry request (confluent-kafka's client logs through httpx2) is not oncemore's.
    for chatty in ("py4j", "httpx", "httpx2"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    logging.getLogger(CLIENT_LOG.name).setLevel(logging.CRITICAL)
    try:
        pipeline = _pipeline(args) if "pipeline" in args and (args.pipeline or args.config or args.handler is not _status) else None
        code = args.handler(pipeline, args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # our reader went away (`status --json | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # or Python's flush at exit fails again
        return EXIT_FAILURE
    except KeyboardInterrupt:  # `run` says what it had committed; a command that writes nothing has no more to say
        print("oncemore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, ValueError) as exc:
        print(f"oncemore: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OncemoreError, KafkaSourceError, KafkaReadError) as exc:
        print(f"oncemore: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # Spark and Kafka failures arrive wrapped; name the root cause
        print(f"oncemore: error: {root_cause(exc)}", file=sys.stderr)
        return EXIT_FAILURE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oncemore", description="Exactly-once batch ingestion from Kafka into Delta Lake.")
    parser.add_argument("--version", action="version", version=f"oncemore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str, handler) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("pipeline", nargs="?", help="pipeline name (a YAML file in the pipelines directory)")
        command.add_argument("--config", type=Path, help="the pipeline's YAML file, instead of a name")
        command.set_defaults(handler=handler)
        return command

    until_help = ("where the run ends: latest (default), an ISO-8601 timestamp, or offsets JSON like "
                  "'{\"orders\": {\"0\": 100}}' ('{\"0\": 100}' for a pipeline of one topic)")
    run = add("run", "ingest up to --until and commit exactly once", _run)
    run.add_argument("--until", default="latest", help=until_help)
    run.add_argument("--run-id", help="recorded in the commit metadata (default: generated)")
    run.add_argument("--plan-file", type=Path,
                     help="ingest the plan in this file (what `plan --json` prints) instead of planning")
    _spark_options(run)
    run.add_argument("--profile", action="store_true",
                     help="print where the run's time went, per phase (planning, Spark start, read, decode, write, "
                          "commit, ...)")
    run.add_argument("--accept-quarantine", action="store_true",
                     help="commit batches over the pipeline's quarantine limit (with --until: only the one a run named)")
    run.add_argument("--kafka-overrides-file", type=Path,
                     help="JSON {bootstrap_servers, kafka_options} replacing the config's (an Airflow connection's)")
    run.add_argument("--report-file", type=Path, help="also write what the run committed to this file (JSON)")
    plan = add("plan", "print what a run would ingest (no Spark)", _plan)
    plan.add_argument("--until", default="latest", help=until_help)
    plan.add_argument("--json", action="store_true", help="machine-readable plan")
    status = add("status", "positions, log bounds and lag per partition; with no pipeline, a line per pipeline", _status)
    status.add_argument("--json", action="store_true", help="the same, machine-readable")
    reset = add("reset", "set the pipeline's positions deliberately (a commit recording old and new)", _reset)
    reset.add_argument("--to", required=True,
                       help="earliest, latest, an ISO-8601 timestamp, or offsets JSON like "
                            "'{\"orders\": {\"0\": 100}}' ('{\"0\": 100}' for a pipeline of one topic; unnamed "
                            "partitions keep their position)")
    reset.add_argument("--topic", action="append", default=[], dest="topics", metavar="TOPIC",
                       help="reset only this topic's partitions (repeatable; default: every topic of the pipeline)")
    reset.add_argument("--dry-run", action="store_true", help="check and print the new positions, commit nothing")
    reset.add_argument("--take-over", action="store_true",
                       help="take the topic over in a table where another pipeline ingests it (that pipeline's "
                            "runs are refused from then on)")
    add("resequence", "accept a changed upsert.sequence_by (rows held lose their sequences, held deletes are forgotten)",
        _resequence)
    add("maintain", "compact small files, checkpoint and vacuum the pipeline's tables (an upsert's tombstones table "
                    "too, past its retention forgotten)", _maintain)
    delete = add("delete", "delete rows from the pipeline's tables by a predicate, each commit recording the "
                           "offsets removed (verify accounts for them)", _delete)
    delete.add_argument("--where", required=True, metavar="SQL",
                        help="the rows to delete: a SQL predicate over the table's columns (DataFusion's dialect, as "
                             "delta-rs evaluates it), e.g. \"customer_id = 42\"")
    delete.add_argument("--dry-run", action="store_true", help="print what would be deleted, commit nothing")
    verify = add("verify", "audit exactly-once from the tables alone: every committed offset in a table once "
                           "(an upsert table: no key twice, every commit's record accounting for its records), no row "
                           "outside a committed range, history contiguous, positions as committed (exit 1 on any "
                           "discrepancy)", _verify)
    verify.add_argument("--since", type=int, metavar="VERSION",
                        help="check the row counts of the commits from this table version on (rows and history are "
                             "checked over every commit the log keeps)")
    verify.add_argument("--replay", action="store_true",
                        help="an upsert table: also read the committed ranges again from Kafka and compare the table "
                             "with their last event per key (exit 1 when Kafka no longer holds a committed range)")
    verify.add_argument("--json", action="store_true", help="the whole report, machine-readable")
    verify.add_argument("--record", action="store_true",
                        help="keep the result beside the table for the oncemore page (the maintenance DAG's verify "
                             "task does)")
    _spark_options(verify)
    check = commands.add_parser("check", help="preflight: each pipeline's config, then its brokers, topics, schema "
                                               "registry and table locations, one line per check (exit 1 on any "
                                               "failure; nothing is written)")
    check.add_argument("targets", nargs="*", metavar="PIPELINE | FILE",
                       help="pipeline names or YAML files (default: every file of the pipelines directory)")
    check.add_argument("--config", action="append", default=[], help="a pipeline's YAML file of any name (repeatable)")
    check.add_argument("--sample", type=int, metavar="N",
                       help="also read the latest N offsets of each partition through the formats, the transform and "
                            "the expectations, and print what a run would quarantine and why (nothing is written)")
    _spark_options(check)  # Spark analyses a transform: started only for a pipeline that has one
    check.set_defaults(handler=_check)
    listing = commands.add_parser("list", help="the pipelines of the pipelines directory, and the files that do not "
                                               "load (exit 1 if any)")
    listing.set_defaults(handler=_list)
    schema = commands.add_parser("schema", help="print the JSON Schema of pipeline files (for editors)")
    schema.set_defaults(handler=_schema)
    return parser


def _spark_options(command: argparse.ArgumentParser) -> None:
    where = command.add_mutually_exclusive_group()
    where.add_argument("--master", help="Spark master (default: SPARK_REMOTE's server, else ONCEMORE_SPARK_MASTER, "
                                        "else Spark's default)")
    where.add_argument("--remote", help="a Spark Connect server, sc://host:15002 (default: SPARK_REMOTE)")
    command.add_argument("--verbose", action="store_true",
                         help="show Spark's own output here (by default it goes to a file, named if the command fails)")


def _pipeline(args) -> Pipeline:
    if args.config is not None:
        pipeline = load_pipeline(args.config)
        if args.pipeline and args.pipeline != pipeline.name:
            raise ConfigError(str(args.config), "name", f"is {pipeline.name!r}, not {args.pipeline!r}")
    elif args.pipeline:
        pipeline = load_named(args.pipeline)
    else:
        raise ConfigError("<command line>", "", "name a pipeline or pass --config FILE")
    # Kafka settings from an Airflow connection reach Spark jobs in a file: never on a command
    # line, in an environment Spark copies into its conf (spark.yarn.appMasterEnv.*), or a log.
    overrides_file = getattr(args, "kafka_overrides_file", None)
    if overrides_file is not None:
        try:
            pipeline = with_kafka_overrides(pipeline, json.loads(overrides_file.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(str(overrides_file), "", f"not readable JSON: {type(exc).__name__}") from None
    return pipeline


def _until(text: str) -> OffsetBound:
    try:
        return OffsetBound.parse(text, allowed=("latest",))
    except ValueError as exc:
        raise ValueError(f"--until {exc}") from None


@contextmanager
def _spark_for(name: str, args) -> Iterator[Callable]:
    """A factory of the command's Spark session (``--master``/``--remote``), started at its first call,
    the same after; stopped (a Connect one kept for the next run) at the end. Spark's own output (JVM
    warnings, its log, PySpark's JSON error logs, its libraries' Python warnings) goes to a file named
    after ``name`` unless --verbose, named if the command fails. Files older than LOG_DAYS go."""
    spark_log = None if args.verbose else _log_file(name)
    if spark_log is not None:
        warnings_log = logging.getLogger("py.warnings")
        warnings_log.addHandler(logging.FileHandler(spark_log, delay=True))  # no file for a run without warnings
        warnings_log.propagate = False
        logging.captureWarnings(True)
    if args.remote and ";token=" in args.remote.lower():
        raise ConfigError("<command line>", "--remote", "carries a token, which every user's process list shows: "
                                                        "put the URL in SPARK_REMOTE instead")
    sessions = []

    def spark():
        if not sessions:
            from oncemore.run.session import log_to, spark_session

            sessions.append(spark_session(args.master, args.remote, output=spark_log))
            if spark_log is not None:
                log_to(spark_log)
            if threading.current_thread() is threading.main_thread():
                # PySpark's own handler asks the JVM to cancel its jobs; a Ctrl-C has stopped the JVM
                # too (one process group), and that call's errors would replace the interrupt.
                signal.signal(signal.SIGINT, signal.default_int_handler)
        return sessions[0]

    interrupted = False
    try:
        yield spark
    except (Exception, KeyboardInterrupt) as exc:
        # On a Ctrl-C's way out PySpark resets its call site through the gateway connection py4j has
        # just shut, and that error takes the interrupt's place: it is the interrupt all the same.
        interrupted = interrupted_by(exc)
        if interrupted and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt from exc
        if not interrupted and spark_log is not None and spark_log.exists():
            print(f"oncemore: Spark's output is in {spark_log}", file=sys.stderr)
        raise
    finally:
        if sessions:
            from oncemore.run.session import stop_session

            try:
                stop_session(sessions[0])  # a Connect server keeps the session for this host's next run
            except Exception as exc:
                if not interrupted:  # a Ctrl-C while it stopped is the interrupt, as above
                    raise KeyboardInterrupt if interrupted_by(exc) else exc


LOG_DAYS = 7  # days a command's Spark output is kept in $TMPDIR/oncemore-logs


def _log_file(name: str) -> Path:
    """This command's file for Spark's output; the directory's files older than LOG_DAYS go."""
    directory = Path(tempfile.gettempdir(), "oncemore-logs")
    directory.mkdir(parents=True, exist_ok=True)
    cutoff = time.time() - LOG_DAYS * 86400
    for old in directory.glob("*.log"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another command removed it first
            pass
    return directory / f"{name}-{os.getpid()}.log"


def _run(pipeline: Pipeline, args) -> int:
    from oncemore.run.runner import new_run_id, run
    from oncemore.run.runreport import committed_by

    plan = Plan.from_json(args.plan_file.read_text()) if args.plan_file else None
    run_id = args.run_id or new_run_id()
    try:
        with _spark_for(pipeline.name, args) as spark:
            report = run(pipeline, _until(args.until), run_id=run_id, plan=plan, spark_factory=spark,
                         accept_quarantine=args.accept_quarantine)
    except KeyboardInterrupt:
        print(f"oncemore: interrupted: {committed_by(pipeline, run_id)}; a rerun carries on from the table's "
              "positions", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.report_file:
        args.report_file.write_text(report.to_json())
    print(report.summary())
    if args.profile:
        print(as_table(report.profile, report.seconds))
    return 0


def _verify(pipeline: Pipeline, args) -> int:
    from oncemore.report.verdict import record_result
    from oncemore.report.verify import verify

    with _spark_for(pipeline.name, args) as spark:
        report = verify(pipeline, spark, since=args.since, replay=args.replay)
    if args.record:
        record_result(pipeline, report)
    print(report.to_json() if args.json else report.describe())
    return 0 if report.ok else EXIT_FAILURE


def _plan(pipeline: Pipeline, args) -> int:
    plan = plan_run(pipeline, _until(args.until))
    print(plan.to_json() if args.json else describe(plan))
    return 0


def _status(pipeline: Pipeline | None, args) -> int:
    if pipeline is None:  # every pipeline of the directory, a line each; exit 1 naming those that fail
        from oncemore.report.fleet import print_every_pipeline
        return EXIT_FAILURE if print_every_pipeline(as_json=args.json) else 0
    data = status(pipeline)
    print(json.dumps(data, indent=2) if args.json else format_status(data))
    return 0


def _reset(pipeline: Pipeline, args) -> int:
    from oncemore.ops.reset import reset

    try:
        to = OffsetBound.parse(args.to)
    except ValueError as exc:
        raise ValueError(f"--to {exc}") from None
    done = reset(pipeline, to, take_over=args.take_over, topics=args.topics, dry_run=args.dry_run)
    moves = f"from {json.dumps(nested(done['from']))} to {json.dumps(nested(done['to']))}"
    if args.dry_run:
        print(f"{pipeline.name}: positions would be reset {moves} (dry run: nothing committed)")
    else:
        print(f"{pipeline.name}: positions reset {moves} (versions: {json.dumps(done['versions'])})")
    return 0


def _resequence(pipeline: Pipeline, _args) -> int:
    from oncemore.ops.resequence import resequence

    print(json.dumps(resequence(pipeline), indent=2))
    return 0


def _delete(pipeline: Pipeline, args) -> int:
    from oncemore.ops.delete import delete

    done = delete(pipeline, args.where, dry_run=args.dry_run)
    for role, table in done["tables"].items():
        offsets = f" at offsets {json.dumps(table['offsets'])}" if table.get("offsets") else ""
        version = f" (table version {table['version']})" if table.get("status") == "deleted" else ""
        print(f"{pipeline.name}: {role} table: {table['status']}{version}, {table['rows']} rows{offsets}")
    return 0


def _maintain(pipeline: Pipeline, _args) -> int:
    from oncemore.ops.maintain import maintain

    print(json.dumps(maintain(pipeline), indent=2))
    return 0


def _list(_pipeline: None, _args) -> int:
    pipelines, broken = load_all()
    for pipeline in pipelines:
        tables = ", ".join(t.describe() for t in pipeline.tables)  # the main table, or each route's: "uri (route v)"
        print(f"{pipeline.name}: {pipeline.source.describe_subscription()} -> {tables} ({pipeline.origin})")
    for path, problem in sorted(broken.items()):
        print(broken_line(path, problem))
    return EXIT_FAILURE if broken else 0


def _check(_pipeline: None, args) -> int:
    from oncemore.ops.check import Check, check_pipeline

    if args.sample is not None and args.sample < 1:
        raise ValueError(f"--sample {args.sample}: read at least 1 offset of each partition")
    loaded, checks = [], []
    directory, broken = load_all()
    # A target is a file when it looks like one; --config names a file of any name.
    targets = [(t, t.endswith((".yaml", ".yml")) or os.sep in t) for t in args.targets] + [(c, True) for c in args.config]
    if targets:
        for target, is_file in targets:
            try:
                loaded.append(load_pipeline(Path(target)) if is_file else load_named(target))
            except ConfigError as exc:
                checks.append(Check(exc.source, "config", exc.summary))
        # A file outside the directory may still name a table of a pipeline in it.
        named = {Path(t.origin).resolve() for t in loaded}
        others = [p for p in directory if Path(p.origin).resolve() not in named]
        shared = shared_tables(loaded + others)
        checks += [Check(p.origin, "config", shared[p.origin].summary) for p in loaded if p.origin in shared]
        loaded = [p for p in loaded if p.origin not in shared]
    else:
        loaded = directory
        checks += [Check(e.source, "config", e.summary) for e in broken.values()]
    for check in checks:
        print(check.line(), flush=True)
    with _spark_for("check", args) as spark:
        for pipeline in loaded:
            for check in check_pipeline(pipeline, spark, sample=args.sample):
                checks.append(check)
                print(check.line(), flush=True)
    return 0 if all(c.ok for c in checks) else EXIT_FAILURE


def _schema(_pipeline: None, _args) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
