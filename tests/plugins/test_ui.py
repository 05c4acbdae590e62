"""The Airflow UI in a real browser (headless Chromium driven by Playwright) against the real
services: log in, create a backfill of an hourly pipeline from Airflow's own trigger dialog, check
that its runs ingest exactly their intervals and that a rerun commits nothing, and check the
oncemore page and the pipeline page (plots, quarantine sample) against the ledger. The docs'
screenshots are taken here."""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.error import HTTPError
from urllib.parse import quote

import pytest
import yaml
from deltalake import DeltaTable
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from test_scheduler import assert_runs_hold_their_intervals, backfills_done, parse

from conftest import ROOT, assert_exactly_once, oncemore_commits, read_pairs
from devtools.airflowservices import start_airflow, wait_for
from oncemore.config.loading import load_pipeline
from oncemore.kafka import clients
from oncemore.plan.ledger import Ledger

# The tests share the module's services and build on each other (the page shows what the backfill
# test ingested): scripts/test's --dist loadscope runs a module's tests on one worker, in order.
pytestmark = [pytest.mark.airflow, pytest.mark.spark]
DAG_ID = "oncemore__clicks"
SCREENSHOTS = ROOT / "docs" / "screenshots"
PER_HOUR = 90  # records stamped in each past hour, one in 30 of them not JSON


def chromium() -> str:
    path = os.environ.get("ONCEMORE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("headless Chromium not found: install it with `apt-get update && apt-get install -y chromium` "
                    "(scripts/test does when it runs as root) or point ONCEMORE_CHROMIUM at a Chromium binary")
    return path


@pytest.fixture(scope="module")
def clicks(tmp_path_factory, broker):
    """An hourly pipeline whose schedule starts next hour, so only backfills ingest the past hours
    (from the earliest offset), and the real services serving its DAG and the oncemore page."""
    work = tmp_path_factory.mktemp("ui")
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = hour - timedelta(hours=3)
    topic = f"clicks_{int(hour.timestamp())}_{os.getpid()}"
    broker.create_topic(topic, 3)
    stamped = {}
    for h in range(3):
        base = int((start + timedelta(hours=h)).timestamp() * 1000)
        records = [(i % 3, None, b"{not json" if i % 30 == 7 else json.dumps({"id": h * 1000 + i, "page": f"/p{i % 5}"}).encode(),
                    base + i * 30_000) for i in range(PER_HOUR)]
        delivered = broker.produce(topic, records, transactional_id=f"{topic}-tx" if h == 1 else None)
        stamped.update({pair: record[3] for pair, record in zip(delivered, records)})
    (work / "pipelines").mkdir()
    (work / "pipelines" / "clicks.yaml").write_text(yaml.safe_dump({
        "name": "clicks",
        "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": topic, "starting_offsets": "earliest"},
        "sink": {"table_uri": str(work / "delta" / "clicks")},
        "format": {"type": "json", "schema": "id BIGINT, page STRING"},
        "airflow": {"schedule": "0 * * * *", "start_date": (hour + timedelta(hours=1)).isoformat(), "catchup": True,
                    "retries": 0},
    }))
    # No airflow block: a CLI-only pipeline, which has no DAG and is not on the page.
    (work / "pipelines" / "cli_only.yaml").write_text(yaml.safe_dump({
        "name": "cli_only", "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": topic},
        "sink": {"table_uri": str(work / "delta" / "cli_only")}, "format": {"type": "raw"}}))
    services = start_airflow(work / "airflow", {"ONCEMORE_PIPELINES_DIR": str(work / "pipelines")})
    yield services, load_pipeline(work / "pipelines" / "clicks.yaml"), start, stamped
    services.stop()


@pytest.fixture(scope="module")
def page(clicks):
    from playwright.sync_api import sync_playwright

    services = clicks[0]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000}, timezone_id="UTC")
        context.set_default_timeout(60_000)
        page = context.new_page()
        page.goto(services.url)
        page.get_by_label("Username").fill(services.username)
        page.get_by_label("Password").fill(services.password)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(services.url + "/")
        yield page
        browser.close()


def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name))


