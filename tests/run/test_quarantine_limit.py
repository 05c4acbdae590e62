"""The quarantine limit (commit/share.py) on a real broker: a batch that quarantines more than its
pipeline allows fails before any commit, both tables left without a commit of its range (its
offsets all still to be read), naming the share and the reasons; a batch under the limit commits
with every offset in the table or the quarantine exactly once; the floor and the way out
(``--accept-quarantine``) let no input stop a pipeline for good, and are counted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from deltalake import DeltaTable

from conftest import assert_exactly_once, held_positions, oncemore, oncemore_commits, orders, read_pairs
from oncemore.core.errors import QuarantineExceeded
from oncemore.plan.planner import LATEST, plan_run
from oncemore.report.overview import pipeline_overview
from oncemore.report.status import format_status, status
from oncemore.run import runner

pytestmark = pytest.mark.spark
INT_AMOUNT = {"type": "json", "schema": "id BIGINT, customer STRING, amount INT"}


def newcomer(i: int) -> bytes:
    """An order whose amount has cents, which the newcomer declared INT."""
    return b'{"id": %d, "customer": "c%d", "amount": 12.50}' % (i, i % 7)


def parquet_files(*table_uris: str) -> list[Path]:
    return [f for uri in table_uris for f in Path(uri).rglob("*.parquet")]


def test_a_batch_quarantining_everything_fails_before_any_commit_and_the_way_out_commits_it(broker, topic,
                                                                                           make_pipeline, spark):
    produced = broker.produce(topic, [(i % 3, None, newcomer(i), None) for i in range(600)])
    pipeline = make_pipeline(topic, format=INT_AMOUNT)
    main, quarantine = pipeline.sink.table_uri, pipeline.sink.quarantine_uri

    failed = oncemore("run", "--config", pipeline.origin)

    assert failed.returncode == 1, failed.stderr[-3000:]
    (line,) = [line for line in failed.stderr.splitlines() if line.startswith("oncemore: error:")]
    assert f"pipeline orders: batch 0 ({topic}/0 [0, 200), {topic}/1 [0, 200), {topic}/2 [0, 200)): 600 of 600 " \
           "records quarantined (100.0%), more than the limit of 50% (quarantine.max_fraction; from 10 " \
           "quarantined records on); commonest reasons: 600 x column 'amount': ... does not fit INT (first: " \
           f"{topic}/0 offset 0: column 'amount': 12.50 does not fit INT). Nothing of these ranges was committed" in line
    assert "Traceback" not in failed.stderr
    # Neither table has a commit of the range, nor a file of it: every offset is still to be read.
    for table in (main, quarantine):
        assert held_positions(table, pipeline.name, topic) == {0: None, 1: None, 2: None}
        assert read_pairs(table) == []
    assert parquet_files(main, quarantine) == []
    assert sum(r.end - r.start for b in plan_run(pipeline, LATEST).batches for r in b.ranges) == 600

    # The way out the message names: this batch, accepted.
    until = re.search(r"--accept-quarantine --until '([^']+)'", line).group(1)
    assert json.loads(until) == {topic: {"0": 200, "1": 200, "2": 200}}
    accepted = oncemore("run", "--config", pipeline.origin, "--accept-quarantine", "--until", until)

    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert "0 records written, 600 quarantined (batch 0 over the quarantine limit, accepted)" in accepted.stdout
    assert read_pairs(main) == []
    assert_exactly_once(read_pairs(main) + read_pairs(quarantine), produced)
    for table in (main, quarantine):
        ((version, record),) = oncemore_commits(table)
        assert record.quarantine_accepted and record.records == {"written": 0, "quarantined": 600, "filtered": 0}
    main_version = oncemore_commits(main)[0][0]

    # Records that fit commit again without accepting anything; status and the page show the rate.
    fixed = [(i % 3, None, b'{"id": %d, "customer": "c", "amount": 12}' % i, None) for i in range(600, 690)]
    produced += broker.produce(topic, fixed)
    report = runner.run(pipeline, spark_factory=lambda: spark)
    assert report.status == "committed" and (report.written, report.quarantined) == (90, 0)
    assert not oncemore_commits(main)[-1][1].quarantine_accepted
    assert_exactly_once(read_pairs(main) + read_pairs(quarantine), produced)
    rate = status(pipeline)["quarantine"]
    assert (rate["commits"], rate["records"], rate["quarantined"], rate["accepted"]) == (2, 690, 600, [main_version])
    assert rate["rate"] == pytest.approx(600 / 690) and rate["last_batch"]["rate"] == 0
    assert (f"quarantine: 87.0% of the last 2 batch commits' 690 records (600); last batch (version "
            f"{main_version + 1}): 0.0% (0 of 90); limit 50% once 10 are quarantined; committed over the limit by a "
            f"run that accepted it: version(s) {main_version}") in format_status(status(pipeline))
    page = pipeline_overview(pipeline, detail=True)
    assert page["quarantine"]["line"].startswith("quarantine: 87.0% of the last 2 batch commits")
    assert [(b["quarantine_rate"], b["quarantine_accepted"]) for b in page["batches"]] == [(0.0, False), (1.0, True)]


def test_a_batch_under_the_limit_commits_every_offset_once_and_filtered_records_are_not_quarantined(
        broker, topic, make_pipeline, spark):
    records = orders(0, 1_000)
    bad = set(range(0, 1_000, 17))  # 59 records, 5.9 %
    records = [(p, k, b"{not json" if i in bad else v, s) for i, (p, k, v, s) in enumerate(records)]
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.status == "committed" and (report.written, report.quarantined) == (941, 59)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri) + read_pairs(pipeline.sink.quarantine_uri), produced)
    assert len(read_pairs(pipeline.sink.quarantine_uri)) == 59
    rate = status(pipeline)["quarantine"]
    assert rate["rate"] == pytest.approx(0.059) and rate["accepted"] == []
    # The commit counts its rows by the hour of their Kafka timestamp, every one of them.
    ((_, record),) = oncemore_commits(pipeline.sink.table_uri)
    assert [sum(f[i] for f in record.hours.values()) for i in (0, 1)] == [941, 59]

    # A transform's WHERE is the user's intent: its filtered records count as handled, so 59 bad
    # records of 1,000 are 5.9 % whatever the transform keeps (of the 106 it keeps or quarantines, 56 %).
    filtering = make_pipeline(topic, name="twentieth", transform="SELECT * FROM records WHERE id % 20 = 0",
                              quarantine={"max_fraction": 0.3})
    filtered = runner.run(filtering, spark_factory=lambda: spark)
    assert filtered.status == "committed" and (filtered.written, filtered.quarantined) == (47, 59)
    ((_, record),) = oncemore_commits(filtering.sink.table_uri)
    assert record.records == {"written": 47, "quarantined": 59, "filtered": 894}


def test_fewer_quarantined_records_than_the_floor_never_stop_a_pipeline(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, [(i % 3, None, b"{not json", None) for i in range(9)])
    pipeline = make_pipeline(topic)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.status == "committed" and report.quarantined == 9
    assert_exactly_once(read_pairs(pipeline.sink.quarantine_uri), produced)
    assert not oncemore_commits(pipeline.sink.table_uri)[0][1].quarantine_accepted


def test_rows_failing_an_expectation_count_and_fail_the_batch_before_the_sink_commits(broker, topic, make_pipeline,
                                                                                   spark):
    broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic, expectations=[{"name": "small", "check": "amount < 100"}],
                             quarantine={"max_fraction": 0.5})

    with pytest.raises(QuarantineExceeded) as failed:
        runner.run(pipeline, spark_factory=lambda: spark)

    assert "220 of 300 records quarantined (73.3%), more than the limit of 50%" in str(failed.value)
    assert "commonest reasons: 220 x expectation small failed (first: " in str(failed.value)
    assert failed.value.evidence["reasons"] == {"expectation small failed": 220}
    for table in (pipeline.sink.table_uri, pipeline.sink.quarantine_uri):
        assert held_positions(table, pipeline.name, topic) == {0: None, 1: None, 2: None}
        assert not [c for c in DeltaTable(table).history() if c.get("operation") != "CREATE TABLE"]
    assert parquet_files(pipeline.sink.table_uri, pipeline.sink.quarantine_uri) == []


def test_change_events_an_upsert_cannot_apply_count_before_the_merge(broker, topic, make_pipeline, spark):
    events = [(i % 3, None, json.dumps({"id": None if i % 3 else i, "name": "n", "balance": i}).encode(), None)
              for i in range(60)]
    broker.produce(topic, events)
    pipeline = make_pipeline(topic, name="accounts", format={"type": "json", "schema": "id BIGINT, name STRING, "
                                                                                      "balance BIGINT"},
                             upsert={"keys": ["id"]})

    with pytest.raises(QuarantineExceeded) as failed:
        runner.run(pipeline, spark_factory=lambda: spark)

    assert "40 of 60 records quarantined (66.7%)" in str(failed.value)
    for table in (pipeline.sink.table_uri, pipeline.sink.quarantine_uri):
        assert held_positions(table, pipeline.name, topic) == {0: None, 1: None, 2: None}


def test_reasons_are_grouped_without_the_values_they_quote():
    from oncemore.commit.share import commonest, reason_kind

    assert reason_kind("column 'amount': 12.50 does not fit INT") == "column 'amount': ... does not fit INT"
    assert reason_kind("column 'day': '2026-02-30' is not a valid DATE (ISO-8601, years 1 to 9999)") == \
        "column 'day': ... is not a valid DATE (ISO-8601, years 1 to 9999)"
    assert reason_kind("column 'r': 1e400 is beyond FLOAT's range") == "column 'r': ... is beyond FLOAT's range"
    unchanged = ["column 'id': expected BIGINT, found a JSON string", "expectation small failed",
                 "column 'region' partitions the table and this value makes a directory name of 265 bytes, more than "
                 "the 255 a file or object store's name may hold"]
    assert [reason_kind(r) for r in unchanged] == unchanged
    rows = [("column 'a': 1.5 does not fit INT", "t", 1, 4), ("column 'a': 2.5 does not fit INT", "t", 0, 9),
            ("expectation small failed", "t", 0, 1), ("column 'id': expected BIGINT, found a JSON string", "t", 2, 0),
            ("column 'id': expected BIGINT, found a JSON string", "t", 2, 1), ("value is not valid JSON", "t", 0, 0)]
    assert [r.describe() for r in commonest(rows)] == [
        "2 x column 'a': ... does not fit INT (first: t/0 offset 9: column 'a': 2.5 does not fit INT)",
        "2 x column 'id': expected BIGINT, found a JSON string (first: t/2 offset 0)",
        "1 x expectation small failed (first: t/0 offset 1)"]


def test_a_batch_accepted_into_the_quarantine_table_before_a_crash_is_committed_by_the_next_run(
        broker, topic, make_pipeline, spark, monkeypatch):
    from oncemore.commit import part

    produced = broker.produce(topic, [(i % 3, None, b"{not json" if i % 4 else b'{"id": %d}' % i, None)
                                      for i in range(60)])
    pipeline = make_pipeline(topic)
    real_commit = part.commit

    def crash_on_main(ledger, *args, **kwargs):
        if ledger.table_uri == pipeline.sink.table_uri:
            raise SystemExit("injected crash after the quarantine commit")
        return real_commit(ledger, *args, **kwargs)

    monkeypatch.setattr(part, "commit", crash_on_main)
    with pytest.raises(SystemExit):
        runner.run(pipeline, spark_factory=lambda: spark, accept_quarantine=True)
    monkeypatch.undo()
    assert len(read_pairs(pipeline.sink.quarantine_uri)) == 45 and read_pairs(pipeline.sink.table_uri) == []

    report = runner.run(pipeline, spark_factory=lambda: spark)  # no --accept-quarantine: that was decided

    assert report.status == "committed" and (report.written, report.quarantined) == (15, 45)
    assert report.batches[0].quarantine_accepted
    assert_exactly_once(read_pairs(pipeline.sink.table_uri) + read_pairs(pipeline.sink.quarantine_uri), produced)
