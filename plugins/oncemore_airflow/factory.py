"""DAGs per pipeline config: ``oncemore__<pipeline>`` (plan >> ingest >> report) and, for a
pipeline with a ``maintenance`` block, ``oncemore_maintain__<pipeline>`` (maintain, then verify
when ``maintenance.verify`` sets its schedule)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from airflow.sdk import DAG, Asset, Param
from airflow.timetables.interval import CronDataIntervalTimetable

from oncemore.config.loading import load_all
from oncemore.config.model import Pipeline
from oncemore.config.values import ConfigError
from oncemore.core.storage import table_location
from oncemore_airflow.operators import (
    OncemoreConnectIngestOperator,
    OncemoreIngestOperator,
    OncemoreMaintainOperator,
    OncemorePlanOperator,
    OncemoreReportOperator,
    OncemoreVerifyOperator,
)

UNTIL_PATTERN = r"^\s*(latest|\d{4}-\d{2}-\d{2}[T ][0-9:.]+(Z|[+-]\d{2}:?\d{2})?|\{.*\})\s*$"


def dag_id(pipeline_name: str) -> str:
    return f"oncemore__{pipeline_name}"


def maintenance_dag_id(pipeline_name: str) -> str:
    return f"oncemore_maintain__{pipeline_name}"


def table_assets(pipeline: Pipeline) -> list[Asset]:
    """The ingest task's outlets: an Asset per table records land in, the main table's
    (``oncemore/<pipeline>``) or each route's (``oncemore/<pipeline>/<route>``)."""
    assets = []
    for table in pipeline.tables:
        location = table_location(table.table_uri)
        name = f"oncemore/{pipeline.name}" + ("" if table.route is None else f"/{table.route}")
        assets.append(Asset(name=name, uri=location if "://" in location else f"file://{location}"))
    return assets


def check_schedulable(pipeline: Pipeline) -> None:
    if pipeline.airflow is None:
        raise ConfigError(pipeline.origin, "airflow", "is missing: Airflow makes a DAG of a pipeline with an airflow "
                                                      "block (airflow.start_date, and schedule)")


def build_dag(pipeline: Pipeline) -> DAG:
    check_schedulable(pipeline)
    settings = pipeline.airflow
    common = {"config_path": str(Path(pipeline.origin).resolve()), "kafka_conn_id": settings.kafka_conn_id}
    spark = _spark_pool(pipeline)
    with DAG(
        dag_id=dag_id(pipeline.name),
        # Data intervals: the run for [11:00, 12:00) starts after 12:00 and ingests up to the
        # offsets at 12:00. A plain cron string would give zero-length intervals in Airflow 3.
        schedule=CronDataIntervalTimetable(settings.schedule, timezone="UTC"),
        start_date=datetime.fromtimestamp(settings.start_date_ms / 1000, tz=timezone.utc),
        end_date=settings.end_date,
        catchup=settings.catchup,
        max_active_runs=settings.max_active_runs,
        tags=["oncemore", *settings.tags],
        default_args={
            "owner": settings.owner,
            "retries": settings.retries,
            "retry_delay": timedelta(minutes=settings.retry_delay_minutes),
            "retry_exponential_backoff": True,
        },
        params={
            "until": Param(
                None, type=["null", "string"], pattern=UNTIL_PATTERN,
                description="Where this run ends: latest, an ISO-8601 timestamp, or per-partition offsets "
                            'like {"0": 1200, "1": 900}. Empty: the end of the run\'s data interval, or '
                            "latest for a manual run without one.",
            ),
            "dry_run": Param(False, type="boolean", description="Only compute and show the plan; commit nothing."),
            "accept_quarantine": Param(
                False, type="boolean",
                description="Commit batches that quarantine more than the pipeline's quarantine limit (a failed "
                            "run names its batch; set until to that batch's offsets to accept only it)."),
        },
        doc_md=_doc(pipeline),
    ) as dag:
        plan = OncemorePlanOperator(task_id="plan", **common)
        if settings.spark_connect_conn_id:
            ingest = OncemoreConnectIngestOperator(task_id="ingest", spark_connect_conn_id=settings.spark_connect_conn_id,
                                                   outlets=table_assets(pipeline), **common, **spark)
        else:
            ingest = OncemoreIngestOperator(task_id="ingest", conn_id=settings.spark_conn_id,
                                            name=f"oncemore-{pipeline.name}", outlets=table_assets(pipeline), **common,
                                            **spark)
        report = OncemoreReportOperator(task_id="report", **common)
        plan >> ingest >> report
    return dag


