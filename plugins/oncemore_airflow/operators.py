"""Operators of an oncemore DAG: plan (no Spark) >> ingest (spark-submit, or a session on a Spark
Connect server) >> report; and the maintenance DAG's maintain (>> verify).

Thin: the work is the core package's; these only bind it to a run's context. The ingest task
reports its lineage to the OpenLineage provider (lineage.py) after its commits, never before them.
"""

from __future__ import annotations

import json
import tempfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseOperator, TriggerRule
from airflow.sdk.exceptions import AirflowSkipException
from airflow.sdk.log import mask_secret
from croniter import croniter

from oncemore.catalog.registration import register
from oncemore.config.model import Pipeline
from oncemore.config.values import OffsetBound
from oncemore.core import crashpoints
from oncemore.ops.maintain import maintain
from oncemore.plan.planner import LATEST, Plan, describe, plan_run
from oncemore.report.landed import run_landed
from oncemore.report.status import check_freshness
from oncemore.report.verdict import last_result
from oncemore.run.session import package_zip, spark_session, stop_session
from oncemore_airflow.hooks import OncemoreHook

SPARK_JOB = Path(__file__).resolve().parents[2] / "spark_jobs" / "ingest.py"
VERIFY_JOB = SPARK_JOB.with_name("verify.py")
PLAN_XCOM_KEY = "plan"


def run_until(param: str | None, interval_start: datetime | None, interval_end: datetime | None) -> OffsetBound:
    """Where a DAG run ends: the ``until`` param when given; else the end of the run's data
    interval; else (a manual run without one) the log end."""
    if param not in (None, ""):
        return OffsetBound.parse(param, allowed=("latest",))
    if interval_end is not None and interval_start != interval_end:
        return OffsetBound(kind="timestamp", timestamp_ms=int(interval_end.timestamp() * 1000))
    return LATEST