def backfill_from_the_ui(page, url: str, start: datetime, end: datetime, reprocess: str, shot: str | None = None) -> None:
    """The clicks a person makes: the DAG's Trigger button, Backfill, the date range (logical
    dates, UTC), the reprocess behaviour, Run Backfill."""
    page.goto(f"{url}/dags/{DAG_ID}")
    page.get_by_role("button", name="Trigger").click()
    dialog = page.locator("[role=dialog][data-state=open]")
    dialog.get_by_text("Backfill", exact=True).click()
    pickers = dialog.get_by_test_id("datetime-input")
    for index, moment in enumerate((start, end)):
        pickers.nth(index).click()
        popover = page.locator("[data-scope=popover][data-part=content][data-state=open]")
        popover.get_by_placeholder("YYYY/MM/DD").fill(moment.strftime("%Y/%m/%d"))
        popover.get_by_placeholder("HH:mm").fill(moment.strftime("%H:%M"))
        dialog.get_by_text("Date Range").click()  # closes the picker
    dialog.get_by_text(reprocess, exact=True).click()
    # The dialog asks Airflow (a dry run) how many runs the choice makes.
    dialog.get_by_text(f"{int((end - start) / timedelta(hours=1)) + 1} runs will be triggered").wait_for()
    if shot:
        screenshot(page, shot)
    for attempt in range(3):
        dialog.get_by_role("button", name="Run Backfill").click()
        try:
            dialog.wait_for(state="detached", timeout=30_000)
            return
        except PlaywrightTimeout:
            # On SQLite the API answers 503 while the scheduler holds the database lock; the
            # dialog stays open showing the error, and a person clicks again.
            if attempt == 2:
                raise AssertionError(f"the backfill dialog stayed open: {dialog.inner_text()}") from None


def dag_parsed(services) -> bool:
    try:
        return bool(services.api("GET", f"/api/v2/dags/{DAG_ID}"))
    except HTTPError as error:
        if error.code == 404:
            return False
        raise


def succeeded_runs(services, count: int):
    runs = services.dag_runs(DAG_ID)
    assert not [r for r in runs if r["state"] == "failed"], [r["dag_run_id"] for r in runs]
    return len(runs) == count and all(r["state"] == "success" for r in runs) and runs


def test_a_backfill_created_in_the_ui_ingests_exactly_its_intervals_and_its_rerun_nothing(clicks, page):
    services, pipeline, start, stamped = clicks
    table_uri = pipeline.sink.table_uri
    wait_for(lambda: dag_parsed(services), 300, "the DAG to be parsed", 3)
    assert services.dag_runs(DAG_ID) == [], "the schedule starts next hour: only backfills run"

    backfill_from_the_ui(page, services.url, start, start + timedelta(hours=1), "Missing Runs", shot="backfill-dialog.png")
    wait_for(lambda: backfills_done(services, DAG_ID, 1), 600, "the UI backfill", 5)
    runs = wait_for(lambda: succeeded_runs(services, 2), 120, "the backfill runs", 3)

    assert [parse(r["data_interval_start"]) for r in runs] == [start, start + timedelta(hours=1)]
    assert [r["run_type"] for r in runs] == ["backfill", "backfill"]
    assert_runs_hold_their_intervals(runs, table_uri, pipeline.source.topic, stamped, per_run=PER_HOUR)
    # The ingest task's log shows the run's progress (spark-submit's output, JSON lines).
    task_log = json.dumps(services.api(
        "GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(runs[0]['dag_run_id'], safe='')}/taskInstances/ingest/logs/1"))
    assert "offsets_done" in task_log and "records_per_second" in task_log and "eta_seconds" in task_log
    first_two_hours = [p for p, ms in stamped.items() if ms < (start + timedelta(hours=2)).timestamp() * 1000]
    assert_exactly_once(read_pairs(table_uri) + read_pairs(pipeline.sink.quarantine_uri), first_two_hours)
    version = DeltaTable(table_uri).version()

    backfill_from_the_ui(page, services.url, start, start + timedelta(hours=1), "All Runs")
    wait_for(lambda: backfills_done(services, DAG_ID, 2), 600, "the UI re-backfill", 5)
    runs = wait_for(lambda: succeeded_runs(services, 2), 120, "the re-run backfill runs", 3)
    assert DeltaTable(table_uri).version() == version, "a rerun of the backfill commits nothing"
    assert_exactly_once(read_pairs(table_uri) + read_pairs(pipeline.sink.quarantine_uri), first_two_hours)