def build_maintenance_dag(pipeline: Pipeline) -> DAG:
    """Compaction, checkpoint and vacuum of the pipeline's tables on ``maintenance.schedule``;
    runs beside ingestion (see oncemore.ops.maintain), one run at a time, no catch-up."""
    check_schedulable(pipeline)
    settings = pipeline.airflow
    with DAG(
        dag_id=maintenance_dag_id(pipeline.name),
        schedule=CronDataIntervalTimetable(pipeline.maintenance.schedule, timezone="UTC"),
        start_date=datetime.fromtimestamp(settings.start_date_ms / 1000, tz=timezone.utc),
        catchup=False,
        max_active_runs=1,
        tags=["oncemore", "maintenance", *settings.tags],
        default_args={"owner": settings.owner, "retries": settings.retries,
                      "retry_delay": timedelta(minutes=settings.retry_delay_minutes)},
        doc_md=(f"### oncemore maintenance of `{pipeline.name}`\n\nCompacts small files into files of about "
                f"{pipeline.maintenance.target_file_size_mb} MB, writes a checkpoint and vacuums files older than "
                f"{pipeline.maintenance.vacuum_retention_hours} h in {_tables_text(pipeline)} and its quarantine "
                f"table. Positions (txn actions) are kept; ingestion may run at the same time."
                + (f"\n\nOn `{pipeline.maintenance.verify}`, `verify` audits exactly-once from the tables "
                   "(`oncemore verify`) and fails on a discrepancy." if pipeline.maintenance.verify != "off" else "")),
    ) as dag:
        maintain = OncemoreMaintainOperator(task_id="maintain", config_path=str(Path(pipeline.origin).resolve()),
                                            kafka_conn_id=settings.kafka_conn_id)
        if pipeline.maintenance.verify != "off":
            maintain >> OncemoreVerifyOperator(
                task_id="verify", config_path=str(Path(pipeline.origin).resolve()),
                verify_cron=pipeline.maintenance.verify, conn_id=settings.spark_conn_id,
                name=f"oncemore-verify-{pipeline.name}", **_spark_pool(pipeline))
    return dag


def _spark_pool(pipeline: Pipeline) -> dict[str, str]:
    """The pool of the tasks that run Spark (ingest, verify): Airflow's default pool unless ``airflow.pool`` names one."""
    return {"pool": pipeline.airflow.pool} if pipeline.airflow.pool else {}


def _tables_text(pipeline: Pipeline) -> str:
    return ", ".join(f"`{t.table_uri}`" for t in pipeline.tables)


def _doc(pipeline: Pipeline) -> str:
    formats = "\n".join(
        f"- {'format' if t.route is None else f'route `{t.route}` -> `{t.table_uri}`, format'}: {t.format.type}"
        + (f" (`{t.format.ddl}`)" if t.format.ddl else "") for t in pipeline.tables)
    into = (f"Delta table `{pipeline.sink.table_uri}`" if pipeline.routes is None else
            f"a Delta table per route (routed by `{pipeline.routes.by}`, unrouted records: {pipeline.routes.unrouted})")
    return (
        f"### oncemore pipeline `{pipeline.name}`\n\n"
        f"Exactly-once ingestion of Kafka {pipeline.source.describe_subscription()} into {into} "
        f"(quarantine: `{pipeline.sink.quarantine_uri}`).\n\n"
        f"{formats}\n- schedule: `{pipeline.airflow.schedule}` (UTC data intervals)\n"
        f"- starts new partitions at: {pipeline.source.starting_offsets.describe()}\n"
        f"- max records per commit: {pipeline.limits.max_records_per_commit}\n"
        f"- config: `{pipeline.origin}`\n\n"
        "A run ingests from the table's committed positions up to the end of its data interval (or "
        "the `until` param). Rerunning finished work is a no-op: the ingest task is skipped."
    )


def schedulable_pipelines() -> tuple[list[Pipeline], dict[str, Exception]]:
    """Every pipeline config with an airflow block (one without is CLI only: no DAG, no error),
    and the problems of the files that do not load, by file."""
    pipelines, broken = load_all()
    return [p for p in pipelines if p.airflow is not None], dict(broken)


def load_dags() -> dict[str, DAG]:
    pipelines = schedulable_pipelines()[0]
    dags = [build_dag(p) for p in pipelines] + [build_maintenance_dag(p) for p in pipelines if p.maintenance]
    return {dag.dag_id: dag for dag in dags}
