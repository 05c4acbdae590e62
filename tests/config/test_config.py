from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from oncemore.config.loading import load_all, load_pipeline
from oncemore.config.values import ConfigError, OffsetBound, parse_timestamp_ms

ROOT = Path(__file__).resolve().parents[2]

VALID = {
    "name": "orders",
    "source": {"bootstrap_servers": "${KAFKA_BOOTSTRAP}", "topic": "orders",
               "kafka_options": {"security.protocol": "SASL_SSL", "sasl.password": "${KAFKA_PASSWORD}"}},
    "sink": {"table_uri": "/data/delta/orders", "quarantine_uri": "/data/delta/orders_quarantine"},
    "format": {"type": "json", "schema": "id BIGINT, customer STRING, amount DOUBLE"},
    "limits": {"max_records_per_commit": 1000},
    "fail_on_data_loss": True,
    "airflow": {"owner": "data-platform", "start_date": "2026-11-01T00:00:00Z"},
}
ENV = {"KAFKA_BOOTSTRAP": "kafka:9092", "KAFKA_PASSWORD": "hunter2"}


def write(tmp_path: Path, doc, name: str = "orders") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return path


def with_change(path: str, value):
    doc = yaml.safe_load(yaml.safe_dump(VALID))
    *parents, last = path.split(".")
    target = doc
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return doc


def test_loads_with_env_substitution_and_redacts_secrets(tmp_path):
    pipeline = load_pipeline(write(tmp_path, VALID), ENV)
    assert pipeline.source.bootstrap_servers == "kafka:9092"
    assert pipeline.source.kafka_options["sasl.password"] == "hunter2"
    # A scheduled pipeline starts new partitions at its first data interval.
    assert pipeline.source.starting_offsets == OffsetBound("timestamp", timestamp_ms=parse_timestamp_ms("2026-11-01"))
    assert pipeline.limits.max_records_per_commit == 1000
    # The quarantine limit's defaults fail a batch of 600 records that are all quarantined.
    assert (pipeline.quarantine.max_fraction, pipeline.quarantine.min_quarantined) == (0.5, 10)
    shown = str(pipeline.redacted())
    assert "hunter2" not in shown and "***" in shown and "SASL_SSL" in shown


