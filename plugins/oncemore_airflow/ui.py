"""The oncemore page of the Airflow UI: a FastAPI app the api-server mounts at ``/oncemore`` (the
plugin's ``fastapi_apps``), shown in the UI's navigation as an embedded view (``external_views``).

``/`` lists every pipeline in one table, a row each (report/fleet.py: state, lag in records and
time, last commit's age, verify verdict, quarantined in the last 24 hours), sortable by any column
and filtered by the DAG's tags in the browser; ``/pipelines/<name>`` shows one pipeline: its
per-partition position, log end, lag and last commit, its quarantine rate beside its limit, plots
of the batch history (records per hour of their Kafka timestamp, lag after each commit), a
quarantine sample and its recent batches (an upsert pipeline's with what their events did:
inserted, updated, deleted, stale); ``/api/...`` serves the same figures as JSON. Everything comes from ``oncemore.report.overview``: the
Delta logs and Kafka, read-only. Access follows Airflow's: the caller's token (the UI's session
cookie or a bearer token) must allow reading the pipeline's DAG.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from oncemore.config.loading import load_all, with_kafka_overrides
from oncemore.kafka.clients import CLIENT_LOG
from oncemore.report import fleet
from oncemore_airflow import charts
from oncemore_airflow.factory import dag_id
from oncemore_airflow.hooks import OncemoreHook

URL_PREFIX = "/oncemore"
# Every page view creates Kafka clients (the index: one per cluster); their informational chatter
# does not belong in the API server's log. Failures still reach the page as errors.
CLIENT_LOG.setLevel(logging.WARNING)

app = FastAPI(title="oncemore", description="Positions, lag, batches and quarantine of oncemore pipelines")
templates = Jinja2Templates(directory=Path(__file__).parent / "templates")
templates.env.filters["seconds"] = fleet.seconds


def _readable_pipelines(user) -> tuple[list, dict[str, str]]:
    """The pipelines whose DAG the user may read (one without an airflow block has none: CLI only),
    loaded with their Airflow connection's Kafka settings; and the config problems of broken files
    (by file)."""
    pipelines, broken = load_all()
    manager = get_auth_manager()
    readable = [p for p in pipelines if p.airflow is not None
                and manager.is_authorized_dag(method="GET", details=DagDetails(id=dag_id(p.name)), user=user)]
    overrides: dict[str | None, dict] = {}  # a connection is asked once a view, however many pipelines use it

    def connected(pipeline):
        conn_id = pipeline.airflow.kafka_conn_id
        if conn_id not in overrides:
            overrides[conn_id] = OncemoreHook(pipeline.origin, conn_id).kafka_overrides()
        return with_kafka_overrides(pipeline, overrides[conn_id]) if overrides[conn_id] else pipeline

    return [connected(p) for p in readable], {path: str(error) for path, error in broken.items()}


def overviews(user) -> dict[str, Any]:
    started = time.monotonic()
    pipelines, broken = _readable_pipelines(user)
    found = fleet.overviews(pipelines)
    for data in found:
        data["dag_id"] = dag_id(data["pipeline"])
    tags = sorted({t for data in found for t in data["row"]["tags"]})
    return {"pipelines": found, "tags": tags, "broken_configs": broken, "seconds": round(time.monotonic() - started, 3)}


def one_overview(name: str, user) -> dict[str, Any]:
    started = time.monotonic()
    pipelines, _ = _readable_pipelines(user)
    pipeline = next((p for p in pipelines if p.name == name), None)
    if pipeline is None:
        raise HTTPException(status_code=404, detail=f"no pipeline named {name!r} that you may read")
    data = fleet.overview(pipeline, detail=True)
    data["dag_id"] = dag_id(pipeline.name)
    data["seconds"] = round(time.monotonic() - started, 3)
    return data


@app.get("/api/pipelines")
def api_pipelines(user: GetUserDep) -> dict[str, Any]:
    return overviews(user)


@app.get("/api/pipelines/{name}")
def api_pipeline(name: str, user: GetUserDep) -> dict[str, Any]:
    return one_overview(name, user)


@app.get("/", response_class=HTMLResponse)
def index_page(request: Request, user: GetUserDep):
    return templates.TemplateResponse(request, "index.html", overviews(user))


@app.get("/pipelines/{name}", response_class=HTMLResponse)
def pipeline_page(request: Request, name: str, user: GetUserDep):
    data = one_overview(name, user)
    if data["error"] is None:
        data["charts"] = charts.pipeline_charts(data)
    return templates.TemplateResponse(request, "pipeline.html", data)

