"""A secured cluster: TLS, mutual TLS and SASL_SSL (SCRAM-SHA-512) listeners of one broker whose
requests Kafka's StandardAuthorizer checks against ACLs. Each pipeline runs as a user with the
rights docs/pipelines.md lists (READ on its topics; READ on the mirror's group only with the mirror on)
and ingests exactly; each missing right is named (topic or group, and the right) before anything
is created, by `plan`, `run` and `check`; a denied mirror group is said once and costs no stall;
certificate files are named with their option when they cannot be opened or loaded, by the
driver and by a Spark task; and no password or key passphrase shows anywhere a person or another
process can look.

Users and ACLs are made through confluent-kafka's AdminClient (alter_user_scram_credentials,
create_acls) as the broker's super user; the certificates come from a test authority made at run
time (devtools.kafkabroker.DevCertificates).
"""

from __future__ import annotations

import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition

from conftest import assert_exactly_once, oncemore, orders, process_list_watcher, read_pairs
from devtools.kafkabroker import DevBroker, DevCertificates, running, start_kafka
from oncemore.config.loading import load_pipeline
from oncemore.config.model import Pipeline
from oncemore.core.errors import KafkaAccessDenied, MirrorError, TaskFailed
from oncemore.kafka.clients import KafkaSourceError
from oncemore.ops.check import check_pipeline
from oncemore.plan.planner import plan_run
from oncemore.run import runner

RIGHTS = "a pipeline needs READ on each of its topics (READ includes DESCRIBE)"