@pytest.mark.parametrize(
    "change, value, key, problem",
    [
        ("source.topic", KeyError, "source.topic", "set exactly one of topic, topics and topic_pattern"),
        ("source.topics", ["a", "a"], "source.topic", "set exactly one of topic, topics and topic_pattern (found topic, topics)"),
        ("source.topic", "bad topic", "source.topic", "should match pattern"),
        ("source.topik", "x", "source.topik", "unknown key"),
        ("limits.max_records_per_commit", "many", "limits.max_records_per_commit", "must be an integer, got a string"),
        ("limits.max_records_per_commit", True, "limits.max_records_per_commit", "must be an integer, got true/false"),
        ("limits.max_records_per_commit", 0, "limits.max_records_per_commit", "greater than or equal to 1"),
        ("format.type", "avro", "format.schema_registry", "with a url is required for avro"),
        ("format.type", "csv", "format.type", "'json', 'avro', 'protobuf', 'raw' or 'string'"),
        ("format.schema", "id BIGINT, payload MAP<INT,STRING>", "format.schema", "STRING keys"),
        ("format.schema", "id BIGINT, _kafka_offset BIGINT", "format.schema", "reserved"),
        ("source.starting_offsets", "yesterday", "source.starting_offsets", "ISO-8601"),
        ("sink.quarantine_uri", "/data/delta/orders", "sink.quarantine_uri", "must differ"),
        ("sink.quarantine_uri", "/data/x/../delta/./orders/", "sink.quarantine_uri", "must differ"),
        ("sink.tombstones_uri", "/data/delta/./orders", "sink.tombstones_uri", "must differ"),
        ("sink.partition_by", ["nope"], "sink.partition_by", "not a column"),
        ("sink.partition_by", ["amount"], "sink.partition_by", "has type double"),
        ("fail_on_data_loss", "yes", "fail_on_data_loss", "must be true or false, got a string"),
        ("sink.partition_by", "day", "sink.partition_by", "must be a list, got a string"),
        ("source.bootstrap_servers", KeyError, "source.bootstrap_servers", "is required"),
        ("airflow.start_date", KeyError, "airflow.start_date", "is required"),
        ("airflow.end_date", "2026-10-31T23:00:00Z", "airflow.end_date", "is before start_date"),
        ("airflow.end_date", "2026-11-30T00:00:00Z", "airflow.end_date", "needs catchup: true"),
        ("airflow.schedule", "0 25 * * *", "airflow.schedule", "is not a valid cron: a field is out of range"),
        ("airflow.schedule", "@every_hour", "airflow.schedule", "is not a 5-field cron (minute hour day-of-month "
                                                                "month day-of-week) or one of @hourly, @daily"),
        ("airflow.schedule", "*/5 * *", "airflow.schedule", "is not a 5-field cron"),
        ("name", "Orders!", "name", "lowercase"),
        ("upsert", {"keys": ["nope"]}, "upsert.keys", "'nope' is not a column of the row"),
        ("upsert", {"keys": ["amount"]}, "upsert.keys", "has type double; a key column compares exactly"),
        ("upsert", {"keys": ["id", "ID"]}, "upsert.keys", "names a column twice"),
        ("upsert", {"keys": ["id"], "envelope": "debezium", "delete_when": "x = 1"}, "upsert.delete_when",
         "applies to envelope none"),
        ("upsert", {"keys": ["id"], "envelope": "cdc"}, "upsert.envelope", "'debezium' or 'none'"),
        ("upsert", {"keys": ["id"], "merge": "spark"}, "upsert.merge", "'local' or 'cluster'"),
        ("upsert", {"keys": ["id"], "unavailable_value_placeholder": ""}, "upsert.unavailable_value_placeholder",
         "at least 1 character"),
        ("upsert", {"keys": ["id"], "unavailable_value_placeholder": 7}, "upsert.unavailable_value_placeholder",
         "string"),
        ("sink.catalog", {"type": "hive", "database": "bronze", "table": "orders"}, "sink.catalog.uri", "is required"),
        ("sink.catalog", {"type": "hive", "uri": "http://metastore:9083", "database": "bronze", "table": "orders"},
         "sink.catalog.uri", "should match pattern"),
        ("sink.catalog", {"type": "glue", "uri": "thrift://metastore:9083", "database": "bronze", "table": "orders"},
         "sink.catalog.uri", "unknown key (allowed: database, table, type)"),
        ("sink.catalog", {"type": "unity", "database": "bronze", "table": "orders"}, "sink.catalog",
         "needs a type: hive or glue"),
        ("sink.catalog", {"database": "bronze", "table": "orders"}, "sink.catalog", "needs a type: hive or glue"),
        ("sink.catalog", {"type": "glue", "database": "Bronze", "table": "orders"}, "sink.catalog.database",
         "should match pattern"),
        ("sink.catalog", {"type": "glue", "database": "bronze"}, "sink.catalog.table", "is required"),
        ("quarantine", {"max_fraction": 0}, "quarantine.max_fraction", "greater than 0"),
        ("quarantine", {"max_fraction": 1.5}, "quarantine.max_fraction", "less than or equal to 1"),
        ("quarantine", {"max_fraction": "half"}, "quarantine.max_fraction", "must be a number"),
        ("quarantine", {"min_quarantined": 0}, "quarantine.min_quarantined", "greater than or equal to 1"),
        ("quarantine", {"min_quarantined": 2.5}, "quarantine.min_quarantined", "must be an integer"),
        ("quarantine", {"max_share": 0.2}, "quarantine.max_share", "unknown key"),
        ("format", {"type": "raw", "schemas_enable": True}, "format.schemas_enable",
         "applies to type json (Kafka Connect's JsonConverter), not raw"),
        ("key", {"type": "json", "schema": "id INT", "schemas_enable": True, "confluent_framing": True},
         "key.schemas_enable", "and confluent_framing are two different writers"),
        ("format.schemas_enable", "yes", "format.schemas_enable", "must be true or false"),
    ],
)
def test_invalid_configs_name_file_key_and_problem(tmp_path, change, value, key, problem):
    path = write(tmp_path, with_change(change, value))
    with pytest.raises(ConfigError) as error:
        load_pipeline(path, ENV)
    assert error.value.source == str(path)
    assert error.value.key == key
    assert problem in error.value.problem
    assert str(path) in str(error.value) and key in str(error.value)


