"""The CLI as a user runs it: subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, assert_exactly_once, oncemore, orders, read_pairs

INCLUDE = str(Path(__file__).resolve().parents[1] / "include")


@pytest.mark.spark
def test_run_then_noop_rerun_without_spark_plan_and_status(broker, topic, make_pipeline):
    produced = broker.produce(topic, orders(0, 900))
    pipeline = make_pipeline(topic)
    env = {"ONCEMORE_PIPELINES_DIR": str(Path(pipeline.origin).parent)}

    planned = oncemore("plan", "orders", "--json", env=env, check_no_spark=True)
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert sum(r["end"] - r["start"] for b in plan["batches"] for r in b["ranges"]) >= 900

    first = oncemore("run", "orders", "--profile", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "committed 1 batch(es), 900 records written, 0 quarantined" in first.stdout
    printed = {line.split()[0]: float(line.split()[-1]) for line in first.stdout.splitlines()[2:]}
    assert set(printed) >= {"plan", "spark_start", "prepare", "spark_job", "read", "decode", "write", "validate",
                            "commit", "run"}, first.stdout
    assert 0 < printed["spark_start"] < printed["run"], "the JVM's start is part of the run"
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    # Quiet by default: Spark's start-up output went to its log file, not between oncemore's lines.
    for noise in ("Using incubator modules", "log4j", "NativeCodeLoader", "WARN Utils"):
        assert noise not in first.stderr and noise not in first.stdout, noise
    # Not a terminal: progress is structured log lines on stderr.
    (progress,) = [json.loads(line[line.index("{"):]) for line in first.stderr.splitlines() if '"event": "progress"' in line]
    assert progress["offsets_done"] == progress["offsets_total"] == progress["records"] == 900
    assert progress["bytes"] > 0 and progress["eta_seconds"] == 0 and (progress["batch"], progress["batches"]) == (0, 1)

    again = oncemore("run", "orders", env=env, check_no_spark=True)
    assert again.returncode == 0, again.stderr
    assert "no-op (nothing new to ingest)" in again.stdout

    status = oncemore("status", "--config", pipeline.origin, "--json", check_no_spark=True)
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)["partitions"]
    assert [r["lag"] for r in rows] == [0, 0, 0]
    assert all(r["position"] == r["log_end"] and r["last_commit"] for r in rows)
    # A reader that stops reading (`| head`, here `| true`, gone before the first line) is no error to report.
    piped = subprocess.run(f"{sys.executable} -m oncemore.cli status --config {pipeline.origin} --json | true",
                           shell=True, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": INCLUDE})
    assert piped.stderr == ""


@pytest.mark.spark
def test_ctrl_c_mid_run_says_in_one_line_what_was_committed_and_the_rerun_is_exact(broker, topic, make_pipeline):
    from oncemore.plan.ledger import Ledger

    produced = broker.produce(topic, orders(0, 60_000))
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 2_000})  # 30 batches
    ledger = Ledger(pipeline.sink.table_uri, pipeline.name)
    run = subprocess.Popen([sys.executable, "-m", "oncemore.cli", "run", "--config", pipeline.origin],
                           env={**os.environ, "PYTHONPATH": INCLUDE, "ONCEMORE_SPARK_MASTER": "local[2]"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    while len(ledger.recent_batches()) < 2 and run.poll() is None:
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground process group
    out, err = run.communicate(timeout=120)

    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Py4J" not in err, err[-3000:]
    committed = [e for e in ledger.recent_batches(100) if e.record.pipeline == "orders"]
    ids = {e.record.run_id for e in committed}
    assert len(ids) == 1 and 2 <= len(committed) < 30
    assert err.splitlines()[-1] == (
        f"oncemore: interrupted: pipeline orders: run {ids.pop()} had committed {len(committed)} batch(es), table "
        f"version {max(e.version for e in committed)}; a rerun carries on from the table's positions")
    assert oncemore("run", "--config", pipeline.origin).returncode == 0
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_an_error_raised_while_a_ctrl_c_unwinds_is_the_interrupt(tmp_path, monkeypatch):
    # What CI caught once: py4j shut the gateway connection the Ctrl-C interrupted, and PySpark's
    # call-site reset on the way out (SCCallSiteSync.__exit__) raised a network error in its place.
    from argparse import Namespace

    from py4j.protocol import Py4JNetworkError

    from oncemore.cli import _spark_for
    from oncemore.run.jobs import task_failure

    def job_ended_by_ctrl_c():
        try:
            try:
                raise KeyboardInterrupt
            finally:
                raise Py4JNetworkError("Answer from Java side is empty")
        except Exception as exc:  # how the run wraps a failed job
            raise task_failure(exc, "orders", [[]]) from exc

    with pytest.raises(KeyboardInterrupt) as raised:
        with _spark_for("orders", Namespace(verbose=True, remote=None, master=None)):
            job_ended_by_ctrl_c()
    assert "Answer from Java side is empty" in str(raised.value.__cause__)
    # Any other failure is still the failure it is.
    with pytest.raises(Py4JNetworkError):
        with _spark_for("orders", Namespace(verbose=True, remote=None, master=None)):
            raise Py4JNetworkError("Answer from Java side is empty")

    # A Ctrl-C while the session stops, after the command's work.
    import oncemore.run.session as session

    def stopped_by_ctrl_c(_):
        try:
            raise KeyboardInterrupt
        finally:
            raise Py4JNetworkError("Answer from Java side is empty")

    monkeypatch.setattr(session, "spark_session", lambda *args, **kwargs: object())
    monkeypatch.setattr(session, "stop_session", stopped_by_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        with _spark_for("orders", Namespace(verbose=True, remote=None, master=None)) as spark:
            spark()


def test_plan_prints_ranges(broker, topic, make_pipeline):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    result = oncemore("plan", "--config", pipeline.origin, "--until", '{"0": 5}')
    assert result.returncode == 0, result.stderr
    assert f"{topic}/0 [0, 5)" in result.stdout
    # Not named by --until: only its start is recorded with the first commit.
    assert f"{topic}/1: nothing to read, position recorded at 0" in result.stdout


def test_bad_config_exits_2_naming_file_and_key(tmp_path):
    path = tmp_path / "orders.yaml"
    path.write_text("name: orders\nsource: {bootstrap_servers: x, topic: t, surprise: 1}\n")
    result = oncemore("plan", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"oncemore: error: {path}: source.surprise: unknown key (allowed: bootstrap_servers, kafka_options, "
        "stall_timeout_seconds, starting_offsets, topic, topic_pattern, topics); sink: is required")
    # format (or routes) is checked once the rest holds: a file without one says so.
    path.write_text("name: orders\nsource: {bootstrap_servers: x, topic: t}\nsink: {table_uri: /tmp/t}\n")
    result = oncemore("plan", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"oncemore: error: {path}: format: is required"), \
        result.stderr


def test_unknown_pipeline_and_bad_until(tmp_path, broker, topic, make_pipeline):
    result = oncemore("plan", "nope", env={"ONCEMORE_PIPELINES_DIR": str(tmp_path)})
    assert result.returncode == 2 and "no pipeline named 'nope'" in result.stderr
    pipeline = make_pipeline(topic)
    result = oncemore("plan", "--config", pipeline.origin, "--until", "tomorrow")
    assert result.returncode == 2 and "--until must be latest" in result.stderr


def test_missing_topic_is_a_one_line_error(make_pipeline):
    pipeline = make_pipeline("no_such_topic")
    result = oncemore("plan", "--config", pipeline.origin)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("oncemore: error: pipeline orders: topic 'no_such_topic' is not available")


def test_status_without_a_pipeline_prints_a_line_per_pipeline(tmp_path, broker, topic):
    from devtools.fleet import write_fleet

    broker.produce(topic, [(i % 3, None, b"x", None) for i in range(30)])
    directory = tmp_path / "pipelines"
    write_fleet(directory, tmp_path / "delta", broker.bootstrap_servers, {topic: 3}, 12)
    env = {"ONCEMORE_PIPELINES_DIR": str(directory)}

    shown = oncemore("status", env=env, check_no_spark=True)

    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["pipeline", "state", "lag", "lag_time", "last_commit_age", "verify", "quarantined_24h",
                                "tags"]
    assert [line.split()[0] for line in lines[1:]] == [f"fleet_{i:03d}" for i in range(12)]
    assert lines[1].split()[:3] == ["fleet_000", "ok", "24"] and lines[1].split()[-1] == "fleet,even"
    assert lines[10].split()[:3] == ["fleet_009", "new", "30"]  # never run: the whole topic behind
    rows = json.loads(oncemore("status", "--json", env=env).stdout)["pipelines"]
    assert [(r["pipeline"], r["state"], r["lag"], r["quarantined_24h"]) for r in rows[:3]] == [
        ("fleet_000", "ok", 24, 0), ("fleet_001", "ok", 24, 2), ("fleet_002", "ok", 24, 4)]

    # A file that does not load and a pipeline that cannot be read: each named, the others still shown, exit 1.
    (directory / "typo.yaml").write_text("name: typo\nsource: {bootstrap_server: 'k:9092', topic: t}\n")
    (directory / "gone.yaml").write_text(yaml.safe_dump({
        "name": "gone", "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": "no_such_topic_here"},
        "sink": {"table_uri": str(tmp_path / "delta" / "gone")}, "format": {"type": "raw"}}))
    shown = oncemore("status", env=env, check_no_spark=True)
    assert shown.returncode == 1
    lines = shown.stdout.splitlines()
    assert len(lines) == 1 + 13 + 1 and lines[-1].startswith(f"broken: {directory / 'typo.yaml'}: ")
    (gone,) = [line for line in lines if line.startswith("gone ")]
    assert gone.split()[1] == "error" and "pipeline gone: topic 'no_such_topic_here' is not available" in gone


def test_version_and_list_name_every_pipeline_and_every_broken_file(tmp_path):
    assert oncemore("--version").stdout.strip() == f"oncemore {__import__('oncemore').__version__}"
    (tmp_path / "orders.yaml").write_text(
        "name: orders\nsource: {bootstrap_servers: 'k:9092', topic: orders}\nsink: {table_uri: /tmp/t/orders}\n"
        "format: {type: raw}\n")
    (tmp_path / "typo.yaml").write_text("name: typo\nsource: {bootstrap_server: 'k:9092', topic: t}\n")
    listed = oncemore("list", env={"ONCEMORE_PIPELINES_DIR": str(tmp_path)})
    assert listed.returncode == 1, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == f"orders: topic orders -> /tmp/t/orders ({tmp_path / 'orders.yaml'})"
    assert lines[1].startswith(f"broken: {tmp_path / 'typo.yaml'}: ") and len(lines) == 2
    (tmp_path / "typo.yaml").unlink()
    assert oncemore("list", env={"ONCEMORE_PIPELINES_DIR": str(tmp_path)}).returncode == 0


def test_check_says_what_works_and_what_not_one_line_each_and_writes_nothing(broker, topic, make_pipeline, registry,
                                                                             tmp_path):
    from confluent_kafka.admin import AdminClient

    good = make_pipeline(topic, name="good")
    (tmp_path / "a-file").write_text("not a directory")
    make_pipeline("no_such_topic", name="ghost", sink={"table_uri": str(tmp_path / "a-file" / "ghost")})
    make_pipeline(topic, name="unregistered", format={"type": "avro", "schema_registry": registry.settings()})
    directory = Path(good.origin).parent
    (directory / "typo.yaml").write_text(Path(good.origin).read_text().replace("name: good", "name: typo")
                                         .replace("bootstrap_servers:", "bootstrap_server:"))
    env = {"ONCEMORE_PIPELINES_DIR": str(directory)}
    topics_before = set(AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10).topics)

    one = oncemore("check", "good", env=env, check_no_spark=True)
    assert one.returncode == 0, one.stdout + one.stderr
    lines = one.stdout.splitlines()
    assert [line.split(":")[0:2] for line in lines] == [
        ["ok     good", " config"], ["ok     good", " kafka"], ["ok     good", f" topic {topic}"],
        ["ok     good", " read"], ["ok     good", " positions"], ["ok     good", " records"], ["ok     good", " table"],
        ["ok     good", " quarantine table"], ["ok     good", " airflow"]], lines
    assert f"topic {topic}: 3 partitions, topic ID " in lines[2]
    assert lines[3] == f"ok     good: read: a fetch of each topic is allowed ({topic})"
    assert lines[4] == "ok     good: positions: none yet: the first run starts at earliest"
    assert lines[5] == "ok     good: records: 7 columns decoded"
    assert "no table yet" in lines[6] and "the first run creates it" in lines[6]
    assert lines[8] == "ok     good: airflow: no airflow block: no DAG (CLI only)"

    every = oncemore("check", env=env, check_no_spark=True)
    assert every.returncode == 1
    failed = [line for line in every.stdout.splitlines() if line.startswith("FAILED")]
    assert failed[0].startswith(f"FAILED {directory / 'typo.yaml'}: config: ")
    assert "FAILED ghost: topics: pipeline ghost: topic 'no_such_topic' is not available: it does not exist" in failed
    assert f"FAILED ghost: table: {tmp_path / 'a-file' / 'ghost'}: {tmp_path / 'a-file'} is a file, not a directory" in failed
    registry_line, = [line for line in failed if "schema registry" in line]
    assert registry_line.startswith("FAILED unregistered: schema registry: ") and f"{topic}-value" in registry_line
    assert len(failed) == 4, failed
    assert "ok     good: table:" in every.stdout

    # Nothing written: no table, no directory, no topic (a named Metadata request can auto-create one).
    # Kafka's own __consumer_offsets aside: a broker creates it when first asked for a group's
    # coordinator, as the consumer of check's fetch asks (librdkafka's consumers all do).
    assert not (tmp_path / "delta").exists()
    topics_after = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10).topics
    assert {t for t in topics_after if not t.startswith("__")} == {t for t in topics_before if not t.startswith("__")}


@pytest.mark.spark
def test_check_finds_what_the_run_would_fail_on(broker, topic, make_pipeline, registry, tmp_path):
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
    from deltalake import DeltaTable

    broker.produce(topic, orders(0, 30))
    owner = make_pipeline(topic, name="owner")
    env = {"ONCEMORE_PIPELINES_DIR": str(Path(owner.origin).parent)}
    assert oncemore("run", "owner", env=env).returncode == 0
    # A transform, an expectation, a partition column naming columns the records do not have.
    make_pipeline(topic, name="unresolved", transform="SELECT *, upper(cutsomer) AS shop FROM records")
    make_pipeline(topic, name="expecting", expectations=[{"name": "positive", "check": "amuont > 0"}])
    make_pipeline(topic, name="partitioned", transform="SELECT *, upper(customer) AS shops FROM records",
                  sink={"partition_by": ["shop"]})
    # The registry's latest schema changes a column's type in the table the pipeline writes.
    registered = make_pipeline(topic, name="registered", format={"type": "avro", "schema_registry": registry.settings()})
    SchemaRegistryClient(registry.settings()).register_schema(f"{topic}-value", Schema(json.dumps(
        {"type": "record", "name": "Order", "fields": [{"name": "id", "type": "string"}]}), "AVRO"))
    DeltaTable.create(registered.sink.table_uri, schema=__import__("pyarrow").schema([("id", "int64")]))
    # A file outside the pipelines directory pointing at a directory pipeline's table.
    (tmp_path / "elsewhere").mkdir()
    stray = tmp_path / "elsewhere" / "stray.yaml"
    stray.write_text(yaml.safe_dump({**yaml.safe_load(Path(owner.origin).read_text()), "name": "stray"}))
    # A pipeline configured elsewhere, on another topic, into the owner's table.
    broker.create_topic(f"{topic}_b", 3)
    config = yaml.safe_load(Path(owner.origin).read_text())
    intruder = tmp_path / "elsewhere" / "intruder.yaml"
    intruder.write_text(yaml.safe_dump({**config, "name": "intruder", "source": {**config["source"], "topic": f"{topic}_b"},
                                        "sink": {**config["sink"], "quarantine_uri": str(tmp_path / "intruder_q")}}))

    done = oncemore("check", "unresolved", "expecting", "partitioned", "registered", str(stray), env=env)
    elsewhere = oncemore("check", str(intruder), env={"ONCEMORE_PIPELINES_DIR": str(tmp_path / "elsewhere")})

    assert done.returncode == 1
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert any(line.startswith("FAILED unresolved: records: pipeline unresolved: transform: ")
               and "UNRESOLVED_COLUMN" in line and "cutsomer" in line for line in failed), failed
    assert any(line.startswith("FAILED expecting: records: pipeline expecting: expectation positive: ")
               and "amuont" in line for line in failed), failed
    assert "FAILED partitioned: records: pipeline partitioned: sink.partition_by: 'shop' is not a column of the " \
           "table (id, customer, amount, _kafka_topic, _kafka_partition, _kafka_offset, _kafka_timestamp, " \
           "shops)" in failed
    assert any(line.startswith("FAILED registered: records: pipeline registered: table ") and
               "column id: the table has bigint, the records have string" in line for line in failed), failed
    assert f"FAILED {stray}: config: sink.table_uri: is also the table of pipeline owner ({owner.origin}, " \
           "sink.table_uri); a table belongs to one pipeline" in failed
    assert len(failed) == 5, failed
    assert "Traceback" not in done.stderr and "SQLQueryContextLogger" not in done.stderr + done.stdout
    # The run fails on the same transform with one line (PySpark's JSON log of the error went to the Spark log).
    failed_run = oncemore("run", "unresolved", env=env)
    assert failed_run.returncode == 1
    said = [line for line in failed_run.stderr.splitlines() if line.startswith("oncemore:")]
    assert said[0].startswith("oncemore: Spark's output is in ") and len(said) == 2
    assert said[1].startswith("oncemore: error: pipeline unresolved: transform: ") and "cutsomer" in said[1]
    assert failed_run.stderr.splitlines()[-1] == said[1]
    assert "SQLQueryContextLogger" not in failed_run.stderr and "Traceback" not in failed_run.stderr
    assert elsewhere.returncode == 1 and f"FAILED intruder: positions: pipeline intruder: table {owner.sink.table_uri} " \
        "(version 1) belongs to pipeline owner: its oncemore commits are by owner, none by intruder. A table belongs " \
        "to one pipeline: point intruder's sink.table_uri at a table of its own." in elsewhere.stdout.splitlines()


def test_the_cli_page_lists_every_command_and_option_the_cli_has():
    from oncemore.cli import _parser

    block = (ROOT / "docs" / "cli.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    lines = {line.split()[1]: line for line in block.strip().splitlines() if len(line.split()) > 1}
    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    assert set(lines) - {"--version"} == set(commands)
    for name, command in commands.items():
        options = {o for a in command._actions for o in a.option_strings if o.startswith("--")} - {"--help", "--config"}
        missing = [o for o in sorted(options) if o not in lines[name]]
        assert not missing, f"docs/cli.md's `oncemore {name}` lacks {missing}"


def test_check_on_s3_finds_a_missing_bucket_and_writes_nothing_to_an_existing_one(broker, topic, make_pipeline,
                                                                                  s3_server, s3_bucket):
    options = s3_server.storage_options()
    there = make_pipeline(topic, name="there", sink={"table_uri": f"{s3_bucket}/there",
                                                     "quarantine_uri": f"{s3_bucket}/there_quarantine",
                                                     "storage_options": options})
    make_pipeline(topic, name="nowhere", sink={"table_uri": "s3://no-such-bucket/t",
                                               "quarantine_uri": f"{s3_bucket}/nowhere_quarantine",
                                               "storage_options": options})
    env = {"ONCEMORE_PIPELINES_DIR": str(Path(there.origin).parent)}

    result = oncemore("check", "there", "nowhere", env=env, check_no_spark=True)

    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert f"ok     there: table: {s3_bucket}/there: no table yet; the first run creates it (whether the store " \
           "takes writes shows then: checking would write)" in lines
    assert "FAILED nowhere: table: s3://no-such-bucket/t: bucket no-such-bucket does not exist" in lines
    assert s3_server.client().list_objects_v2(Bucket=s3_bucket.removeprefix("s3://")).get("KeyCount", 0) == 0


def test_check_of_a_topic_pattern_with_kafka_down_says_so_and_goes_on(make_pipeline, tmp_path):
    path = tmp_path / "by_pattern.yaml"
    path.write_text(yaml.safe_dump({
        "name": "by_pattern", "source": {"bootstrap_servers": "127.0.0.1:1", "topic_pattern": "orders-.*"},
        "sink": {"table_uri": str(tmp_path / "delta" / "by_pattern")}, "format": {"type": "raw"}}))

    result = oncemore("check", str(path), check_no_spark=True)

    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("FAILED by_pattern: kafka: pipeline by_pattern: cannot reach Kafka at 127.0.0.1:1: ")
    assert [line.split(":")[1].strip() for line in lines] == ["config", "kafka", "records", "table", "quarantine table",
                                                              "airflow"]


def test_check_takes_config_files_of_any_name_as_every_command_does(tmp_path):
    path = tmp_path / "by_pattern.pipeline"
    path.write_text(yaml.safe_dump({
        "name": "by_pattern", "source": {"bootstrap_servers": "127.0.0.1:1", "topic_pattern": "orders-.*"},
        "sink": {"table_uri": str(tmp_path / "delta" / "by_pattern")}, "format": {"type": "raw"}}))
    env = {"ONCEMORE_PIPELINES_DIR": str(tmp_path / "pipelines")}

    alone = oncemore("check", "--config", str(path), env=env, check_no_spark=True)
    mixed = oncemore("check", "missing", "--config", str(path), env=env, check_no_spark=True)

    # Checked (Kafka is not there), not refused as a usage error (exit 2).
    assert alone.returncode == 1, alone.stderr
    lines = alone.stdout.splitlines()
    assert lines[0].startswith("ok     by_pattern: config") and lines[1].startswith("FAILED by_pattern: kafka: ")
    assert mixed.returncode == 1, mixed.stderr
    assert mixed.stdout.splitlines()[0].startswith("FAILED ") and "missing" in mixed.stdout.splitlines()[0]
    assert mixed.stdout.splitlines()[1:] == lines