@dataclass
class Cluster:
    broker: DevBroker
    certificates: DevCertificates

    def topic(self, records: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """A new 3-partition topic and the (partition, offset) of the ``records`` orders produced to it."""
        name = f"s_{uuid.uuid4().hex[:10]}"
        self.broker.create_topic(name, 3)
        return name, self.broker.produce(name, orders(0, records)) if records else []

    def scram_user(self, password: str) -> tuple[str, dict[str, str]]:
        """A new SCRAM-SHA-512 user: its name, and the kafka_options of a pipeline reading as it
        (its password from ${ONCEMORE_TEST_SCRAM_PASSWORD})."""
        user = f"u{uuid.uuid4().hex[:8]}"
        self.broker.add_scram_user(user, password)
        return user, {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": user,
                      "sasl.password": "${ONCEMORE_TEST_SCRAM_PASSWORD}", "ssl.ca.location": str(self.certificates.ca)}

    def mtls_user(self, key_password: str) -> tuple[str, dict[str, str]]:
        """A new client certificate (its key encrypted): its principal, and the kafka_options of a
        pipeline presenting it (the passphrase from ${ONCEMORE_TEST_KEY_PASSWORD})."""
        name = f"c{uuid.uuid4().hex[:8]}"
        certificate, key = self.certificates.client(name, key_password=key_password)
        return f"User:CN={name}", {"security.protocol": "SSL", "ssl.ca.location": str(self.certificates.ca),
                                   "ssl.certificate.location": str(certificate), "ssl.key.location": str(key),
                                   "ssl.key.password": "${ONCEMORE_TEST_KEY_PASSWORD}"}

    def groups(self) -> set[str]:
        return {g.group_id for g in self.broker.admin().list_consumer_groups().result().valid}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One secured broker for the module: listeners SSL, MTLS and SASL_SSL, ACLs enforced."""
    certificates = DevCertificates(tmp_path_factory.mktemp("certificates"))
    with running(start_kafka(tls=certificates, sasl="SCRAM-SHA-512", user="admin",
                             password=f"admin-{uuid.uuid4().hex}", authorizer=True)) as broker:
        yield Cluster(broker, certificates)


def write_pipeline(directory: Path, name: str, topic: str | list[str], servers: str, kafka_options: dict[str, str],
                   **overrides) -> Pipeline:
    """A pipeline file in ``directory``/pipelines, loaded as a user's would be."""
    config = {"name": name,
              "source": {"bootstrap_servers": servers, "kafka_options": kafka_options, "stall_timeout_seconds": 20,
                         **({"topics": topic} if isinstance(topic, list) else {"topic": topic})},
              "sink": {"table_uri": str(directory / "delta" / name)},
              "format": {"type": "json", "schema": "id BIGINT, customer STRING, amount DOUBLE"}}
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if key == "source" else value
    path = directory / "pipelines" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return load_pipeline(path)


def secrets_nowhere(secrets: list[str], outputs: list[str], table_uri: str, leaked: list[str]) -> None:
    assert not leaked, "a secret showed in the process list"
    for output in outputs:
        assert not any(secret in output for secret in secrets)
    for log_file in Path(table_uri, "_delta_log").glob("*.json"):
        assert not any(secret in log_file.read_text() for secret in secrets)


@pytest.mark.spark
def test_a_user_with_read_on_its_topic_alone_ingests_exactly_over_scram_and_no_password_shows(cluster, tmp_path,
                                                                                             monkeypatch):
    """No right on any group: a range read joins none and commits nothing (before, the reader's
    consumer failed with GROUP_AUTHORIZATION_FAILED from FindCoordinator). The CA file is named
    relative to the pipeline file, and the run starts elsewhere: its driver and its tasks find it."""
    topic, produced = cluster.topic(600)
    password = f"pw-{uuid.uuid4().hex}"
    monkeypatch.setenv("ONCEMORE_TEST_SCRAM_PASSWORD", password)
    user, options = cluster.scram_user(password)
    cluster.broker.allow(f"User:{user}", "topic", topic, "READ")
    (tmp_path / "pipelines" / "certs").mkdir(parents=True)
    shutil.copy(cluster.certificates.ca, tmp_path / "pipelines" / "certs" / "ca.pem")
    pipeline = write_pipeline(tmp_path, "scram", topic, cluster.broker.listeners["SASL_SSL"],
                              {**options, "ssl.ca.location": "certs/ca.pem"})
    groups_before = cluster.groups()

    leaked: list[str] = []
    stop = process_list_watcher([password], leaked)
    try:
        result = oncemore("run", "--config", pipeline.origin)
    finally:
        stop.set()

    assert result.returncode == 0, result.stderr[-3000:]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert cluster.groups() == groups_before, "a range read made a consumer group"
    secrets_nowhere([password], [result.stdout, result.stderr], pipeline.sink.table_uri, leaked)


@pytest.mark.spark
def test_mutual_tls_with_an_encrypted_key_ingests_exactly_and_the_passphrase_never_shows(cluster, tmp_path,
                                                                                        monkeypatch):
    topic, produced = cluster.topic(450)
    passphrase = f"kp-{uuid.uuid4().hex}"
    monkeypatch.setenv("ONCEMORE_TEST_KEY_PASSWORD", passphrase)
    principal, options = cluster.mtls_user(passphrase)
    cluster.broker.allow(principal, "topic", topic, "READ")
    pipeline = write_pipeline(tmp_path, "mtls", topic, cluster.broker.listeners["MTLS"], options,
                              limits={"max_records_per_commit": 200})

    leaked: list[str] = []
    stop = process_list_watcher([passphrase], leaked)
    try:
        result = oncemore("run", "--config", pipeline.origin)
        status = oncemore("status", "--config", pipeline.origin, check_no_spark=True)
    finally:
        stop.set()

    assert result.returncode == 0, result.stderr[-3000:]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert status.returncode == 0 and "lag" in status.stdout, status.stderr
    secrets_nowhere([passphrase], [result.stdout, result.stderr, status.stdout, status.stderr],
                    pipeline.sink.table_uri, leaked)


@pytest.mark.spark
def test_one_way_tls_ingests_exactly_and_a_task_that_cannot_open_the_ca_file_names_it(cluster, tmp_path, spark):
    """The CA file is there when the run plans and gone where its tasks run (as on an executor
    that lacks it): the task fails naming the option and the path. The rerun, with the CA's PEM
    text inline (ssl.ca.pem: no file to reach the executors), is exact."""
    topic, produced = cluster.topic(300)
    cluster.broker.allow("User:ANONYMOUS", "topic", topic, "READ")  # one-way TLS: no client identity
    ca = tmp_path / "ca.pem"
    shutil.copy(cluster.certificates.ca, ca)
    pipeline = write_pipeline(tmp_path, "tls", topic, cluster.broker.listeners["SSL"],
                              {"security.protocol": "SSL", "ssl.ca.location": str(ca)})

    def spark_without_the_ca_file():
        ca.unlink()
        return spark

    with pytest.raises(TaskFailed) as failed:
        runner.run(pipeline, spark_factory=spark_without_the_ca_file)
    message = str(failed.value)
    assert f"pipeline tls: source.kafka_options.ssl.ca.location: cannot read {ca}: No such file or directory" in message
    assert read_pairs(pipeline.sink.table_uri) == []

    inline = write_pipeline(tmp_path, "tls", topic, cluster.broker.listeners["SSL"],
                            {"security.protocol": "SSL", "ssl.ca.pem": cluster.certificates.ca.read_text()})
    report = runner.run(inline, spark_factory=lambda: spark)
    assert report.status == "committed"
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_a_topic_the_user_may_not_describe_is_named_as_denied_not_missing(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ONCEMORE_TEST_SCRAM_PASSWORD", "pw-hidden")
    readable, _ = cluster.topic()
    hidden, _ = cluster.topic()
    user, options = cluster.scram_user("pw-hidden")
    cluster.broker.allow(f"User:{user}", "topic", readable, "READ")
    pipeline = write_pipeline(tmp_path, "hidden", [readable, hidden], cluster.broker.listeners["SASL_SSL"], options)

    result = oncemore("plan", "--config", pipeline.origin, check_no_spark=True)

    assert result.returncode == 1
    line, = result.stderr.strip().splitlines()
    assert line == (f"oncemore: error: pipeline hidden: Kafka denies DESCRIBE on topic {hidden!r} "
                    "(TOPIC_AUTHORIZATION_FAILED; whether it exists Kafka tells only those who may describe it): "
                    f"{RIGHTS}")


def test_a_misspelt_topic_gets_a_did_you_mean_among_the_topics_the_user_may_describe(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ONCEMORE_TEST_SCRAM_PASSWORD", "pw-typo")
    topic, _ = cluster.topic()
    hidden, _ = cluster.topic()
    user, options = cluster.scram_user("pw-typo")
    cluster.broker.allow(f"User:{user}", "topic", topic, "READ")
    servers = cluster.broker.listeners["SASL_SSL"]

    def misspelt(name: str) -> str:
        # The first two letters swapped: "s_" and "_s" always differ, where the last two of a
        # random hex name are the same letter one time in 16 and the "typo" was the topic itself.
        return name[1] + name[0] + name[2:]

    # Kafka answers a name this user may not describe with a denial, whether the topic exists or not.
    with pytest.raises(KafkaAccessDenied) as denied:
        plan_run(write_pipeline(tmp_path, "typo", misspelt(topic), servers, options))
    assert str(denied.value) == (
        f"pipeline typo: Kafka denies DESCRIBE on topic {misspelt(topic)!r} (TOPIC_AUTHORIZATION_FAILED; whether it "
        f"exists Kafka tells only those who may describe it): {RIGHTS}; did you mean {topic!r}?")
    # A typo of a topic this user may not describe suggests nothing: Kafka lists only what it may.
    with pytest.raises(KafkaAccessDenied) as unseen:
        plan_run(write_pipeline(tmp_path, "typo", misspelt(hidden), servers, options))
    assert "did you mean" not in str(unseen.value) and hidden not in str(unseen.value)
    # A user who may describe every topic (the broker's own) learns that the name does not exist.
    with pytest.raises(KafkaSourceError) as missing:
        plan_run(write_pipeline(tmp_path, "typo", misspelt(topic), cluster.broker.bootstrap_servers,
                                cluster.broker.client_options))
    assert str(missing.value) == (f"pipeline typo: topic {misspelt(topic)!r} is not available: it does not exist; "
                                  f"did you mean {topic!r}?")


def test_describe_alone_fails_the_plan_naming_read_before_a_table_or_spark(cluster, tmp_path, monkeypatch):
    """Metadata and ListOffsets need DESCRIBE only: the plan used to pass, the run created the
    table, started Spark, and a task failed with TOPIC_AUTHORIZATION_FAILED."""
    monkeypatch.setenv("ONCEMORE_TEST_SCRAM_PASSWORD", "pw-describe")
    topic, _ = cluster.topic(90)
    user, options = cluster.scram_user("pw-describe")
    cluster.broker.allow(f"User:{user}", "topic", topic, "DESCRIBE")
    pipeline = write_pipeline(tmp_path, "describer", topic, cluster.broker.listeners["SASL_SSL"], options)

    result = oncemore("run", "--config", pipeline.origin, check_no_spark=True)

    assert result.returncode == 1, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line == f"oncemore: error: pipeline describer: Kafka denies READ on topic {topic!r} " \
                   f"(TOPIC_AUTHORIZATION_FAILED): {RIGHTS}"
    assert not Path(pipeline.sink.table_uri).exists() and not Path(pipeline.sink.quarantine_uri).exists()


@pytest.mark.spark
def test_a_denied_mirror_group_is_said_once_and_costs_no_stall_and_the_granted_group_is_mirrored(
        cluster, tmp_path, spark, caplog, monkeypatch):
    monkeypatch.setenv("ONCEMORE_TEST_SCRAM_PASSWORD", "pw-mirror")
    topic, produced = cluster.topic(600)
    user, options = cluster.scram_user("pw-mirror")
    cluster.broker.allow(f"User:{user}", "topic", topic, "READ")
    pipeline = write_pipeline(tmp_path, "mirrored", topic, cluster.broker.listeners["SASL_SSL"], options,
                              commit_consumer_group=True, limits={"max_records_per_commit": 200})

    with caplog.at_level(logging.WARNING, logger="oncemore"), pytest.raises(MirrorError) as failed:
        runner.run(pipeline, spark_factory=lambda: spark)

    # The run fails once its three commits are done (DESIGN.md 8), naming them and the group.
    message = str(failed.value)
    assert message.startswith("mirrored: committed 3 batch(es), 600 records written") and "\n" not in message
    assert message.endswith("but the consumer group is not mirrored: pipeline mirrored: Kafka denies READ on consumer "
                            "group 'oncemore.mirrored' (GROUP_AUTHORIZATION_FAILED), which the consumer-group mirror "
                            "(commit_consumer_group: true) needs; the table holds the positions, and the next run "
                            "mirrors them"), message
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    denied = [r.getMessage() for r in caplog.records if "consumer group" in r.getMessage()]
    assert denied == ["pipeline mirrored: Kafka denies READ on consumer group 'oncemore.mirrored' "
                      "(GROUP_AUTHORIZATION_FAILED), which the consumer-group mirror (commit_consumer_group: true) "
                      "needs; positions are not mirrored for the rest of this run (the table holds them, only lag "
                      "tools lag)"]
    # Three commits, one request denied at once: not a stall timeout (20 s) per commit.
    assert failed.value.evidence["profile"]["mirror"] < 5_000, failed.value.evidence

    cluster.broker.allow(f"User:{user}", "group", "oncemore.mirrored", "READ")
    more = cluster.broker.produce(topic, orders(600, 90))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="oncemore"):
        runner.run(pipeline, spark_factory=lambda: spark)
    assert not [r for r in caplog.records if "consumer group" in r.getMessage()]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced + more)
    request = ConsumerGroupTopicPartitions("oncemore.mirrored", [TopicPartition(topic, p) for p in (0, 1, 2)])
    (future,) = cluster.broker.admin().list_consumer_group_offsets([request]).values()
    mirrored = {tp.partition: tp.offset for tp in future.result(timeout=30).topic_partitions}
    assert mirrored == {p: max(o for q, o in produced + more if q == p) + 1 for p in (0, 1, 2)}


def test_check_tries_what_a_run_needs_and_names_each_missing_right(cluster, tmp_path, monkeypatch):
    """Describe, a fetch of one record, the mirror's group (writing nothing), the registry."""
    from devtools.schemaregistry import start_registry

    monkeypatch.setenv("ONCEMORE_TEST_SCRAM_PASSWORD", "pw-check")
    topic, _ = cluster.topic(30)
    servers = cluster.broker.listeners["SASL_SSL"]

    def failed(pipeline: Pipeline) -> list[str]:
        checks = check_pipeline(pipeline, spark_factory=lambda: pytest.fail("no check here needs Spark"))
        return [c.line() for c in checks if not c.ok]

    nothing, options = cluster.scram_user("pw-check")
    assert failed(write_pipeline(tmp_path, "nothing", topic, servers, options)) == [
        f"FAILED nothing: topics: pipeline nothing: Kafka denies DESCRIBE on topic {topic!r} "
        f"(TOPIC_AUTHORIZATION_FAILED; whether it exists Kafka tells only those who may describe it): {RIGHTS}"]

    describer, options = cluster.scram_user("pw-check")
    cluster.broker.allow(f"User:{describer}", "topic", topic, "DESCRIBE")
    assert failed(write_pipeline(tmp_path, "describer", topic, servers, options)) == [
        f"FAILED describer: read: pipeline describer: Kafka denies READ on topic {topic!r} "
        f"(TOPIC_AUTHORIZATION_FAILED): {RIGHTS}"]

    reader, options = cluster.scram_user("pw-check")
    cluster.broker.allow(f"User:{reader}", "topic", topic, "READ")
    assert failed(write_pipeline(tmp_path, "reader", topic, servers, options)) == []
    mirror_denied = ("FAILED mirror: consumer group oncemore.mirror: pipeline mirror: Kafka denies READ on consumer "
                     "group 'oncemore.mirror' (GROUP_AUTHORIZATION_FAILED), which the consumer-group mirror "
                     "(commit_consumer_group: true) needs")
    mirror = write_pipeline(tmp_path, "mirror", topic, servers, options, commit_consumer_group=True)
    assert failed(mirror) == [mirror_denied]
    cluster.broker.allow(f"User:{reader}", "group", "oncemore.mirror", "DESCRIBE")  # finds it, may not commit
    assert failed(mirror) == [mirror_denied]
    cluster.broker.allow(f"User:{reader}", "group", "oncemore.mirror", "READ")
    assert failed(mirror) == []
    assert "oncemore.mirror" not in cluster.groups(), "check made the mirror's group"

    registry = start_registry(user_info="svc:registry-secret")
    try:
        wrong = {"url": registry.url, "basic.auth.user.info": "svc:not-it"}
        avro = write_pipeline(tmp_path, "avro", topic, servers, options,
                              format={"type": "avro", "schema_registry": wrong})
        registry_line, = failed(avro)
        assert registry_line.startswith("FAILED avro: schema registry: ") and "HTTP 401" in registry_line
        assert "not-it" not in registry_line
    finally:
        registry.stop()


def test_certificate_file_errors_name_the_pipeline_the_option_and_the_file(cluster, tmp_path, monkeypatch):
    """librdkafka said `KafkaError{code=_INVALID_ARG ... ssl.key.location failed: error:0A080009:SSL
    routines::PEM lib}`, naming no pipeline, file or passphrase."""
    passphrase = f"kp-{uuid.uuid4().hex}"
    monkeypatch.setenv("ONCEMORE_TEST_KEY_PASSWORD", passphrase)
    principal, options = cluster.mtls_user(passphrase)
    pipeline = write_pipeline(tmp_path, "certs", "whatever", cluster.broker.listeners["MTLS"], options)

    wrong = oncemore("plan", "--config", pipeline.origin, env={"ONCEMORE_TEST_KEY_PASSWORD": "not-" + passphrase},
                     check_no_spark=True)
    assert wrong.returncode == 1
    line, = wrong.stderr.strip().splitlines()
    assert line.startswith(f"oncemore: error: pipeline certs: source.kafka_options.ssl.key.location: cannot load "
                           f"{options['ssl.key.location']}: the passphrase in ssl.key.password does not decrypt it, "
                           "or it is not a PEM private key (librdkafka: "), line
    assert passphrase not in wrong.stderr + wrong.stdout

    missing = write_pipeline(tmp_path, "certs", "whatever", cluster.broker.listeners["MTLS"],
                             {**options, "ssl.ca.location": str(tmp_path / "no-such-ca.pem")})
    result = oncemore("plan", "--config", missing.origin, check_no_spark=True)
    assert result.returncode == 1
    line, = result.stderr.strip().splitlines()
    assert line.startswith(f"oncemore: error: pipeline certs: source.kafka_options.ssl.ca.location: cannot read "
                           f"{tmp_path / 'no-such-ca.pem'}: No such file or directory (on host "), line
    assert passphrase not in result.stderr + result.stdout