def _blocks(model, prefix=""):
    """Every block of the pipeline model (nested, optional and listed ones), as dotted keys; a
    listed block's key names its first item."""
    import typing

    from oncemore.config.loading import _model_of

    found = [prefix]
    for name, field in model.model_fields.items():
        inner = _model_of(field.annotation)
        if inner is not None:
            item = {tuple: "0.", dict: "v."}.get(typing.get_origin(field.annotation), "")  # a list's first, a map's "v"
            found += _blocks(inner, f"{prefix}{field.alias or name}.{item}")
    return found


def test_a_typo_in_any_block_is_an_unknown_key_listing_the_allowed_ones(tmp_path):
    from oncemore.config.model import Pipeline

    blocks = _blocks(Pipeline)
    assert {"", "source.", "sink.", "format.", "key.", "transform.", "expectations.0.", "limits.", "quarantine.",
            "alert.", "maintenance.", "airflow.", "routes.", "routes.tables.v.", "routes.tables.v.format."} <= set(blocks)
    for block in blocks:
        doc = yaml.safe_load(yaml.safe_dump(VALID))
        target = doc
        parts = block.rstrip(".").split(".") if block else []
        for i, key in enumerate(parts):
            if key in ("0", "v"):
                continue
            if i + 1 < len(parts) and parts[i + 1] == "0":
                target[key] = [{}]
                target = target[key][0]
            elif i + 1 < len(parts) and parts[i + 1] == "v":
                target[key] = {"v": {}}
                target = target[key]["v"]
            else:
                target = target.setdefault(key, {})
        if block == "sink.catalog.":  # its keys depend on its type
            target["type"] = "glue"
        target["tpyo"] = 1
        with pytest.raises(ConfigError) as error:
            load_pipeline(write(tmp_path, doc), ENV)
        assert error.value.key == f"{block}tpyo" and error.value.problem.startswith("unknown key (allowed: "), block


def test_a_misspelt_key_is_named_with_the_key_meant_and_every_problem_is_reported(tmp_path):
    doc = with_change("source.bootstrap_servers", KeyError)
    doc["source"]["bootstrap_server"] = "kafka:9092"
    doc["limits"]["max_records_per_comit"] = 5
    doc["sink"]["partition_by"] = "day"
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, doc), ENV)
    # The key meant is not reported missing as well; the other problem follows, all on one line.
    assert error.value.problems == [
        ("source.bootstrap_server", "unknown key; did you mean source.bootstrap_servers?"),
        ("limits.max_records_per_comit", "unknown key; did you mean limits.max_records_per_commit?"),
        ("sink.partition_by", "must be a list, got a string")]
    assert str(error.value).count("\n") == 0


def test_a_cron_error_never_shows_the_value_which_may_be_a_secret(tmp_path):
    doc = with_change("airflow.schedule", "${SCHEDULE_SECRET} * * * *")
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, doc), {**ENV, "SCHEDULE_SECRET": "hunter2"})
    assert "hunter2" not in str(error.value) and error.value.key == "airflow.schedule"


def test_a_key_meant_keeps_its_own_problems(tmp_path):
    doc = with_change("airflow.start_date", "not a date")
    doc["airflow"]["start_dat"] = "2026-11-01"
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, doc), ENV)
    assert [k for k, _ in error.value.problems] == ["airflow.start_dat", "airflow.start_date"]


def test_airflow_presets_are_their_crons_and_a_pipeline_without_airflow_has_no_dag_settings(tmp_path):
    pipeline = load_pipeline(write(tmp_path, with_change("airflow.schedule", "@hourly")), ENV)
    assert pipeline.airflow.schedule == "0 * * * *"
    assert load_pipeline(write(tmp_path, with_change("airflow", KeyError)), ENV).airflow is None