class OncemorePlanOperator(BaseOperator):
    """Plans the run and pushes the plan (JSON) to XCom key ``plan``. The ingest task skips itself,
    with no Spark, when the plan is empty or the run is a dry run: a rerun of finished work costs
    one ledger read."""

    ui_color = "#e8f4fd"

    def __init__(self, *, config_path: str, kafka_conn_id: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.config_path, self.kafka_conn_id = config_path, kafka_conn_id

    def execute(self, context) -> None:
        params = context["params"]
        until = run_until(params.get("until"), context.get("data_interval_start"), context.get("data_interval_end"))
        plan = plan_run(OncemoreHook(self.config_path, self.kafka_conn_id).get_pipeline(), until)
        self.log.info("%s", describe(plan))
        context["ti"].xcom_push(key=PLAN_XCOM_KEY, value=plan.to_json())


class IngestTask:
    """What both ingest operators share: the plan task's plan (an empty one, or a dry run, skips
    the task before any Spark), the run's report as the task's XCom (``oncemore run
    --report-file``'s JSON: no Kafka address or setting), and the task's lineage for the
    OpenLineage provider, read after the run's commits (lineage.py)."""

    config_path: str
    kafka_conn_id: str | None
    plan_task_id: str
    _lineage = None  # the OperatorLineage of the task's COMPLETE event, once gathered

    def pipeline(self) -> Pipeline:
        if getattr(self, "_pipeline", None) is None:
            self._pipeline = OncemoreHook(self.config_path, self.kafka_conn_id).get_pipeline()
        return self._pipeline

    def planned(self, context) -> tuple[str, Plan]:
        """The plan to run, as JSON and parsed; an empty plan or a dry run ends the task as skipped.
        An empty plan first registers the tables in the pipeline's catalog, as a no-op ``oncemore
        run`` does: a registration an earlier run could not make is retried by the next run, data
        or none (DESIGN.md 8); a catalog that still refuses fails the task, naming its error."""
        text = context["ti"].xcom_pull(task_ids=self.plan_task_id, key=PLAN_XCOM_KEY)
        plan = Plan.from_json(text)
        dry_run = bool(context["params"].get("dry_run"))
        if plan.is_empty and not dry_run and self.pipeline().sink.catalog is not None:
            register(self.pipeline())
        if plan.is_empty or dry_run:
            self.gather_lineage(plan, context["run_id"], None, dry_run)
            raise AirflowSkipException("dry run: nothing is committed" if dry_run else "nothing to ingest")
        return text, plan

    def landed(self, plan: Plan, run_id: str, report) -> dict[str, Any]:
        """The run's report, logged and returned (to XCom); its lineage gathered."""
        self.log.info("%s", report.summary())
        self.gather_lineage(plan, run_id, report)
        return json.loads(report.to_json())

    def gather_lineage(self, plan: Plan, run_id: str, report, dry_run: bool = False) -> None:
        """Reads what the task's COMPLETE event carries, when OpenLineage emits at all. A failure
        is a warning: the commits stand, and their record in the table's log keeps every fact."""
        try:
            from oncemore_airflow.lineage import lineage_enabled, run_lineage

            if lineage_enabled():
                self._lineage = run_lineage(self.pipeline(), plan, run_id, report, dry_run)
        except Exception as exc:  # noqa: BLE001 (lineage never fails a run that committed)
            self.log.warning("pipeline %s: run %s: its lineage could not be gathered, the event goes without it (the "
                             "run's commits stand; the table's log records them): %s", plan.pipeline, run_id, exc)

    def get_openlineage_facets_on_start(self):
        from oncemore_airflow.lineage import start_lineage

        return start_lineage(self.pipeline())

    def get_openlineage_facets_on_complete(self, task_instance):
        return self._lineage


class OncemoreIngestOperator(IngestTask, SparkSubmitOperator):
    """spark-submit of ``spark_jobs/ingest.py`` with the plan task's plan; the job checks it
    against the table's positions and the topic before reading, and again before each commit. A
    run that fails (a batch over the quarantine limit among other causes) exits non-zero, and so
    the task fails; param ``accept_quarantine`` is the run's ``--accept-quarantine``.

    The plan travels in a file (a plan of many partitions and batches outgrows a command-line
    argument), the core package as --py-files, and Kafka settings from the connection in a file
    only the task's user can read: never in ``env_vars``, which the Spark provider turns into
    ``--conf spark.yarn.appMasterEnv.*``/``spark.kubernetes.driverEnv.*`` on the command line.
    The run's report comes back in a file beside them. The driver runs here (client mode: the
    plan, settings and report files are local)."""

    def __init__(self, *, config_path: str, kafka_conn_id: str | None = None, plan_task_id: str = "plan", **kwargs):
        super().__init__(application=str(SPARK_JOB), **kwargs)
        self.config_path, self.kafka_conn_id, self.plan_task_id = config_path, kafka_conn_id, plan_task_id

    def execute(self, context) -> dict[str, Any]:
        from oncemore.run.runreport import RunReport

        crashpoints.arm()  # test-only, inert unless set: a step kills this task and its spark-submit
        text, plan = self.planned(context)
        self.py_files = package_zip()
        overrides = OncemoreHook(self.config_path, self.kafka_conn_id).kafka_overrides()
        with tempfile.TemporaryDirectory(prefix="oncemore-plan-") as directory:  # mode 0700
            plan_file, report_file = Path(directory) / "plan.json", Path(directory) / "report.json"
            plan_file.write_text(text)
            self.application_args = ["--config", self.config_path, "--plan-file", str(plan_file),
                                     "--run-id", context["run_id"], "--report-file", str(report_file)]
            if context["params"].get("accept_quarantine"):
                self.application_args.append("--accept-quarantine")
            if overrides:
                overrides_file = Path(directory) / "kafka.json"
                overrides_file.touch(mode=0o600)
                overrides_file.write_text(json.dumps(overrides))
                self.application_args += ["--kafka-overrides-file", str(overrides_file)]
            super().execute(context)
            report = RunReport.from_json(report_file.read_text(), plan)
        return self.landed(plan, context["run_id"], report)


class OncemoreConnectIngestOperator(IngestTask, BaseOperator):
    """The plan task's plan run on a resident Spark: this task is the run's client (it checks the
    plan, commits a part the sink does not commit on the server's driver, and logs the report);
    the Spark Connect server named by ``spark_connect_conn_id`` (the Spark provider's
    ``SparkConnectHook`` connection) reads, decodes and writes. No JVM starts here. The
    connection's URL carries its token: it goes to PySpark's client only, never to a log or XCom."""

    def __init__(self, *, config_path: str, spark_connect_conn_id: str, kafka_conn_id: str | None = None,
                 plan_task_id: str = "plan", **kwargs):
        super().__init__(**kwargs)
        self.config_path, self.kafka_conn_id, self.plan_task_id = config_path, kafka_conn_id, plan_task_id
        self.spark_connect_conn_id = spark_connect_conn_id

    def execute(self, context) -> dict[str, Any]:
        from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

        from oncemore.run.runner import run  # the run's whole client side: not for the DAG processor to import

        crashpoints.arm()  # test-only, inert unless set: a step kills this task

        _, plan = self.planned(context)
        hook = SparkConnectHook(self.spark_connect_conn_id)
        token = hook.get_connection(self.spark_connect_conn_id).password
        if token:  # masked as given and as the URL quotes it
            mask_secret(token)
            mask_secret(quote(token))
        url = hook.get_connection_url()
        sessions = []  # at most one, opened only when the plan has work

        def session():
            sessions.append(spark_session(remote=url))
            return sessions[-1]

        try:
            report = run(self.pipeline(), run_id=context["run_id"], plan=plan, spark_factory=session,
                         accept_quarantine=bool(context["params"].get("accept_quarantine")))
        finally:
            for opened in sessions:
                stop_session(opened)  # the server keeps running, and the session for the next run
        return self.landed(plan, context["run_id"], report)


class OncemoreReportOperator(BaseOperator):
    """Reads the run back from the table: fails loudly if the planned ranges are not committed, or
    if the pipeline ends beyond its ``alert`` limits (so Airflow's failure callbacks and emails
    fire), naming the partition; returns records written/quarantined, positions and lag."""

    def __init__(self, *, config_path: str, kafka_conn_id: str | None = None, plan_task_id: str = "plan", **kwargs):
        kwargs.setdefault("trigger_rule", TriggerRule.NONE_FAILED)  # also after a skipped ingest
        super().__init__(**kwargs)
        self.config_path, self.kafka_conn_id, self.plan_task_id = config_path, kafka_conn_id, plan_task_id

    def execute(self, context) -> dict[str, Any]:
        plan = Plan.from_json(context["ti"].xcom_pull(task_ids=self.plan_task_id, key=PLAN_XCOM_KEY))
        pipeline = OncemoreHook(self.config_path, self.kafka_conn_id).get_pipeline()
        if context["params"].get("dry_run"):
            self.log.info("dry run: nothing was committed; the plan was:\n%s", describe(plan))
            return {"pipeline": pipeline.name, "status": "dry-run", "plan": json.loads(plan.to_json())}
        result = run_landed(pipeline, plan, context["run_id"])
        self.log.info("%s", json.dumps(result, indent=2))
        check_freshness(pipeline, result["partitions"])
        return result


class OncemoreMaintainOperator(BaseOperator):
    """Compacts, checkpoints and vacuums the pipeline's tables (``oncemore maintain``); returns
    what was done per table."""

    ui_color = "#f4f1e8"

    def __init__(self, *, config_path: str, kafka_conn_id: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.config_path, self.kafka_conn_id = config_path, kafka_conn_id

    def execute(self, context) -> dict[str, Any]:
        done = maintain(OncemoreHook(self.config_path, self.kafka_conn_id).get_pipeline())
        self.log.info("%s", json.dumps(done, indent=2))
        return done


class OncemoreVerifyOperator(SparkSubmitOperator):
    """``oncemore verify --record`` through spark-submit (``spark_jobs/verify.py``), when a time of
    ``verify_cron`` falls in this maintenance run's data interval or the run was triggered by
    hand; skipped otherwise. Fails on any discrepancy (the job exits 1); the result is recorded
    beside the table either way, for the oncemore page, and returned. Reads the tables only: no
    Kafka setting reaches it."""

    ui_color = "#e8f1f4"

    def __init__(self, *, config_path: str, verify_cron: str, **kwargs):
        super().__init__(application=str(VERIFY_JOB), **kwargs)
        self.config_path, self.verify_cron = config_path, verify_cron

    def execute(self, context) -> dict[str, Any]:
        start, end = context["data_interval_start"], context["data_interval_end"]
        if context["dag_run"].run_type != "manual" and not verify_due(self.verify_cron, start, end):
            raise AirflowSkipException(f"no time of verify {self.verify_cron!r} in [{start}, {end})")
        self.py_files = package_zip()
        self.application_args = ["--config", self.config_path, "--record"]
        super().execute(context)
        return last_result(OncemoreHook(self.config_path).get_pipeline())


def verify_due(cron: str, start: datetime | None, end: datetime | None) -> bool:
    """Whether a time of ``cron`` falls in the data interval [start, end) (an empty one: yes)."""
    if start is None or end is None or start >= end:
        return True
    return croniter(cron, start - timedelta(microseconds=1)).get_next(datetime) < end