def test_the_oncemore_page_shows_the_ledger(clicks, page, spark):
    from oncemore.report.verdict import record_result
    from oncemore.report.verify import verify

    services, pipeline, _, _ = clicks
    ledger = Ledger(pipeline.sink.table_uri, pipeline.name)
    assert ledger.snapshot() is not None, "runs after the backfill test"
    verified = verify(pipeline, lambda: spark)
    record_result(pipeline, verified)  # as the maintenance DAG's verify task does
    admin = clients.admin_client(pipeline)
    partitions = clients.describe_source(admin, pipeline).partitions
    positions, bounds = ledger.positions(partitions), clients.log_bounds(admin, pipeline, partitions)
    commits = oncemore_commits(pipeline.sink.table_uri)

    page.goto(services.url)
    page.get_by_role("link", name="oncemore", exact=True).click()  # the navigation button the plugin adds
    frame = page.frame_locator("iframe")
    # The index: a row per pipeline (the CLI-only one has no DAG, so no row).
    row = frame.locator("table#pipelines tr[data-pipeline='clicks']")
    row.wait_for()
    assert frame.locator("table#pipelines tbody tr").evaluate_all("rows => rows.map(r => r.dataset.pipeline)") == ["clicks"]
    assert row.locator("td.state").inner_text() == "ok"
    assert int(row.locator("td.lag").inner_text()) == sum(bounds[p].latest - positions[p] for p in partitions) > 0
    assert row.locator("td.lag-time").inner_text() != "-" and row.locator("td.last-commit-age").inner_text() != "-"
    assert row.locator("td.verify").inner_text() == "OK" and verified.ok
    assert int(row.locator("td.quarantined-24h").inner_text()) == sum(r.records["quarantined"] for _, r in commits) > 0
    screenshot(page, "oncemore-page.png")

    # Partitions and batches are on the pipeline's page.
    frame.get_by_role("link", name="clicks", exact=True).click()
    frame.locator("h1", has_text="clicks").wait_for()
    for p in partitions:
        partition = frame.locator(f"table.partitions tr[data-partition='{p}']")
        assert int(partition.locator("td.position").inner_text()) == positions[p]
        assert int(partition.locator("td.log-end").inner_text()) == bounds[p].latest
        assert int(partition.locator("td.lag").inner_text()) == bounds[p].latest - positions[p] > 0
        assert partition.locator("td.lag-time").inner_text() != "-"
    newest = commits[-1]
    assert int(frame.locator(".last-commit-version").inner_text()) == newest[0]
    shown = frame.locator("table.batches tr[data-version]")
    assert shown.first.get_attribute("data-version") == str(newest[0])
    assert shown.first.locator("td.run-id").inner_text() == newest[1].run_id
    assert int(shown.first.locator("td.written").inner_text()) == newest[1].records["written"]
    records = newest[1].records
    assert shown.first.locator("td.quarantine-rate").inner_text() == \
        f"{100 * records['quarantined'] / (records['written'] + records['quarantined']):.1f}"
    assert frame.locator("p.verified").inner_text().startswith("verified at ")
    assert f"{pipeline.name}: OK: {verified.commits} commits audited" in frame.locator("p.verified").inner_text()


def test_the_pipeline_page_plots_the_history_and_samples_the_quarantine(clicks, page):
    services, pipeline, start, _ = clicks
    commits = [record for _, record in oncemore_commits(pipeline.sink.table_uri)]
    quarantined = read_pairs(pipeline.sink.quarantine_uri)
    assert quarantined, "the backfill quarantined the records that are not JSON"

    page.goto(services.url + "/plugin/oncemore")
    frame = page.frame_locator("iframe")
    frame.get_by_role("link", name="clicks", exact=True).click()
    frame.locator("h1", has_text="clicks").wait_for()

    written = frame.locator("#records-chart rect.bar.written")
    assert sum(int(v) for v in written.evaluate_all("bars => bars.map(b => b.dataset.value)")) == sum(
        r.records["written"] for r in commits)
    # The backfill's two hours, one bar each (by the records' Kafka timestamps), whenever they were committed.
    assert written.evaluate_all("bars => bars.map(b => b.dataset.label)") == [
        (start + timedelta(hours=h)).strftime("%Y-%m-%d %Hh") for h in range(2)]
    assert frame.locator("p.quarantine-rate").inner_text().startswith(
        f"quarantine: {len(quarantined) / sum(r.records['written'] + r.records['quarantined'] for r in commits):.1%} "
        f"of the last {len(commits)} batch commits")
    in_quarantine_chart = frame.locator("#quarantine-chart rect.bar.quarantined")
    assert sum(int(v) for v in in_quarantine_chart.evaluate_all("bars => bars.map(b => b.dataset.value)")) == len(quarantined)
    lag_points = frame.locator("#lag-chart circle.point")
    assert lag_points.count() == len(commits)
    assert int(lag_points.last.get_attribute("data-value")) == sum(commits[-1].lag().values())
    samples = frame.locator("table.quarantine tr[data-offset]")
    assert samples.count() == min(len(quarantined), 10)
    assert "closing a JSON object" in samples.first.inner_text() and "{not json" in samples.first.inner_text()
    offsets = {o for _, o in quarantined}
    assert all(int(o) in offsets for o in samples.evaluate_all("rows => rows.map(r => r.dataset.offset)"))
    page.set_viewport_size({"width": 1400, "height": 1500})
    screenshot(page, "pipeline-page.png")
    page.set_viewport_size({"width": 1400, "height": 1000})