def test_a_yaml_syntax_error_names_line_and_column_never_the_text(tmp_path):
    path = write(tmp_path, "name: orders\nsource:\n  kafka_options: {sasl.password: hunter2secret\nsink: x\n")
    with pytest.raises(ConfigError) as error:
        load_pipeline(path, ENV)
    message = str(error.value)
    assert "hunter2secret" not in message and "sasl" not in message and len(message.splitlines()) == 1
    assert message.startswith(f"{path}: not valid YAML: line 4, column 5: ")


def test_two_pipelines_on_one_table_are_both_flagged(tmp_path, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    write(tmp_path, VALID)
    write(tmp_path, with_change("name", "copy"), name="copy")
    write(tmp_path, with_change("name", "apart") | {"sink": {"table_uri": "/data/delta/apart"}}, name="apart")
    # One's table is the other's quarantine table: as bad.
    write(tmp_path, with_change("name", "crossed") | {"sink": {"table_uri": "/data/delta/apart_quarantine/"}}, name="crossed")
    loaded, broken = load_all(tmp_path)
    assert [p.name for p in loaded] == []
    assert sorted(Path(p).stem for p in broken) == ["apart", "copy", "crossed", "orders"]
    assert "sink.table_uri: is also the table of pipeline copy" in str(broken[str(tmp_path / "orders.yaml")])
    assert "is also the table of pipeline crossed" in str(broken[str(tmp_path / "apart.yaml")])


def test_missing_env_var_is_named(tmp_path):
    with pytest.raises(ConfigError, match="environment variable KAFKA_PASSWORD is not set"):
        load_pipeline(write(tmp_path, VALID), {"KAFKA_BOOTSTRAP": "k:9092"})


def test_env_default_and_a_file_of_any_name_but_in_the_pipelines_directory(tmp_path, monkeypatch):
    doc = with_change("source.bootstrap_servers", "${NOT_SET:-127.0.0.1:9092}")
    assert load_pipeline(write(tmp_path, doc), ENV).source.bootstrap_servers == "127.0.0.1:9092"
    # --config takes any file; in the pipelines directory a file is named after its pipeline.
    other = write(tmp_path, doc, name="other")
    assert load_pipeline(other, ENV).name == "orders"
    for key, value in {**ENV, "ONCEMORE_PIPELINES_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    loaded, broken = load_all()
    assert "must match the file name 'other' in the pipelines directory" in str(broken[str(other)])


def test_relative_certificate_paths_are_resolved_against_the_pipeline_file(tmp_path, monkeypatch):
    """A Spark executor opens the files too, in another working directory: a path relative to the
    one the driver started in was found there and missed on the executors."""
    monkeypatch.chdir("/")
    doc = with_change("source.kafka_options", {"security.protocol": "SSL", "ssl.ca.location": "certs/ca.pem",
                                               "ssl.certificate.location": "/etc/kafka/client.pem",
                                               "ssl.key.location": "../keys/client.key", "ssl.key.password": "x"})
    doc["format"] = {"type": "avro", "schema_registry": {"url": "https://registry:8081", "ssl.ca.location": "ca.pem"}}
    doc["key"] = {"type": "json", "schema": "id BIGINT", "confluent_framing": True,
                  "schema_registry": {"url": "https://registry:8081", "ssl.ca.location": "probe"}}
    (tmp_path / "pipelines").mkdir()
    pipeline = load_pipeline(write(tmp_path / "pipelines", doc), ENV)

    assert pipeline.source.kafka_options == {
        "security.protocol": "SSL", "ssl.ca.location": str(tmp_path / "pipelines" / "certs" / "ca.pem"),
        "ssl.certificate.location": "/etc/kafka/client.pem", "ssl.key.location": str(tmp_path / "keys" / "client.key"),
        "ssl.key.password": "x"}
    assert pipeline.format.schema_registry["ssl.ca.location"] == str(tmp_path / "pipelines" / "ca.pem")
    assert pipeline.key.schema_registry["ssl.ca.location"] == "probe"  # librdkafka's own lookup, not a path


def test_not_yaml_and_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_pipeline(write(tmp_path, "name: [unclosed"), ENV)
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_pipeline(write(tmp_path, "- a list"), ENV)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("earliest", OffsetBound("earliest")),
        ("latest", OffsetBound("latest")),
        ({"timestamp": "2026-01-05T11:00:00Z"}, OffsetBound("timestamp", timestamp_ms=parse_timestamp_ms("2026-01-05T11:00:00Z"))),
        ({"0": 42, "1": 7}, OffsetBound("offsets", offsets={(None, 0): 42, (None, 1): 7})),
        ('{"0": 42}', OffsetBound("offsets", offsets={(None, 0): 42})),
        ({"orders": {"0": 42}, "refunds": {"3": 1}}, OffsetBound("offsets", offsets={("orders", 0): 42, ("refunds", 3): 1})),
    ],
)
def test_offset_bound_forms(value, expected):
    assert OffsetBound.parse(value) == expected


