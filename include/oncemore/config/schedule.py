"""When a pipeline's work runs in Airflow: its ingest DAG's data intervals (``airflow``) and its
tables' upkeep (``maintenance``). Invariant: no data interval starts before ``start_date`` or
after ``end_date``, and vacuum never deletes a file a committing batch may still reference.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from oncemore.config.values import ConfigModel, Cron, Positive, key_problem, parse_timestamp_ms


class AirflowSettings(ConfigModel):
    """How the pipeline's DAG runs (a pipeline without this block has no DAG: CLI only). Runs cover
    data intervals of ``schedule``."""

    schedule: Cron = Field(default="0 * * * *", description="5-field cron or an Airflow preset (@hourly, @daily, ...); "
                                                            "each run covers one interval of it")
    start_date: datetime = Field(description="ISO-8601; without a zone, UTC: the first data interval starts here")
    end_date: datetime | None = Field(default=None, description="ISO-8601; without a zone, UTC: the last data interval "
                                                                "starts here at the latest, and no run comes after "
                                                                "it (Airflow's end_date); none: runs go on")
    catchup: StrictBool = False
    max_active_runs: Positive = 1
    owner: StrictStr = "oncemore"
    retries: Annotated[StrictInt, Field(ge=0)] = 2
    retry_delay_minutes: Annotated[float, Field(gt=0)] = 5.0
    tags: tuple[StrictStr, ...] = ()
    spark_conn_id: StrictStr = Field(default="oncemore_spark",
                                     description="the Spark connection the ingest task's spark-submit uses")
    spark_connect_conn_id: StrictStr | None = Field(
        default=None, description="a spark_connect connection: the ingest task runs on that Spark Connect server "
                                  "instead of spark-submit")
    kafka_conn_id: StrictStr | None = None
    pool: StrictStr | None = Field(
        default=None, description="an Airflow pool whose slot each task running Spark (ingest, verify) takes: bounds "
                                  "the runs on one Spark (Connect) server at once. Create it first (`airflow pools set "
                                  "NAME SLOTS DESCRIPTION`): Airflow schedules no task of a pool that does not exist "
                                  "and shows the DAG a warning")

    @field_validator("start_date", "end_date")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return value.replace(tzinfo=timezone.utc) if value is not None and value.tzinfo is None else value

    @model_validator(mode="after")
    def _ends_after_start(self) -> "AirflowSettings":
        if self.end_date is not None and self.end_date < self.start_date:
            raise key_problem("end_date", "is before start_date: no data interval would run")
        if self.end_date is not None and not self.catchup:
            # Airflow then runs only the latest interval: one the scheduler missed (down, or the DAG
            # paused) before end_date never runs, and its records would never be ingested.
            raise key_problem("end_date", "needs catchup: true (without it, an interval missed before end_date "
                                          "never runs)")
        return self

    @property
    def start_date_ms(self) -> int:
        return parse_timestamp_ms(self.start_date)


# Vacuum never deletes a file younger than this: an ingestion writes its files before it
# commits them, and a batch that is still reading must find its files there when it commits.
VACUUM_RETENTION_FLOOR_HOURS = 24


class Maintenance(ConfigModel):
    """Table upkeep (``oncemore maintain``), run by the pipeline's maintenance DAG on ``schedule``:
    compaction of small files, a checkpoint, and vacuum of files no version within the retention
    still needs; and, on ``verify``'s schedule, the audit of the tables (``oncemore verify``)."""

    schedule: Cron = Field(default="30 3 * * *", description="5-field cron or an Airflow preset")
    target_file_size_mb: Positive = Field(default=128, description="compaction rewrites smaller files into files of about this size")
    vacuum_retention_hours: StrictInt = Field(
        default=168, ge=VACUUM_RETENTION_FLOOR_HOURS,
        description=f"files no version needs and older than this are deleted (at least {VACUUM_RETENTION_FLOOR_HOURS})")
    verify: Literal["off"] | Cron = Field(
        default="off", description="off, or a 5-field cron: a maintenance run whose interval holds one of its times "
                                   "also runs `oncemore verify` (on spark_conn_id) and fails on a discrepancy")
