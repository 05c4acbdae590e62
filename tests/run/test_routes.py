"""One topic routed to several tables (config/routes.py), end to end on the project's broker: three
event types, two routes and the quarantine, each record counted by its (topic, partition, offset)
in exactly one table or a commit's counted skips (DESIGN.md invariant 7); a crash between two route
tables' commits, healed by a rerun alone and by two racing reruns; ``oncemore verify`` across the
tables."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import jinja2
import pytest
from deltalake import DeltaTable

from conftest import ROOT, assert_exactly_once, oncemore_command, oncemore_commits, read_coordinates
from oncemore.config.values import OffsetBound
from oncemore.ops.check import check_pipeline
from oncemore.ops.delete import delete
from oncemore.ops.maintain import maintain
from oncemore.ops.reset import reset
from oncemore.plan.planner import Plan, plan_run
from oncemore.report.landed import run_landed
from oncemore.report.overview import pipeline_overview
from oncemore.report.status import format_status, status
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark

KINDS = ("created", "paid", "created", "refunded", "paid")  # by i % 5: three event types, two routed
CREATED = "id BIGINT, type STRING, customer STRING"
PAID = "id BIGINT, type STRING, amount DECIMAL(10,2)"


def event(i: int) -> tuple[str, bytes]:
    """Event i: its type, and its value. One in 23 is no JSON at all (its route cannot be read);
    one paid event in 7 has an amount its route's format refuses."""
    kind = KINDS[i % 5]
    if i % 23 == 11:
        return kind, b"{not json"
    amount = "lots" if kind == "paid" and i % 7 == 3 else f"{i}.25"
    return kind, json.dumps({"id": i, "type": kind, "customer": f"c{i % 13}", "amount": amount}).encode()


def produce(broker, topic: str, start: int, count: int, by_header: bool = False,
            routes: tuple[str, ...] = ("created", "paid")) -> dict[str, list]:
    """Events [start, start + count) over three partitions, each record's coordinates by where it
    must land: its route ("created", "paid": ``routes``), "quarantine" (malformed for its route, or
    no JSON where the route is read from the value) or "refunded", which no route takes. With
    ``by_header``, each type is sent with header event_type."""
    landing: dict[str, list] = {}
    groups: dict[str, list] = {}
    for i in range(start, start + count):
        kind, value = event(i)
        groups.setdefault(kind if by_header else "all", []).append((i, kind, value))
    for group, found in groups.items():
        headers = [("event_type", group.encode())] if by_header else None
        sent = [(i % 3, str(i).encode(), value, None) for i, _, value in found]
        delivered = broker.produce(topic, sent, headers=headers)
        offsets = {p: iter(sorted(o for q, o in delivered if q == p)) for p in (0, 1, 2)}
        for (i, kind, value), (p, _, _, _) in zip(found, sent):
            where = (topic, p, next(offsets[p]))
            malformed = value == b"{not json" and not by_header
            broken = kind == "paid" and b'"lots"' in value or value == b"{not json"
            place = "quarantine" if malformed or (broken and kind in routes) else kind
            landing.setdefault(place, []).append(where)
    return landing


def routed(make_pipeline, topic: str, name: str, tmp: Path, **overrides):
    routes = {"by": "value.type", "tables": {
        "created": {"table_uri": str(tmp / name / "created"), "format": {"type": "json", "schema": CREATED}},
        "paid": {"table_uri": str(tmp / name / "paid"), "format": {"type": "json", "schema": PAID}}}}
    routes.update(overrides.pop("routes", {}))
    return make_pipeline(topic, name=name, sink={"table_uri": None, "quarantine_uri": str(tmp / name / "quarantine")},
                         format=None, routes=routes, **overrides)


def tables(pipeline) -> dict[str, str]:
    return {**{t.route: t.table_uri for t in pipeline.tables}, "quarantine": pipeline.sink.quarantine_uri}


def landed(pipeline) -> dict[str, list]:
    return {name: read_coordinates(uri) for name, uri in tables(pipeline).items()}


def commits(pipeline) -> dict[str, int]:
    return {name: len(oncemore_commits(uri)) if DeltaTable.is_deltatable(uri) else 0
            for name, uri in tables(pipeline).items()}