def test_timestamps_without_zone_are_utc():
    assert parse_timestamp_ms("2026-01-05T11:00:00") == parse_timestamp_ms("2026-01-05T11:00:00+00:00") == 1767610800000


def test_the_examples_all_load_together_and_the_schema_checks_them(monkeypatch):
    import jsonschema

    from oncemore.config.model import json_schema

    monkeypatch.setenv("KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    examples = ROOT / "include" / "pipelines" / "examples"
    loaded, broken = load_all(examples)  # one pipelines directory: scripts/demo's
    assert loaded and not broken, broken
    for path in examples.glob("*.yaml"):
        assert not list(jsonschema.Draft202012Validator(json_schema()).iter_errors(yaml.safe_load(path.read_text()))), path


def test_load_all_keeps_loading_past_a_broken_file(tmp_path, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    write(tmp_path, VALID)
    bad = write(tmp_path, with_change("name", "broken") | {"sink": "nope"}, name="broken")
    loaded, broken = load_all(tmp_path)
    assert [p.name for p in loaded] == ["orders"]
    assert list(broken) == [str(bad)] and "sink" in str(broken[str(bad)])


@pytest.mark.parametrize("change", ["limits.max_records_per_commit", "source.starting_offsets", "format.type",
                                    "airflow.start_date", "fail_on_data_loss"])
def test_errors_never_quote_a_substituted_value(tmp_path, change):
    doc = with_change(change, "${KAFKA_PASSWORD}")
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, doc), ENV)
    assert error.value.key == change and "hunter2" not in str(error.value)


def test_storage_options_are_text_and_redacted(tmp_path):
    doc = with_change("sink.storage_options", {"AWS_ALLOW_HTTP": True, "AWS_SECRET_ACCESS_KEY": "${KAFKA_PASSWORD}",
                                               "AWS_REGION": "eu-west-1"})
    pipeline = load_pipeline(write(tmp_path, doc), ENV)
    assert pipeline.sink.storage_options == {"AWS_ALLOW_HTTP": "true", "AWS_SECRET_ACCESS_KEY": "hunter2",
                                             "AWS_REGION": "eu-west-1"}
    assert pipeline.redacted()["sink"]["storage_options"] == {"AWS_ALLOW_HTTP": "true", "AWS_SECRET_ACCESS_KEY": "***",
                                                              "AWS_REGION": "eu-west-1"}


def test_published_json_schema_is_current_and_checks_pipeline_files(monkeypatch):
    import jsonschema

    from oncemore.config.model import json_schema

    published = json.loads((ROOT / "include" / "pipelines" / "pipeline.schema.json").read_text())
    assert published == json_schema(), "regenerate with: oncemore schema > include/pipelines/pipeline.schema.json"
    validator = jsonschema.Draft202012Validator(published)
    shipped = yaml.safe_load((ROOT / "include" / "pipelines" / "examples" / "orders.yaml").read_text())
    assert not list(validator.iter_errors(shipped))
    for change, value in [("source.topik", "x"), ("format.type", "csv"), ("limits.max_records_per_commit", 0),
                          ("source.starting_offsets", {"0": -1}), ("sink.storage_options", {"k": [1]})]:
        assert list(validator.iter_errors(with_change(change, value))), change


