"""A local Apache Kafka broker for the demo, the tests and the benchmarks, and a producer of sample data.

``start_kafka()``: Apache Kafka itself, one node in KRaft combined mode (broker and controller),
from the jars scripts/setup copies for devtools/kafka/pom.xml (Kafka 4.4), or with
``version="3.9"`` for devtools/kafka/3.9/pom.xml (Kafka 3.9, the last 3.x line, which many users
still run: a quorum of static voters, as a 3.x cluster has, and logging through log4j 1). It returns once a client gets
cluster metadata naming the broker and a leader for every partition, not when a port opens; it
never leaves its JVM behind: not when stopped, when it fails to start, or when the interpreter that
started it exits. With ``data_dir`` it persists, and ``restart()`` (after ``stop()`` or ``kill()``)
brings it back on the same ports with the same data. ``DevBroker`` also stands for any reachable
cluster (``DevBroker(bootstrap_servers)``).

A secured broker: ``start_kafka(tls=DevCertificates(directory), sasl=..., authorizer=True)``
listens for TLS clients (one-way and mutual TLS, and SASL_SSL with ``sasl``) with certificates
of a test authority made at run time, and authorizes every request by ACLs (Kafka's
StandardAuthorizer): users (``add_scram_user``) and ACLs (``allow``) go through the admin client.

``start_detached_kafka()``: the same broker for a developer's own topics, on a fixed port, outliving
the command that starts it, its data kept between starts. Run (scripts/kafka):
``python -m devtools.kafkabroker start [--port 9092] [--data-dir DIR] [--kafka-version 3.9] | stop | status``.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import datetime
import functools
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from confluent_kafka import IsolationLevel, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewPartitions,
    NewTopic,
    OffsetSpec,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from devtools.processes import serve_main, serving, start_detached, stop_process

Record = tuple[int, bytes | None, bytes | None, int | None]  # (partition, key, value, timestamp ms)
KAFKA_DEVTOOLS = Path(__file__).resolve().parent / "kafka"


@dataclass(frozen=True)
class KafkaRelease:
    """A pinned Apache Kafka broker: the pom naming its jars (scripts/setup copies them into the cache
    directory ``cache``-<the pom's hash>) and what differs in starting it."""

    pom: Path
    cache: str
    logging: str  # the JVM option naming its logging configuration (the same server.log either way)
    # A quorum found through controller.quorum.bootstrap.servers, its storage formatted --standalone
    # (KIP-853, Kafka 4's way); else the static voters of controller.quorum.voters, as 3.x clusters run.
    dynamic_quorum: bool
    # Settings of ours only this release knows (others warn of them as unknown at every start).
    properties: dict[str, str]


KAFKA_RELEASES = {
    "4.4": KafkaRelease(KAFKA_DEVTOOLS / "pom.xml", "kafka", f"-Dlog4j2.configurationFile={KAFKA_DEVTOOLS / 'log4j2.xml'}",
                        dynamic_quorum=True,
                        # One node: the share groups' state topic (KIP-932, Kafka 4) has one replica.
                        properties={"share.coordinator.state.topic.replication.factor": "1",
                                    "share.coordinator.state.topic.min.isr": "1"}),
    "3.9": KafkaRelease(KAFKA_DEVTOOLS / "3.9" / "pom.xml", "kafka-3.9",
                        f"-Dlog4j.configuration={(KAFKA_DEVTOOLS / '3.9' / 'log4j.properties').as_uri()}",
                        dynamic_quorum=False, properties={}),
}
DEFAULT_KAFKA_VERSION = "4.4"  # the tests', the demo's and the benchmarks' broker unless told otherwise
VERSION_FILE = "kafka-version"  # in a broker's data directory: the release that formatted it
# Measured on 2 shared cores (median of 5 starts, the JVM's start to a metadata answer): 2.45 s
# with only -Xmx512m; with the C1 compiler alone (TieredStopAtLevel=1) 2.0 s, and half the broker's
# CPU over a million records produced and read, at the same rates: C2's compiling costs more than
# it gains in a broker living minutes. SerialGC and a 64 MB initial heap take an idle broker from
# 208 to 164 MB resident (G1's own structures, a heap grown ahead of need); they do not speed the
# start. With the class archive (write_kafka_class_archive) as well: 1.1 s.
KAFKA_JVM_OPTIONS = ["-Xmx512m", "-Xms64m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
KAFKA_CLASS_ARCHIVE = "kafka-broker.jsa"  # in the jars directory, written by write_kafka_class_archive
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
# Kafka's authorizer for KRaft clusters (3.x and 4.x), ACLs kept in the cluster's metadata.
STANDARD_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
# Every Kafka broker started here, with the process that started it: stopped at its exit at the latest.
_kafka_brokers: list[tuple[int, DevBroker]] = []


class DevBroker:
    """A broker to develop and test against: a local process of ours, or any reachable cluster."""

    def __init__(self, bootstrap_servers: str, process: subprocess.Popen | None = None,
                 client_options: dict[str, str] | None = None, launch: Callable[[], subprocess.Popen] | None = None,
                 log_path: Path | None = None, temporary_dir: Path | None = None,
                 listeners: dict[str, str] | None = None):
        self.bootstrap_servers, self.process = bootstrap_servers, process
        # The client listeners of a local broker by name (SSL, MTLS, SASL_SSL, ...): host:port.
        self.listeners = listeners or {}
        # librdkafka settings a client needs besides the address (SASL for a broker started with it).
        self.client_options = client_options or {}
        # Starts the local broker's process again on the same address, returning once it serves.
        self.launch = launch
        self.log_path = log_path  # the local broker's log file, when it writes one
        self.temporary_dir = temporary_dir  # data of a broker started without a data_dir, removed by stop()
        self._admin: AdminClient | None = None
        self._deleted: set[str] = set()  # topics deleted here whose name has not been created again

    def _client_config(self) -> dict:
        # Through Python logging: a handle outliving the broker must not print after a test run.
        return {"bootstrap.servers": self.bootstrap_servers, "logger": logging.getLogger("devtools.kafkabroker"),
                **self.client_options}

    def admin(self) -> AdminClient:
        # Kept while its requests are answered: a collected client destroys its pending futures. One
        # client, not one per call: a new one's first request waits for its metadata (up to 3 s
        # seen on Kafka). An idle client is falsy (its len() is its queue's), hence no ``or``.
        if self._admin is None:
            self._admin = AdminClient(self._client_config())
        return self._admin

    @staticmethod
    def _wait(futures: dict) -> None:
        for future in futures.values():
            future.result(timeout=30)

    def _wait_led(self, topic: str, partitions: Iterable[int], seconds: float = 30) -> None:
        """Returns once the broker answers ListOffsets for each partition. Kafka acknowledges
        partitions once its controller has them, before the broker leads them: a request in
        between fails (NOT_LEADER_OR_FOLLOWER, UNKNOWN_LEADER_EPOCH; 34 of 75 partitions asked at
        once), and the client does not retry it."""
        pending, deadline = set(partitions), time.monotonic() + seconds
        while True:
            futures = self.admin().list_offsets({TopicPartition(topic, p): OffsetSpec.latest() for p in pending})
            for key, future in futures.items():
                try:
                    future.result(timeout=30)
                    pending.discard(key.partition)
                except KafkaException:
                    if time.monotonic() > deadline:
                        raise
            if not pending:
                return
            time.sleep(0.02)
            # The client asks the leaders its metadata names; new partitions are not there yet.
            self.admin().list_topics(topic, timeout=10)

    def create_topic(self, topic: str, partitions: int, config: dict[str, str] | None = None) -> None:
        """Creates ``topic``, its partitions led on return. A topic this broker deleted may still be
        on its way out: Kafka acknowledges a deletion before it completes, and a topic of the same
        name created meanwhile is refused (TOPIC_ALREADY_EXISTS, 0.5 s after the deletion under a
        test suite's load), so that name's creation is tried again, for at most 30 s."""
        deadline = time.monotonic() + 30
        while True:
            try:
                self._wait(self.admin().create_topics([NewTopic(topic, partitions, 1, config=config or {})]))
                break
            except KafkaException as exc:
                if (topic not in self._deleted or exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS
                        or time.monotonic() > deadline):
                    raise
                time.sleep(0.1)
        self._deleted.discard(topic)
        self._wait_led(topic, range(partitions))

    def delete_topic(self, topic: str) -> None:
        self._wait(self.admin().delete_topics([topic], operation_timeout=30))
        self._deleted.add(topic)

    def add_partitions(self, topic: str, total: int) -> None:
        """Grows ``topic`` to ``total`` partitions, the new ones led on return."""
        known = len(self.admin().list_topics(topic, timeout=30).topics[topic].partitions)
        self._wait(self.admin().create_partitions([NewPartitions(topic, total)]))
        self._wait_led(topic, range(known, total))

    def delete_records(self, topic: str, before: dict[int, int]) -> None:
        """Moves each partition's log start to ``before[partition]`` (Kafka's DeleteRecords)."""
        self._wait(self.admin().delete_records([TopicPartition(topic, p, o) for p, o in before.items()]))

    def produce(self, topic: str, records: Iterable[Record], transactional_id: str | None = None,
                abort: bool = False, headers: list[tuple[str, bytes]] | None = None) -> list[tuple[int, int]]:
        """Writes (partition, key, value, timestamp_ms) records, each with ``headers``: in one
        transaction when ``transactional_id`` is given (aborted with ``abort``), else with an
        idempotent producer.

        Returns the (partition, offset) of every record, from the delivery reports."""
        settings = {**self._client_config(), "linger.ms": 20, "batch.num.messages": 10000, "compression.type": "lz4",
                    "enable.idempotence": True, "message.max.bytes": 64 << 20}
        if transactional_id:
            settings["transactional.id"] = transactional_id
        elif abort:
            raise ValueError("only a transaction can be aborted")
        producer = Producer(settings)
        delivered: list[tuple[int, int]] = []
        failures: list[str] = []

        def on_delivery(error, message):
            if error is not None:
                failures.append(str(error))
            else:
                delivered.append((message.partition(), message.offset()))

        if transactional_id:
            producer.init_transactions(30)
            producer.begin_transaction()
        count = 0
        for partition, key, value, timestamp_ms in records:
            while True:
                try:
                    producer.produce(topic, value=value, key=key, partition=partition, on_delivery=on_delivery,
                                     headers=headers,
                                     **({"timestamp": timestamp_ms} if timestamp_ms is not None else {}))
                    break
                except BufferError:
                    producer.poll(0.05)
            count += 1
            if count % 10000 == 0:
                producer.poll(0)
        producer.flush(60)  # every record in the log before the marker: aborted ones too
        if transactional_id:
            producer.abort_transaction(30) if abort else producer.commit_transaction(60)
        if failures or len(delivered) != count:
            raise RuntimeError(f"produced {count} records to {topic}: {len(delivered)} delivered, "
                               f"failures: {failures[:3]}")
        if transactional_id:
            self._wait_stable(topic, delivered)
        return sorted(delivered)

    def _wait_stable(self, topic: str, delivered: list[tuple[int, int]], seconds: float = 30) -> None:
        """Returns once the last stable offset of each partition written to is past its records:
        Kafka's transactions (version 2, Kafka 4's default) return from the commit or abort before
        the markers are written, and a read_committed ListOffsets meanwhile still answers the old
        last stable offset (seen within 20-100 ms)."""
        last: dict[int, int] = {}
        for partition, offset in delivered:
            last[partition] = max(offset, last.get(partition, -1))
        deadline = time.monotonic() + seconds
        while last:
            futures = self.admin().list_offsets({TopicPartition(topic, p): OffsetSpec.latest() for p in last},
                                                isolation_level=IsolationLevel.READ_COMMITTED)
            for key, future in futures.items():
                if future.result(timeout=30).offset > last[key.partition]:
                    del last[key.partition]
            if last and time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: the last stable offset stayed at or below {last} for {seconds:.0f}s")
            if last:
                time.sleep(0.01)

    def add_scram_user(self, user: str, password: str, mechanism: str = "SCRAM-SHA-512") -> None:
        """Creates (or changes) a SCRAM user through the admin client (KIP-554, Kafka 2.7 and later)."""
        upsertion = UserScramCredentialUpsertion(
            user, ScramCredentialInfo(getattr(ScramMechanism, mechanism.replace("-", "_")), 4096), password.encode())
        self._wait(self.admin().alter_user_scram_credentials([upsertion]))

    def allow(self, principal: str, resource: str, name: str, *operations: str,
              pattern: str = "LITERAL") -> None:
        """Grants ``principal`` (``User:reader``, ``User:CN=reader``) each of ``operations`` (READ,
        DESCRIBE, ...) on the ``resource`` (topic, group, cluster) ``name``, from any host."""
        bindings = [AclBinding(ResourceType[resource.upper()], name, ResourcePatternType[pattern], principal, "*",
                               AclOperation[operation], AclPermissionType.ALLOW) for operation in operations]
        for future in self.admin().create_acls(bindings).values():
            future.result(timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        if self.temporary_dir is not None:
            shutil.rmtree(self.temporary_dir, ignore_errors=True)
            self.temporary_dir = None

    def kill(self) -> None:
        """Ends the local broker at once (SIGKILL), as a crash would: nothing flushed, no
        controlled shutdown. ``restart()`` brings it back."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(30)

    def restart(self) -> None:
        """Stops the local broker (if it still runs) and starts it again on the same address; it
        keeps its data only when it was started with a data directory."""
        if self.launch is None:
            raise RuntimeError("only a broker started here can be restarted")
        if self.process is not None:
            stop_process(self.process)
        self.process = self.launch()
        # The client may hold metadata from while the broker was away (partitions without leaders),
        # which it does not refresh before its next request fails.
        self._admin = None


class DevCertificates:
    """A certificate authority of the tests' own, made at run time in ``directory``, and the
    certificates it signs, in PEM (the files librdkafka reads, and Kafka's keystores of type PEM).

    ``ca``: the authority's certificate (clients' ``ssl.ca.location``, the broker's truststore);
    ``broker``: the broker's key and certificate chain in one file (its keystore), valid for
    127.0.0.1 and localhost, also the certificate the broker presents as a client of its own
    listeners (principal ``User:CN=broker``); ``client(name)``: a client's certificate and key
    (principal ``User:CN=<name>``), the key encrypted when given a passphrase."""

    def __init__(self, directory: str | os.PathLike):
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "oncemore test CA")])
        self._ca = self._certificate(self._name, self._key.public_key(), ca=True)
        self.ca = self.directory / "ca.pem"
        self.ca.write_bytes(self._pem(self._ca))
        key, certificate = self._signed("broker", server=True)
        self.broker = self.directory / "broker.pem"
        self._write_private(self.broker, self._key_pem(key, None) + self._pem(certificate) + self._pem(self._ca))

    def client(self, name: str, key_password: str | None = None) -> tuple[Path, Path]:
        """(certificate, key) files of client ``name``; the key encrypted with ``key_password`` if given."""
        key, certificate = self._signed(name, server=False)
        certificate_path, key_path = self.directory / f"{name}.crt", self.directory / f"{name}.key"
        certificate_path.write_bytes(self._pem(certificate))
        self._write_private(key_path, self._key_pem(key, key_password))
        return certificate_path, key_path

    def _signed(self, name: str, server: bool):
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        return key, self._certificate(subject, key.public_key(), ca=False, server=server)

    def _certificate(self, subject, public_key, ca: bool, server: bool = False):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID

        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self._name)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if server:  # clients verify the broker's host name (librdkafka and Java do by default)
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(self._key, hashes.SHA256())

    @staticmethod
    def _pem(certificate) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return certificate.public_bytes(serialization.Encoding.PEM)

    @staticmethod
    def _key_pem(key, password: str | None) -> bytes:
        from cryptography.hazmat.primitives import serialization

        encryption = (serialization.BestAvailableEncryption(password.encode()) if password
                      else serialization.NoEncryption())
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)

    @staticmethod
    def _write_private(path: Path, content: bytes) -> None:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(content)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def setup_cache_dir(pom: Path, prefix: str, what: str) -> Path:
    """The directory scripts/setup filled with ``what`` for ``pom``, found by the same rule:
    ``prefix`` and the first 16 hex digits of the pom's sha256, under
    ``${XDG_CACHE_HOME:-~/.cache}/oncemore``; raises if setup has not completed it."""
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
    directory = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oncemore" / f"{prefix}-{digest}"
    if not (directory / ".complete").is_file():
        raise FileNotFoundError(f"{what} for {pom} are not in {directory}: run scripts/setup "
                                "(it copies them with Maven, once)")
    return directory


def kafka_release(version: str) -> KafkaRelease:
    try:
        return KAFKA_RELEASES[version]
    except KeyError:
        raise ValueError(f"no Kafka {version!r} broker here: the versions are {', '.join(KAFKA_RELEASES)}") from None


def kafka_jars_dir(version: str = DEFAULT_KAFKA_VERSION) -> Path:
    """The jars scripts/setup copied for the pom of Kafka ``version`` (KAFKA_RELEASES)."""
    return setup_cache_dir(kafka_release(version).pom, kafka_release(version).cache, f"the Kafka {version} broker's jars")


def kafka_full_version(version: str = DEFAULT_KAFKA_VERSION) -> str:
    """The exact release of Kafka ``version``'s broker (4.4.0, 3.9.1), as its jar is named."""
    (jar,) = kafka_jars_dir(version).glob("kafka_2.13-*.jar")
    return jar.stem.removeprefix("kafka_2.13-")


def _quorum_properties(release: KafkaRelease, controller_port: int) -> dict[str, str]:
    if release.dynamic_quorum:
        return {"controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}"}
    return {"controller.quorum.voters": f"1@127.0.0.1:{controller_port}"}  # node.id 1, the only voter


def start_kafka(*, data_dir: str | os.PathLike | None = None, sasl: str | None = None, user: str = "admin",
                password: str = "admin", configs: dict[str, str] | None = None, seconds: float = 90,
                jvm_options: list[str] | None = None, tls: DevCertificates | None = None,
                authorizer: bool = False, version: str = DEFAULT_KAFKA_VERSION) -> DevBroker:
    """An Apache Kafka broker, one node of its own KRaft quorum, on free ports of 127.0.0.1: Kafka
    ``version`` (KAFKA_RELEASES: 4.4, or 3.9), every option alike on either.

    ``data_dir`` (absent or empty) keeps its properties, data and log (``logs/server.log``) for
    ``restart()``; without it they live in a temporary directory that ``stop()`` removes. With
    ``sasl`` (a SCRAM mechanism) clients connect on a SASL listener as ``user``, whose
    credentials are written into the quorum's metadata when the storage is formatted; the password
    never reaches a command line (a process list shows every one) and is kept on disk only while
    formatting. ``configs`` are more broker properties, or replace ours; ``jvm_options`` replace
    the broker JVM's (KAFKA_JVM_OPTIONS, and the class archive once written).

    With ``tls`` (certificates of a test authority) every listener is TLS: ``SSL`` (one-way: the
    client checks the broker, the principal is ``User:ANONYMOUS``), ``MTLS`` (client certificates
    required: the principal is ``User:CN=<name>``; the broker's own connections use it too) and,
    with ``sasl``, ``SASL_SSL``; ``DevBroker.listeners`` names their addresses. The broker's own
    client (topics, records, users, ACLs) is ``user`` over SASL_SSL with ``sasl``, else the
    certificate ``admin`` over MTLS. With ``authorizer`` Kafka's StandardAuthorizer allows only
    what ACLs grant (``DevBroker.allow``), to all but the broker itself and its own client
    (``super.users``)."""
    if sasl is not None and sasl not in SCRAM_MECHANISMS:
        raise ValueError(f"sasl must be one of {', '.join(SCRAM_MECHANISMS)}, not {sasl!r}")
    if sasl and any(c in f"{user}{password}" for c in ",\n"):
        raise ValueError("a SCRAM user or password for the local broker cannot hold a comma or a line break")
    release, jars = kafka_release(version), kafka_jars_dir(version)
    temporary_dir = None if data_dir else Path(tempfile.mkdtemp(prefix="oncemore-kafka-"))
    root = Path(data_dir or temporary_dir).resolve()
    if data_dir and root.exists() and any(root.iterdir()):
        raise ValueError(f"{root} is not empty: a broker starts on an empty data directory "
                         "(DevBroker.restart() starts one on its own again)")
    (root / "logs").mkdir(parents=True, exist_ok=True)
    # Listener names and their protocols. The broker's own connections (from its controller, its
    # coordinators) use the first: PLAINTEXT without TLS, so it needs no credentials of its own;
    # with TLS, MTLS with its certificate, so no listener lets an anonymous client act as the broker.
    if tls is None:
        protocols = {"PLAINTEXT": "PLAINTEXT", **({"SASL_PLAINTEXT": "SASL_PLAINTEXT"} if sasl else {})}
        controller_protocol, broker_principal = "PLAINTEXT", "User:ANONYMOUS"
    else:
        protocols = {"MTLS": "SSL", "SSL": "SSL", **({"SASL_SSL": "SASL_SSL"} if sasl else {})}
        controller_protocol, broker_principal = "SSL", "User:CN=broker"
    internal = next(iter(protocols))
    client_listener = ("SASL_SSL" if tls is not None else "SASL_PLAINTEXT") if sasl else internal
    ports, controller_port = {name: free_port() for name in protocols}, free_port()
    properties = {
        "process.roles": "broker,controller",
        "node.id": "1",
        **_quorum_properties(release, controller_port),
        "controller.listener.names": "CONTROLLER",
        "listeners": ",".join(f"{name}://127.0.0.1:{p}" for name, p in {**ports, "CONTROLLER": controller_port}.items()),
        "advertised.listeners": ",".join(f"{name}://127.0.0.1:{p}" for name, p in ports.items()),
        "listener.security.protocol.map": ",".join(f"{name}:{protocol}" for name, protocol in protocols.items())
                                          + f",CONTROLLER:{controller_protocol}",
        "inter.broker.listener.name": internal,
        "log.dirs": str(root / "kafka-logs"),
        # One node: every internal topic has one replica, or it is never created.
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        **release.properties,
        # One partition each, not 50: the first group's offset commit took 0.4-0.5 s (now and then
        # failing NOT_COORDINATOR while its partition loaded), now 0.08 s; a fresh data directory
        # holds 3 partitions, not 101.
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.num.partitions": "1",
        # A consumer group forms at once rather than after 3 s; the cleaner looks for work every
        # 0.2 s, not 15 s, so a test sees a compacted topic cleaned within seconds.
        "group.initial.rebalance.delay.ms": "0",
        "log.cleaner.backoff.ms": "200",
        # The cleaner's key map is allocated, and touched, on the heap at start-up: 128 MB by
        # default, more than the rest of an idle broker's heap; 8 MB holds 300,000 keys.
        "log.cleaner.dedupe.buffer.size": str(8 << 20),
        # A broker killed and started again registers anew only once the controller has given up
        # its old session: after 3 s of missed heartbeats (every 0.5 s), not 9 s (of one per 2 s).
        "broker.session.timeout.ms": "3000",
        "broker.heartbeat.interval.ms": "500",
        # A transaction whose producer died is aborted within 1 s of its timeout, not 10 s: until
        # then it holds back every read_committed consumer of its partitions.
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
    }
    client_options: dict[str, str] = {}
    if tls is not None:
        # PEM files as the stores (Kafka 2.7 and later); client certificates required on every
        # listener but the one-way ones (SSL, SASL_SSL).
        properties.update({"ssl.keystore.type": "PEM", "ssl.keystore.location": str(tls.broker),
                           "ssl.truststore.type": "PEM", "ssl.truststore.location": str(tls.ca),
                           "ssl.client.auth": "required"})
        properties.update({f"listener.name.{name.lower()}.ssl.client.auth": "none"
                           for name, protocol in protocols.items() if name != "MTLS" and protocol != "PLAINTEXT"})
        client_options = {"security.protocol": "SSL", "ssl.ca.location": str(tls.ca)}
        if not sasl:
            certificate, key = tls.client("admin")
            client_options.update({"ssl.certificate.location": str(certificate), "ssl.key.location": str(key)})
    if sasl:
        properties["sasl.enabled.mechanisms"] = sasl
        properties[f"listener.name.{client_listener.lower()}.{sasl.lower()}.sasl.jaas.config"] = \
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        client_options.update({"security.protocol": protocols[client_listener], "sasl.mechanism": sasl,
                               "sasl.username": user, "sasl.password": password})
    if authorizer:
        own_client = f"User:{user}" if sasl else "User:CN=admin" if tls is not None else broker_principal
        properties.update({"authorizer.class.name": STANDARD_AUTHORIZER,
                           "super.users": ";".join(dict.fromkeys([broker_principal, own_client]))})
    properties.update(configs or {})
    properties_path = root / "server.properties"
    properties_path.write_text("".join(f"{key}={value}\n" for key, value in properties.items()))
    (root / VERSION_FILE).write_text(f"{version}\n")
    broker = DevBroker(f"127.0.0.1:{ports[client_listener]}", client_options=client_options,
                       log_path=root / "logs" / "server.log", temporary_dir=temporary_dir,
                       listeners={name: f"127.0.0.1:{p}" for name, p in ports.items()})
    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else "java"
    # The JVMs' temporary files (the compression codecs' native libraries) stay in the data directory.
    (root / "tmp").mkdir(exist_ok=True)
    common = [f"-Djava.io.tmpdir={root / 'tmp'}", "-cp", str(jars / "*")]
    try:
        _format_kafka_storage([java, *_kafka_jvm_options(jars), *common], root, properties_path,
                              sasl and (sasl, user, password), release)
        command = _kafka_command(java, version, root, jvm_options)
        broker.launch = lambda: _launch_kafka(command, root, broker, seconds)
        broker.process = broker.launch()
        _kafka_brokers.append((os.getpid(), broker))
    except BaseException:
        broker.stop()
        raise
    return broker


def _kafka_command(java: str, version: str, root: Path, jvm_options: list[str] | None) -> list[str]:
    """The Kafka ``version`` broker JVM of the data directory ``root`` (its server.properties, logs
    and temporary files)."""
    jars = kafka_jars_dir(version)
    return [java, *(_kafka_jvm_options(jars) if jvm_options is None else jvm_options),
            f"-Djava.io.tmpdir={root / 'tmp'}", "-cp", str(jars / "*"),
            kafka_release(version).logging, f"-Dkafka.logs.dir={root / 'logs'}",
            "kafka.Kafka", str(root / "server.properties")]


def _kafka_jvm_options(jars: Path) -> list[str]:
    archive = jars / KAFKA_CLASS_ARCHIVE
    # A JVM that cannot use the archive (another Java) says so in its output and starts without it.
    return [*KAFKA_JVM_OPTIONS, *([f"-XX:SharedArchiveFile={archive}"] if archive.is_file() else [])]


def _format_kafka_storage(java: list[str], root: Path, properties_path: Path,
                          scram: tuple[str, str, str] | None, release: KafkaRelease) -> None:
    """Formats the node's log directory as a new cluster whose only voter it is (StorageTool ends
    its JVM with exit, so it runs in one of its own), adding the SCRAM user if any. A static
    quorum names its voters in the properties; a dynamic one's first voter is ``--standalone``."""
    cluster_id = "-"
    while cluster_id.startswith("-"):  # Kafka's own ids never start with one: it reads as an option
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    arguments = ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(properties_path),
                 *(["--standalone"] if release.dynamic_quorum else [])]
    if scram:
        mechanism, user, password = scram
        arguments += ["--add-scram", f"{mechanism}=[name={user},password={password}]"]
    # A java launcher argument file (@file, main class and all): the password stays off the command line.
    argument_file = root / "format.args"
    descriptor = os.open(argument_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.writelines('"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"\n' for a in arguments)
    try:
        done = subprocess.run([*java, f"@{argument_file}"], cwd=root, capture_output=True, text=True, timeout=120)
    finally:
        argument_file.unlink()
    if done.returncode != 0:
        raise RuntimeError(f"formatting the Kafka broker's storage in {root} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[:3000]}")


def _launch_kafka(command: list[str], root: Path, broker: DevBroker, seconds: float) -> subprocess.Popen:
    """Starts the broker's JVM in its data directory (where a crashing JVM writes its report), its
    own output (which its log takes over at once) into ``jvm.out`` beside the log, and returns once
    it serves; kills it if it does not in ``seconds``."""
    with (broker.log_path.parent / "jvm.out").open("a") as output:
        process = subprocess.Popen(command, cwd=root, stdin=subprocess.DEVNULL, stdout=output,
                                   stderr=subprocess.STDOUT)
    return serving(process, lambda started: _wait_kafka_ready(started, broker, seconds))


@atexit.register
def _stop_kafka_left_running() -> None:
    """A broker nobody stopped (a script that raised, a fixture that never finished) ends with
    this interpreter rather than outlive it, and its temporary directory with it. Not a forked
    child's: the brokers are its parent's."""
    for starter, broker in _kafka_brokers:
        if starter == os.getpid():
            broker.stop()


def _wait_kafka_ready(process: subprocess.Popen, broker: DevBroker, seconds: float) -> None:
    """Returns once the broker answers a metadata request naming itself and a leader for every
    partition: it opens its client listener only after it caught up with the quorum, but a client
    connecting then still has to get through the handshake (and SASL), and after a kill its
    partitions get their leader back only once it is unfenced. Raises with the log's end if it
    exits or takes longer."""
    host, port = broker.bootstrap_servers.rsplit(":", 1)
    deadline = time.monotonic() + seconds
    admin, last_error = None, "its client port never opened"
    while process.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), 0.2).close()
        except OSError:
            time.sleep(0.05)
            continue
        if admin is None:  # retrying quickly: librdkafka's own backoff grows to 10 s
            admin = AdminClient({**broker._client_config(), "reconnect.backoff.max.ms": 200})
        try:
            metadata = admin.list_topics(timeout=1)
        except KafkaException as exc:
            last_error = str(exc)
            continue
        leaderless = [f"{topic.topic}-{partition.id}" for topic in metadata.topics.values()
                      for partition in topic.partitions.values() if partition.leader < 0 or partition.error]
        if metadata.brokers and not leaderless:
            _wait_producer_ids(broker, deadline)
            return
        last_error = f"partitions without a leader: {', '.join(leaderless[:5])}" if leaderless else "no broker"
        time.sleep(0.05)
    if process.poll() is not None:
        problem = f"exited with code {process.returncode} while starting"
    else:
        problem = f"did not serve within {seconds:.0f}s ({last_error})"
    raise RuntimeError(f"the Kafka broker on {broker.bootstrap_servers} {problem}; the end of {broker.log_path}:\n"
                       f"{_log_tail(broker.log_path)}{_log_tail(broker.log_path.parent / 'jvm.out')}")


def _wait_producer_ids(broker: DevBroker, deadline: float) -> None:
    """Returns once the broker hands out producer IDs. A broker gets its first block of them from
    its controller on the first InitProducerId after each start and answers that one
    COORDINATOR_LOAD_IN_PROGRESS (Kafka's RPCProducerIdManager): the first idempotent producer,
    the demo's or a user's, retried it after 0.5-1 s and logged a librdkafka warning ("GETPID ...
    Coordinator load in progress"). Asked here, that second costs the start rather than the
    first producer, and nobody sees the retry. Raises if no ID is given by ``deadline``."""
    states: list[str] = []
    quiet = logging.getLogger("devtools.kafkabroker.start")  # the retries are what this waits out
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    producer = Producer({**broker._client_config(), "enable.idempotence": True, "logger": quiet,
                         # The idempotent producer's state is in its statistics; nothing is produced.
                         "statistics.interval.ms": 20,
                         "stats_cb": lambda stats: states.append(json.loads(stats).get("eos", {}).get("idemp_state"))})
    while states[-1:] != ["Assigned"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Kafka broker on {broker.bootstrap_servers} gave no producer ID (its "
                               f"idempotent producer's state: {states[-1:] or 'none'})")
        producer.poll(0.02)


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except FileNotFoundError:
        return ""


def write_kafka_class_archive(version: str = DEFAULT_KAFKA_VERSION) -> Path:
    """Writes the class-data archive (Java's AppCDS) that later broker and format JVMs start from,
    into the jars directory of Kafka ``version``: once, from scripts/setup. A broker started with the archive-writing
    option serves what tests do first (topics, transactions, a group's offsets), and its JVM writes
    the classes it loaded as it exits (about 4 s); the archive takes its final name only then, whole."""
    from confluent_kafka import Consumer

    archive = kafka_jars_dir(version) / KAFKA_CLASS_ARCHIVE
    written = archive.with_name(f"{archive.name}.{os.getpid()}.writing")
    broker = start_kafka(jvm_options=[*KAFKA_JVM_OPTIONS, f"-XX:ArchiveClassesAtExit={written}"], version=version)
    try:
        broker.create_topic("classes", 2)
        broker.produce("classes", [(0, b"k", b"v", None), (1, None, b"w", None)], transactional_id="classes")
        broker.produce("classes", [(0, b"k", None, None)])
        consumer = Consumer({**broker._client_config(), "group.id": "classes", "auto.offset.reset": "earliest",
                             "enable.auto.commit": False})
        consumer.assign([TopicPartition("classes", 0, 0)])
        consumer.consume(2, timeout=10)
        consumer.commit(offsets=[TopicPartition("classes", 0, 1)], asynchronous=False)
        consumer.close()
        stop_process(broker.process, grace_seconds=120)  # writing the archive takes the JVM seconds
        if broker.process.returncode not in (0, 143) or not written.is_file() or not written.stat().st_size:
            raise RuntimeError(f"the Kafka broker's JVM ended with code {broker.process.returncode} and wrote no "
                               f"class archive; the end of its output:\n{_log_tail(broker.log_path.parent / 'jvm.out')}")
        os.replace(written, archive)
    finally:
        broker.stop()
        written.unlink(missing_ok=True)
    return archive


def wait_listening(process: subprocess.Popen, port: int, what: str, seconds: float = 30) -> None:
    """Returns once ``process`` accepts connections on 127.0.0.1:``port``; raises (killing it) if
    it exits first or takes longer than ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{what} did not listen on port {port} within {seconds:.0f}s")


@contextmanager
def running(broker: DevBroker) -> Iterator[DevBroker]:
    try:
        yield broker
    finally:
        broker.stop()


def start_detached_kafka(data_dir: Path, port: int = 9092, seconds: float = 90,
                         version: str = DEFAULT_KAFKA_VERSION) -> int:
    """Starts the Kafka ``version`` broker of ``data_dir`` on 127.0.0.1:``port``, detached
    (devtools.processes), and returns its pid once it serves: a new directory is formatted by
    start_kafka (the tests' broker settings, proven to serve), an existing one starts with its
    topics and records, if the same release formatted it. The ports are set at every start (a
    node's listeners may change; its controller's takes a free port), so one data directory may
    move to another port."""
    release = kafka_release(version)
    properties_path = data_dir / "server.properties"
    if not properties_path.is_file():
        start_kafka(data_dir=data_dir, seconds=seconds, version=version).stop()  # with a data_dir, stop() keeps it
    # Directories from before the file was written are 4.4's, the only broker there was.
    formatted_by = (data_dir / VERSION_FILE).read_text().strip() if (data_dir / VERSION_FILE).is_file() else "4.4"
    if formatted_by != version:
        raise ValueError(f"{data_dir} holds a Kafka {formatted_by} broker's data: start it as Kafka {formatted_by}, "
                         f"or Kafka {version} on another data directory")
    properties = dict(line.split("=", 1) for line in properties_path.read_text().splitlines() if "=" in line)
    if set(properties["listener.security.protocol.map"].split(",")) != {"PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"}:
        raise ValueError(f"{data_dir} holds a broker with other listeners than PLAINTEXT: it cannot serve here")
    controller_port = free_port()
    properties.update({
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        **_quorum_properties(release, controller_port),
    })
    properties_path.write_text("".join(f"{key}={value}\n" for key, value in properties.items()))
    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else "java"
    command = _kafka_command(java, version, data_dir, None)
    broker = DevBroker(f"127.0.0.1:{port}", log_path=data_dir / "logs" / "server.log")
    return start_detached(command, data_dir, data_dir / "logs" / "jvm.out",
                          lambda process: _wait_kafka_ready(process, broker, seconds))


def detached_kafka_address(data_dir: Path) -> tuple[int, str]:
    """The port and bootstrap address the broker of ``data_dir`` serves on."""
    for line in (data_dir / "server.properties").read_text().splitlines():
        if line.startswith("advertised.listeners="):
            address = line.split("//", 1)[1]
            return int(address.rsplit(":", 1)[1]), address
    raise ValueError(f"{data_dir / 'server.properties'} names no advertised listener")


def add_kafka_version_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--kafka-version`` (KAFKA_RELEASES) of a command starting a broker: the release ``what``."""
    parser.add_argument("--kafka-version", choices=list(KAFKA_RELEASES), default=DEFAULT_KAFKA_VERSION,
                        help=f"the Apache Kafka release {what} (default {DEFAULT_KAFKA_VERSION})")


def main(argv: list[str] | None = None) -> int:
    """scripts/kafka: serve_main's commands, for the broker of ``--kafka-version``, whose data lives
    apart from the other release's by default (a data directory is one release's)."""
    versions = argparse.ArgumentParser(add_help=False)
    add_kafka_version_option(versions, "to run; the same for status and stop")
    version = versions.parse_known_args(argv)[0].kafka_version
    default = version == DEFAULT_KAFKA_VERSION
    # The commands it prints (`... stop`) name the release, whose default data directory they act on.
    return serve_main(argv, prog="scripts/kafka" + ("" if default else f" --kafka-version {version}"),
                      what="the Kafka broker" if default else f"the Kafka {version} broker",
                      name="kafka" if default else f"kafka-{version}", default_port=9092,
                      start=functools.partial(start_detached_kafka, version=version), address=detached_kafka_address,
                      parents=[versions])


if __name__ == "__main__":
    raise SystemExit(main())