def test_a_catch_up_run_charts_its_records_by_the_hours_they_belong_to(broker, topic, make_pipeline, spark):
    from oncemore_airflow.charts import pipeline_charts

    from oncemore.report.overview import pipeline_overview
    from oncemore.run.runner import run

    start = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    broker.produce(topic, [(i % 3, None, b"{not json" if i % 30 == 7 else json.dumps({"id": i}).encode(),
                            int((start + timedelta(hours=h)).timestamp() * 1000) + i * 50_000)
                           for h in range(3) for i in range(60)])
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT"})

    run(pipeline, spark_factory=lambda: spark)  # three hours caught up in one commit

    assert len(oncemore_commits(pipeline.sink.table_uri)) == 1
    data = pipeline_overview(pipeline, detail=True)
    hours = [(start + timedelta(hours=h)).isoformat().replace("+00:00", "Z") for h in range(3)]
    assert data["per_hour"] == [{"hour": hour, "written": 58, "quarantined": 2} for hour in hours]
    charts = pipeline_charts(data)
    for chart, series, value in (("records", "written", "58"), ("records", "quarantined", "2"),
                                 ("quarantine", "quarantined", "2")):
        bars = re.findall(rf'<rect class="bar {series}" data-label="([^"]+)" data-value="(\d+)"', charts[chart])
        assert bars == [(hour[:13].replace("T", " ") + "h", value) for hour in hours], (chart, series)


def test_the_oncemore_api_needs_a_login(clicks):
    services = clicks[0]
    with pytest.raises(HTTPError) as refused:
        urllib.request.urlopen(services.url + "/oncemore/api/pipelines", timeout=30)
    assert refused.value.code == 401
    assert [p["pipeline"] for p in services.api("GET", "/oncemore/api/pipelines")["pipelines"]] == ["clicks"]


def test_the_index_of_a_hundred_pipelines_is_one_table_sorted_and_filtered_by_tag(clicks, page, broker, tmp_path):
    from devtools.fleet import write_fleet

    services, pipeline, _, _ = clicks
    directory = Path(pipeline.origin).parent
    topic = pipeline.source.topic
    fleet = write_fleet(directory, tmp_path / "delta", broker.bootstrap_servers, {topic: 3}, 100)
    try:
        admin = clients.admin_client(pipeline)
        bounds = clients.log_bounds(admin, pipeline, clients.describe_source(admin, pipeline).partitions)
        log_end, log_start = sum(b.latest for b in bounds.values()), sum(b.earliest for b in bounds.values())

        page.goto(services.url + "/plugin/oncemore")
        frame = page.frame_locator("iframe")
        rows = frame.locator("table#pipelines tbody tr")
        frame.locator("table#pipelines tr[data-pipeline='fleet_099']").wait_for()
        names = ["clicks", *(p.name for p in fleet)]
        assert rows.evaluate_all("rows => rows.map(r => r.dataset.pipeline)") == names
        cells = rows.evaluate_all("rows => rows.map(r => [r.dataset.pipeline, r.querySelector('td.state').innerText, "
                                  "r.querySelector('td.lag').innerText, r.querySelector('td.tags').innerText])")
        for i, (name, state, lag, tags) in enumerate(cells[1:]):
            never_run = i % 10 == 9  # devtools/fleet.py: two commits to offset 2 of each partition, else none
            assert (name, state, int(lag), tags) == (
                fleet[i].name, "new" if never_run else "ok", log_end - (log_start if never_run else 6),
                f"fleet, {('even', 'odd')[i % 2]}")
        assert frame.locator("table.partitions, table.batches").count() == 0, "they are on each pipeline's page"

        frame.locator("select#tag-filter").select_option("odd")
        visible = "rows => rows.filter(r => !r.hidden).map(r => r.dataset.pipeline)"
        assert rows.evaluate_all(visible) == [f"fleet_{i:03d}" for i in range(1, 100, 2)]
        assert frame.locator("#shown").inner_text() == "50"
        frame.locator("select#tag-filter").select_option("")
        assert len(rows.evaluate_all(visible)) == 101

        lag_header = frame.locator("table#pipelines th", has_text="lag (records)")
        lag_header.click()
        lags = "rows => rows.map(r => Number(r.querySelector('td.lag').dataset.value))"
        ascending = rows.evaluate_all(lags)
        assert ascending == sorted(ascending) and ascending[0] < ascending[-1]
        assert lag_header.get_attribute("aria-sort") == "ascending"
        lag_header.click()
        assert rows.evaluate_all(lags) == sorted(ascending, reverse=True)
        frame.locator("table#pipelines th", has_text="pipeline").click()
        assert rows.evaluate_all("rows => rows.map(r => r.dataset.pipeline)") == sorted(names)
        page.set_viewport_size({"width": 1400, "height": 1500})
        screenshot(page, "oncemore-index-100.png")
        page.set_viewport_size({"width": 1400, "height": 1000})
    finally:
        for made in fleet:
            Path(made.origin).unlink()