SECRET_STORAGE_KEYS = ["AZURE_STORAGE_ACCOUNT_KEY", "ACCOUNT_KEY", "AZURE_STORAGE_MASTER_KEY", "AZURE_STORAGE_SAS_KEY",
                       "GOOGLE_SERVICE_ACCOUNT_KEY", "azure_storage_sas_token", "AZURE_CLIENT_SECRET", "AWS_SESSION_TOKEN",
                       "GOOGLE_APPLICATION_CREDENTIALS", "AWS_SECRET_ACCESS_KEY", "SOME_FUTURE_CREDENTIAL_NAME"]
SECRET_KAFKA_KEYS = ["sasl.password", "ssl.key.pem", "ssl.key.password", "ssl.keystore.password",
                     "sasl.oauthbearer.client.secret", "sasl.oauthbearer.config", "sasl.jaas.config",
                     "sasl.oauthbearer.assertion.private.key.passphrase"]


def test_every_option_not_known_harmless_is_masked_in_output_and_in_spark(tmp_path):
    from oncemore.core.redaction import spark_options_regex

    storage = {key: "${KAFKA_PASSWORD}" for key in SECRET_STORAGE_KEYS} | {"AWS_REGION": "eu-west-1", "aws_allow_http": "true"}
    kafka = {key: "${KAFKA_PASSWORD}" for key in SECRET_KAFKA_KEYS} | {"security.protocol": "SASL_SSL", "sasl.username": "svc"}
    doc = with_change("sink.storage_options", storage)
    doc["source"]["kafka_options"] = kafka
    shown = load_pipeline(write(tmp_path, doc), ENV).redacted()
    assert "hunter2" not in json.dumps(shown)
    assert {k for k, v in shown["sink"]["storage_options"].items() if v != "***"} == {"AWS_REGION", "aws_allow_http"}
    assert {k for k, v in shown["source"]["kafka_options"].items() if v != "***"} == {"security.protocol", "sasl.username"}
    # Spark masks a data source option when this regex finds its key (Java syntax; these constructs match Python's).
    regex = re.compile(spark_options_regex().removeprefix("(?i)"), re.I)
    for key in SECRET_STORAGE_KEYS:
        assert regex.search(f"storage.{key}"), key
    for key in SECRET_KAFKA_KEYS:
        assert regex.search(f"kafka.{key}"), key
    for harmless in ("storage.AWS_REGION", "storage.aws_allow_http", "kafka.security.protocol", "kafka.sasl.username",
                     "kafka.group.id", "topic", "tasks", "pipeline"):
        assert not regex.search(harmless), harmless
    for key in ("registry.basic.auth.user.info", "key.registry.basic.auth.user.info", "key.registry.bearer.auth.token",
                "registry.url", "key.registry.url"):
        assert regex.search(key), key


def test_registry_urls_are_shown_without_their_user_info():
    from oncemore.core.redaction import redact

    assert redact("registry", {"url": "https://user:pw@registry:8081/x", "basic.auth.user.info": "user:pw"}) == {
        "url": "https://***@registry:8081/x", "basic.auth.user.info": "***"}


@pytest.mark.parametrize("sequence_by, problem", [
    ("source.pos", "source.pos restarts with every binlog file (MySQL, MariaDB): order by the file and the position "
                   "together, CAST(substring_index(source.file, '.', -1) AS DECIMAL(20,0)) * 4294967296 + source.pos"),
    (" `source`.`POS` ", "source.pos restarts with every binlog file"),
    ("source.txId", "source.txId is a transaction's id, not an order: Oracle's is hex"),
    ("source.file", "source.file names a binlog file (MySQL, MariaDB), text"),
    ("source.event_serial_no", "order by source.commit_lsn"),
    ("source.ord", "counts the operations of one second (MongoDB) and restarts every second"),
    ("source.sequence", "order by source.lsn"),
])
def test_a_debezium_source_field_that_is_no_order_is_refused_as_sequence_by_with_the_reason(tmp_path, sequence_by,
                                                                                            problem):
    doc = with_change("upsert", {"keys": ["id"], "envelope": "debezium", "sequence_by": sequence_by})
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, doc), ENV)
    assert (error.value.key, problem in error.value.problem) == ("upsert.sequence_by", True), error.value
    # Under envelope none the expression names the row's own columns: not Debezium's source block.
    load_pipeline(write(tmp_path, with_change("upsert", {"keys": ["id"], "sequence_by": sequence_by})), ENV)