def assert_exact(pipeline, expected: dict[str, list], spark) -> None:
    """Each table holds exactly the records expected there; together, every record once; and
    ``oncemore verify`` agrees from the tables alone."""
    found = landed(pipeline)
    for name, coordinates in found.items():
        assert_exactly_once(coordinates, expected.get(name, []))
    report = verify(pipeline, lambda: spark)
    assert report.ok, report.describe()
    assert {name: t["rows"] for name, t in report.tables.items()} == {n: len(c) for n, c in found.items()}


def no_spark():
    raise AssertionError("a no-op run must not start Spark")


def test_a_routed_topic_lands_each_record_in_exactly_one_route_table_or_the_quarantine(
        broker, topic, make_pipeline, spark, tmp_path):
    expected = produce(broker, topic, 0, 600)
    expected["quarantine"] += expected.pop("refunded")  # unrouted: quarantine (the default)
    pipeline = routed(make_pipeline, topic, "events", tmp_path)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.status == "committed"
    assert report.written == len(expected["created"]) + len(expected["paid"])
    assert report.quarantined == len(expected["quarantine"])
    assert_exact(pipeline, expected, spark)
    # Each table recorded the partitions first (an anchor batch of positions alone), then the batch.
    assert commits(pipeline) == {"created": 2, "paid": 2, "quarantine": 2}
    for name, uri in tables(pipeline).items():
        anchor, batch = (record for _, record in oncemore_commits(uri))
        assert {p: r[0] == r[1] for p, r in anchor.ranges[topic].items()} == {"0": True, "1": True, "2": True}
        assert anchor.route == batch.route == (None if name == "quarantine" else name)
        assert batch.ranges[topic] == {"0": [0, 200], "1": [0, 200], "2": [0, 200]}
        own = "quarantined" if name == "quarantine" else "written"
        assert batch.records == {"written": 0, "quarantined": 0, "filtered": 0, "unrouted": 0,
                                 own: len(expected[name])}
    quarantined = set(DeltaTable(pipeline.sink.quarantine_uri).to_pyarrow_table(columns=["error"]).column("error").to_pylist())
    assert any("'refunded', which names no route (created, paid)" in e for e in quarantined), quarantined
    assert "routes.by value.type: value does not end with the '}' closing a JSON object (truncated, or text after it)" \
        in quarantined, quarantined
    assert any("amount" in e and "lots" in e for e in quarantined), quarantined

    # A rerun is a no-op for every table, without Spark.
    again = runner.run(pipeline, spark_factory=no_spark)
    assert again.status == "no-op" and commits(pipeline) == {"created": 2, "paid": 2, "quarantine": 2}
    shown = status(pipeline)
    assert {name: t["version"] for name, t in shown["routes"]["tables"].items()} == {
        "created": 2, "paid": 2, "quarantine": 2}  # created at version 0
    assert all(not t["behind"] for t in shown["routes"]["tables"].values())
    assert [row["position"] for row in shown["partitions"]] == [200, 200, 200]
    text = format_status(shown)
    assert "routed by value.type (unrouted: quarantine)" in text and f"route paid -> {tables(pipeline)['paid']}" in text
    # The oncemore page: the routes with each table's version, and the batch as one row with the
    # versions of its commits in each table.
    page = pipeline_overview(pipeline)
    assert page["routes"]["by"] == "value.type" and list(page["routes"]["tables"]) == ["created", "paid", "quarantine"]
    newest = page["batches"][0]
    assert newest["tables"] == {"created": 2, "paid": 2, "quarantine": 2}
    assert (newest["written"], newest["quarantined"]) == (len(expected["created"]) + len(expected["paid"]),
                                                          len(expected["quarantine"]))
    templates = jinja2.Environment(loader=jinja2.FileSystemLoader(ROOT / "plugins" / "oncemore_airflow" / "templates"))
    html = templates.get_template("_routes.html").render(routes=page["routes"])
    assert f"<code>{tables(pipeline)['paid']}</code>" in html and "quarantine (unrouted: quarantine)" in html

    more = produce(broker, topic, 600, 150)
    more["quarantine"] += more.pop("refunded")
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "committed"
    assert_exact(pipeline, {k: expected[k] + more[k] for k in expected}, spark)