@pytest.mark.parametrize("change,key,problem", [
    ({"sink": {"partition_by": ["customer"]}}, "sink.partition_by",
     "'customer' is not a key column: an upsert table is partitioned by key columns only"),
    ({"transform": "SELECT * FROM records"}, "upsert", "cannot be combined with a transform or expectations yet"),
    ({"format": {"type": "string"}}, "upsert", "needs a format with columns (json, avro, protobuf), not string"),
])
def test_an_upsert_block_that_does_not_fit_the_pipeline_is_refused_naming_the_key(tmp_path, change, key, problem):
    doc = with_change("upsert", {"keys": ["id"]})
    for block, value in change.items():
        doc[block] = {**doc[block], **value} if block == "sink" else value
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, doc), ENV)
    assert (error.value.key, problem in error.value.problem) == (key, True), error.value


ROUTED = {
    "name": "events",
    "source": {"bootstrap_servers": "kafka:9092", "topic": "events"},
    "sink": {"quarantine_uri": "/data/delta/events_quarantine"},
    "routes": {"by": "value.type", "tables": {
        "created": {"table_uri": "/data/delta/created", "format": {"type": "json", "schema": "id BIGINT, type STRING"}},
        "paid": {"table_uri": "/data/delta/paid", "format": {"type": "json", "schema": "id BIGINT, amount DOUBLE, day STRING"},
                 "partition_by": ["day"]}}},
}


def routed(change: str, value):
    doc = yaml.safe_load(yaml.safe_dump(ROUTED))
    *parents, last = change.split(".")
    target = doc
    for key in parents:
        target = target.setdefault(key, {})
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return doc


def test_a_routed_pipeline_names_a_table_and_a_format_per_route(tmp_path):
    pipeline = load_pipeline(write(tmp_path, ROUTED, "events"), ENV)
    assert [(t.route, t.table_uri, t.format.ddl, t.partition_by, t.tag) for t in pipeline.tables] == [
        ("created", "/data/delta/created", "id BIGINT, type STRING", (), "route:created"),
        ("paid", "/data/delta/paid", "id BIGINT, amount DOUBLE, day STRING", ("day",), "route:paid")]
    assert pipeline.format is None and pipeline.sink.table_uri is None and pipeline.routes.unrouted == "quarantine"
    for by, parsed in (("value.type", ("value", ("type",), None)), ("value.meta.kind", ("value", ("meta", "kind"), None)),
                       ("headers['event_type']", ("header", (), "event_type")), ('headers["a b"]', ("header", (), "a b")),
                       ("key", ("key", (), None))):
        doc = routed("routes.by", by)
        if not by.startswith("value"):  # the others read no value: any format will do
            doc["routes"]["tables"]["created"]["format"] = {"type": "raw"}
        found = load_pipeline(write(tmp_path, doc, "events"), ENV).routes.parsed_by
        assert (found.kind, found.path, found.name) == parsed and str(found) == by.replace('"', "'")


@pytest.mark.parametrize(
    "change, value, key, problem",
    [
        ("format", {"type": "json", "schema": "id BIGINT"}, "format", "does not apply with routes"),
        ("sink.table_uri", "/data/delta/events", "sink.table_uri", "does not apply with routes"),
        ("sink.quarantine_uri", KeyError, "sink.quarantine_uri", "is required with routes"),
        ("sink.partition_by", ["type"], "sink.partition_by", "set it per route"),
        ("upsert", {"keys": ["id"]}, "upsert", "does not apply with routes"),
        ("transform", "SELECT * FROM records", "transform", "does not apply with routes"),
        ("expectations", [{"name": "x", "check": "id > 0"}], "expectations", "does not apply with routes"),
        ("routes.by", "value", "routes.by", "must be value.<field>"),
        ("routes.by", "headers[event_type]", "routes.by", "headers['<name>']"),
        ("routes.unrouted", "drop", "routes.unrouted", "'quarantine' or 'skip'"),
        ("routes.tables", {}, "routes.tables", "at least 1"),
        ("routes.tables.paid.table_uri", "/data/delta/created/", "routes.tables.paid.table_uri",
         "is also the table of route created"),
        ("routes.tables.paid.table_uri", "/data/x/../delta/./created", "routes.tables.paid.table_uri",
         "is also the table of route created"),
        ("routes.tables.paid.table_uri", "/data/delta/events_quarantine", "routes.tables.paid.table_uri",
         "must differ from sink.quarantine_uri"),
        ("routes.tables.paid.table_uri", "/data/delta/./events_quarantine/", "routes.tables.paid.table_uri",
         "must differ from sink.quarantine_uri"),
        ("routes.tables.paid.format", {"type": "raw"}, "routes.tables.paid.format",
         "by: value.type reads the values as JSON"),
        ("routes.tables.paid.format", {"type": "json", "schema": "id BIGINT", "confluent_framing": True},
         "routes.tables", "confluent_framing and format.schemas_enable must be the same"),
        ("routes.tables.paid.format", {"type": "json", "schema": "id BIGINT", "schemas_enable": True},
         "routes.tables", "confluent_framing and format.schemas_enable must be the same"),
        ("routes.tables.paid.partition_by", ["amount"], "routes.tables.paid.partition_by", "has type double"),
        ("routes.tables.paid.format", {"type": "json", "schema": "key STRING"}, "routes.tables.paid.format.schema",
         "which the record's key takes"),
        ("routes.tables.paid.tabel_uri", "x", "routes.tables.paid.tabel_uri", "unknown key"),
    ],
)
def test_invalid_routes_name_the_key(tmp_path, change, value, key, problem):
    doc = routed(change, value)
    if change == "routes.tables.paid.format" and "key" in str(value):
        doc["key"] = {"type": "string"}
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, doc, "events"), ENV)
    assert (error.value.key, problem in error.value.problem) == (key, True), error.value


def test_registered_routes_each_name_their_subject_and_share_one_registry(tmp_path):
    registry = {"url": "http://registry:8081", "basic.auth.user.info": "${KAFKA_PASSWORD}"}
    doc = routed("routes.by", "headers['type']")
    for value in ("created", "paid"):
        doc["routes"]["tables"][value]["format"] = {"type": "avro", "schema_registry": registry,
                                                    "subject": f"events-{value}"}
    pipeline = load_pipeline(write(tmp_path, doc, "events"), ENV)
    assert "hunter2" not in str(pipeline.redacted())  # each route's registry settings are masked
    del doc["routes"]["tables"]["paid"]["format"]["subject"]
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, doc, "events"), ENV)
    assert error.value.key == "routes.tables.paid.format.subject"
    doc["routes"]["tables"]["paid"]["format"] = {"type": "avro", "subject": "events-paid",
                                                 "schema_registry": {"url": "http://elsewhere:8081"}}
    with pytest.raises(ConfigError, match="every route reads the same schema registry"):
        load_pipeline(write(tmp_path, doc, "events"), ENV)


def test_a_route_table_that_is_another_pipelines_table_flags_both(tmp_path, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    write(tmp_path, VALID)
    write(tmp_path, routed("routes.tables.paid.table_uri", "/data/delta/orders"), name="events")
    loaded, broken = load_all(tmp_path)
    assert not loaded
    assert "routes.tables.paid.table_uri: is also the table of pipeline orders" in str(broken[str(tmp_path / "events.yaml")])
    assert "sink.table_uri: is also the table of pipeline events" in str(broken[str(tmp_path / "orders.yaml")])