def test_unrouted_records_skipped_are_counted_and_a_route_added_later_starts_where_the_quarantine_is(
        broker, topic, make_pipeline, spark, tmp_path):
    expected = produce(broker, topic, 0, 300, by_header=True)
    skipped = expected.pop("refunded")
    pipeline = routed(make_pipeline, topic, "skipping", tmp_path,
                      routes={"by": "headers['event_type']", "unrouted": "skip"})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert "unrouted (skipped)" in report.summary()
    assert_exact(pipeline, expected, spark)
    _, batch = oncemore_commits(pipeline.sink.quarantine_uri)[-1]
    assert batch.records["unrouted"] == len(skipped) and batch.records["quarantined"] == len(expected["quarantine"])
    audit = verify(pipeline, lambda: spark)
    assert audit.unrouted == len(skipped) and audit.offsets_without_row == 0

    # A route added to the pipeline starts where the quarantine table is: the refunded events it
    # skipped before stay counted, only those after land in the new route's table.
    later = routed(make_pipeline, topic, "skipping", tmp_path, routes={
        "by": "headers['event_type']", "unrouted": "skip", "tables": {
            **{v: {"table_uri": t.table_uri, "format": {"type": "json", "schema": CREATED if v == "created" else PAID}}
               for v, t in ((t.route, t) for t in pipeline.tables)},
            "refunded": {"table_uri": str(tmp_path / "skipping" / "refunded"),
                         "format": {"type": "json", "schema": "id BIGINT, type STRING"}}}})
    more = produce(broker, topic, 300, 150, by_header=True, routes=("created", "paid", "refunded"))
    assert runner.run(later, spark_factory=lambda: spark).status == "committed"
    assert_exact(later, {"created": expected["created"] + more["created"], "paid": expected["paid"] + more["paid"],
                         "quarantine": expected["quarantine"] + more["quarantine"], "refunded": more["refunded"]}, spark)
    first, = (r for _, r in oncemore_commits(tables(later)["refunded"]))
    assert first.ranges[topic] == {"0": [100, 150], "1": [100, 150], "2": [100, 150]}


def test_a_handed_plan_to_an_interval_end_lands_in_every_route_table(broker, topic, make_pipeline, spark, tmp_path):
    # As the Airflow DAG runs it: the plan task plans to the interval's end, the ingest task runs
    # that plan (through XCom, as JSON), the report task checks it landed.
    base = int(time.time() * 1000) - 3_600_000
    sent = [(i % 3, None, event(i)[1], base + (i // 3) * 1000) for i in range(120)]
    delivered = broker.produce(topic, sent)
    pipeline = routed(make_pipeline, topic, "interval", tmp_path)
    bound = OffsetBound("timestamp", timestamp_ms=base + 20 * 1000)  # events 0..59: 20 per partition

    plan = Plan.from_json(plan_run(pipeline, bound).to_json())
    report = runner.run(pipeline, plan=plan, spark_factory=lambda: spark)

    assert run_landed(pipeline, plan, report.run_id)["records"]["written"] == report.written
    everything = sorted((topic, p, o) for p, o in delivered)
    found = sorted(c for coordinates in landed(pipeline).values() for c in coordinates)
    assert found == [c for c in everything if c[2] < 20]
    assert verify(pipeline, lambda: spark).ok


def test_reset_check_delete_and_maintain_act_on_every_route_table_and_verify_accounts_for_them(
        broker, topic, make_pipeline, spark, tmp_path):
    expected = produce(broker, topic, 0, 150)
    expected["quarantine"] += expected.pop("refunded")
    pipeline = routed(make_pipeline, topic, "replayed", tmp_path)
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "committed"

    done = reset(pipeline, OffsetBound.parse('{"0": 20}'))  # partition 0's offsets 20-49 again, on purpose

    assert set(done["versions"]) == set(tables(pipeline).values())
    assert {name: t["positions"][f"{topic}/0"] for name, t in status(pipeline)["routes"]["tables"].items()} == {
        "created": 20, "paid": 20, "quarantine": 20}
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "committed"
    for name, coordinates in landed(pipeline).items():
        replayed = [c for c in expected[name] if c[1] == 0 and c[2] >= 20]
        assert sorted(coordinates) == sorted(expected[name] + replayed), name
    audit = verify(pipeline, lambda: spark)
    assert audit.ok, audit.describe()
    # oncemore check: each route's records and table, the quarantine table, and a sample of the topic.
    checks = check_pipeline(pipeline, lambda: spark, sample=30)
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    assert {"route created records", "route paid records", "route created table", "route paid table",
            "quarantine table", "sample"} <= {c.what for c in checks}, [c.line() for c in checks]

    # oncemore delete: the route table that has the column loses its matching rows, in a commit
    # recording their offsets; the others are left as they are; verify accounts for the deletion,
    # after maintenance (compaction, checkpoint, vacuum of every table) too.
    before = landed(pipeline)
    done = delete(pipeline, "customer = 'c1'")
    statuses = {tag: t["status"] for tag, t in done["tables"].items()}
    assert statuses["route:created"] == "deleted" and done["tables"]["route:created"]["rows"] > 0, done
    assert all(s.startswith("left as it is") for tag, s in statuses.items() if tag != "route:created"), done
    after = landed(pipeline)
    assert len(after["created"]) == len(before["created"]) - done["tables"]["route:created"]["rows"]
    assert {k: v for k, v in after.items() if k != "created"} == {k: v for k, v in before.items() if k != "created"}
    assert verify(pipeline, lambda: spark).ok
    assert set(maintain(pipeline)["tables"]) == {"route:created", "route:paid", "quarantine"}
    audit = verify(pipeline, lambda: spark)
    assert audit.ok, audit.describe()


def crashed(pipeline, step: str) -> None:
    process = oncemore_command(pipeline, "run", step)
    _, err = process.communicate(timeout=600)
    assert process.returncode == -signal.SIGKILL, err[-2000:]


def race(pipeline) -> list[tuple[int, str]]:
    racers = [oncemore_command(pipeline, "run") for _ in range(2)]
    errors = [r.communicate(timeout=600)[1] for r in racers]
    return [(r.returncode, err) for r, err in zip(racers, errors)]


# Where a run is killed in the second run's first batch, and which tables had committed it.
CRASHES = [("quarantine_committed", ("quarantine",)), ("route_committed", ("quarantine", "created"))]


@pytest.mark.parametrize("step,ahead", CRASHES, ids=[step for step, _ in CRASHES])
def test_a_crash_between_route_commits_reruns_only_the_tables_behind_alone_and_racing(
        step, ahead, broker, topic, make_pipeline, spark, tmp_path):
    first = produce(broker, topic, 0, 300)
    alone, racing = (routed(make_pipeline, topic, name, tmp_path, limits={"max_records_per_commit": 150})
                     for name in ("alone", "racing"))
    for pipeline in (alone, racing):
        assert runner.run(pipeline, spark_factory=lambda: spark).status == "committed"
        assert commits(pipeline) == {"created": 3, "paid": 3, "quarantine": 3}  # the anchors, two batches
    second = produce(broker, topic, 300, 300)
    expected = {k: first.get(k, []) + second.get(k, []) for k in ("created", "paid", "quarantine", "refunded")}
    expected["quarantine"] += expected.pop("refunded")

    for pipeline in (alone, racing):
        # Killed right after the quarantine table's commit of the next batch (quarantine_committed),
        # or after the first route table's too (route_committed): the tables after it do not hold it.
        crashed(pipeline, step)
        assert commits(pipeline) == {name: 4 if name in ahead else 3 for name in ("created", "paid", "quarantine")}
        behind = status(pipeline)["routes"]["tables"]
        assert {name for name, table in behind.items() if table["behind"]} == {"created", "paid"} - set(ahead)

    assert runner.run(alone, spark_factory=lambda: spark).status == "committed"
    results = race(racing)
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    for pipeline in (alone, racing):
        assert_exact(pipeline, expected, spark)
        # Each batch committed once to each table, whichever run made it: the rerun committed the
        # crashed batch to the tables behind alone, then the last batch to every table.
        assert commits(pipeline) == {"created": 5, "paid": 5, "quarantine": 5}
        made = {name: [r for _, r in oncemore_commits(uri)] for name, uri in tables(pipeline).items()}
        crashed_run = made["quarantine"][3].run_id
        for name, records in made.items():
            assert records[3].ranges == made["quarantine"][3].ranges
            assert (records[3].run_id == crashed_run) == (name in ahead), name
        if pipeline is alone:  # racing, either run may make a table's commit of the last batch
            assert len({records[4].run_id for records in made.values()}) == 1


def route_tables(tmp: Path, name: str, schemas: dict[str, str] | None = None, **uris: str) -> dict:
    """``routes.tables`` for the routes named (created, paid, refunded), each in ``tmp/name/<table>``
    (``schemas``: a route's schema other than its usual one)."""
    schemas = {"created": CREATED, "paid": PAID, "refunded": "id BIGINT, type STRING", **(schemas or {})}
    return {"tables": {route: {"table_uri": str(tmp / name / table), "format": {"type": "json", "schema": schemas[route]}}
                       for route, table in uris.items()}}


def placed(landing: dict[str, list], routes: tuple[str, ...]) -> dict[str, list]:
    """Where ``produce``'s records land under ``routes``: the others' into the quarantine (unrouted)."""
    found = {route: landing.get(route, []) for route in routes}
    found["quarantine"] = landing.get("quarantine", []) + [
        c for kind, coordinates in landing.items() if kind not in (*routes, "quarantine") for c in coordinates]
    return found


def test_routes_changed_between_runs_land_every_record_once_and_never_while_a_table_is_behind(
        broker, topic, make_pipeline, spark, tmp_path):
    from oncemore.core.errors import RoutesChanged

    def pipeline(schemas=None, **uris):
        return routed(make_pipeline, topic, "changes", tmp_path, limits={"max_records_per_commit": 150},
                      routes=route_tables(tmp_path, "changes", schemas, **uris))

    held: dict[str, list] = {}  # by table (its directory's name): the records expected in it

    def ingest(routes: dict[str, str], start: int, count: int, step: str | None = None):
        configured = pipeline(**routes)
        landing = placed(produce(broker, topic, start, count, routes=tuple(routes)), tuple(routes))
        for route, coordinates in landing.items():
            held.setdefault(routes.get(route, "quarantine"), []).extend(coordinates)
        if step:
            crashed(configured, step)
        else:
            assert runner.run(configured, spark_factory=lambda: spark, accept_quarantine=True).status == "committed"
        return configured

    def assert_held():
        for table, coordinates in held.items():
            assert_exactly_once(read_coordinates(str(tmp_path / "changes" / table)), coordinates)

    both = {"created": "created", "paid": "paid"}
    ingest(both, 0, 150)
    # A route removed: its records are unrouted (quarantined) meanwhile; re-added, its table takes
    # the records from there on, none of those quarantined while it was away.
    ingest({"created": "created"}, 150, 150)
    ingest(both, 300, 150)
    assert_held()
    # A route added, the run killed once the quarantine table committed its first part under it
    # (before the new table's first commit): the rerun lands that part's refunded events in it.
    three = {**both, "refunded": "refunded"}
    ingest(three, 450, 150, step="quarantine_committed")
    assert runner.run(pipeline(**three), spark_factory=lambda: spark).status == "committed"
    assert_held()
    assert_exact(pipeline(**three), {t: held[t] for t in (*three, "quarantine")}, spark)

    # Every route table behind the quarantine table (a crash between a part's commits): a change of
    # routes is refused, naming the table and the offsets it lacks, until the routes of the last run
    # have brought every table level.
    ingest(three, 600, 150, step="quarantine_committed")
    moved = {**three, "paid": "paid_moved"}
    with pytest.raises(RoutesChanged) as refused:
        runner.run(pipeline(**moved), spark_factory=no_spark)
    line = str(refused.value)
    assert "\n" not in line and f"route created's table {tmp_path / 'changes' / 'created'} still lacks topic {topic} " \
        "partition 0 offsets [200, 250)" in line and "route paid's table" in line, line
    # A route's format is part of its routes: a record it refuses now was committed as good by the
    # quarantine table's part, and would land in no table.
    with pytest.raises(RoutesChanged, match="route created's format"):
        runner.run(pipeline({"created": CREATED + ", amount BIGINT"}, **three), spark_factory=no_spark)
    shown = status(pipeline(**moved))["routes"]
    assert shown["changed_from"] and shown["tables"]["created"]["behind"] == {
        f"{topic}/{p}": [200, 250] for p in range(3)}
    assert runner.run(pipeline(**three), spark_factory=lambda: spark).status == "committed"
    # Moved once level: the route's new table takes its records from there on, the old one keeps its
    # own, and verify reads it as a table the routes named.
    ingest(moved, 750, 150)
    assert_held()
    audit = verify(pipeline(**moved), lambda: spark)
    assert audit.ok, audit.describe()
    former = f"paid ({tmp_path / 'changes' / 'paid'}), no longer routed"
    assert audit.tables[former]["rows"] == len(held["paid"])
    assert sum(t["rows"] for t in audit.tables.values()) == sum(map(len, held.values()))


def test_a_run_under_the_old_routes_stops_once_a_run_under_new_ones_committed(
        broker, topic, make_pipeline, spark, tmp_path, monkeypatch):
    from oncemore.core import crashpoints
    from oncemore.core.errors import RoutesChanged

    def pipeline(**uris):
        return routed(make_pipeline, topic, "deploy", tmp_path, limits={"max_records_per_commit": 150},
                      quarantine={"max_fraction": 1}, routes=route_tables(tmp_path, "deploy", **uris))

    two = {"created": "created", "paid": "paid"}
    three = {**two, "refunded": "refunded"}
    produced = produce(broker, topic, 0, 150)
    assert runner.run(pipeline(**two), spark_factory=lambda: spark).status == "committed"  # 50 a partition
    more = produce(broker, topic, 150, 450)
    reached = crashpoints.reach
    seen = []

    def deploy(step: str, nth: int, *args: str):
        """At the old run's ``nth`` ``step``, a deploy adds a route, and a run with it (``args``)
        commits the quarantine table's part under the new routes and dies before its route tables'."""
        def reach(reaching: str) -> None:
            if reaching == step:
                seen.append(step)
                if len(seen) == nth:
                    process = oncemore_command(pipeline(**three), "run", "quarantine_committed", args=args)
                    _, err = process.communicate(timeout=600)
                    assert process.returncode == -signal.SIGKILL, err[-2000:]
            reached(reaching)
        return reach

    # Between two parts of the old run: its next part is refused, naming the new route's table behind.
    monkeypatch.setattr(crashpoints, "reach", deploy("route_committed", 2))
    with pytest.raises(RoutesChanged, match="route refunded removed"):
        runner.run(pipeline(**two), spark_factory=lambda: spark)
    # Within a part, the run under new routes reading other partitions (so no position the old
    # part builds on moved): the old part commits nothing under routes no longer in force.
    assert runner.run(pipeline(**three), spark_factory=lambda: spark).status == "committed"
    later = produce(broker, topic, 600, 300)
    seen.clear()
    monkeypatch.setattr(crashpoints, "reach", deploy("validated", 1, "--until", json.dumps({topic: {"1": 300}})))
    with pytest.raises(RoutesChanged, match="route refunded removed"):
        runner.run(pipeline(**two), until=OffsetBound.parse(json.dumps({topic: {"0": 300}})),
                   spark_factory=lambda: spark)
    monkeypatch.setattr(crashpoints, "reach", reached)
    # Neither old run dropped the new route's start: the run under the new routes lands every record once.
    assert runner.run(pipeline(**three), spark_factory=lambda: spark).status == "committed"
    found = [tuple(c) for coordinates in landed(pipeline(**three)).values() for c in coordinates]
    assert_exactly_once(found, [c for landing in (produced, more, later) for coordinates in landing.values()
                                for c in coordinates])
    audit = verify(pipeline(**three), lambda: spark)
    assert audit.ok, audit.describe()
