"""docker-compose.yaml and the Dockerfile, checked statically against the project (no Docker engine
here): the topology is the one scripts/production runs, every command exists, every variable a
pipeline or the project reads is set, and the image has Java and the project's requirements."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import yaml

from conftest import ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
SERVICES = COMPOSE["services"]
ONCEMORE_SERVICES = ["spark-master", "spark-worker", "spark-connect", "airflow-init", "airflow-apiserver", "airflow-scheduler",
                     "airflow-dag-processor"]


def test_the_topology_is_kafka_kraft_s3_postgres_spark_and_the_three_airflow_services():
    assert SERVICES["kafka"]["image"].startswith("apache/kafka:")
    assert SERVICES["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert SERVICES["minio"]["image"].startswith("minio/minio:") and "mc mb" in " ".join(SERVICES["minio-init"]["entrypoint"])
    assert SERVICES["postgres"]["image"].startswith("postgres:")
    registry = SERVICES["schema-registry"]
    assert registry["image"].startswith("confluentinc/cp-schema-registry:")
    assert registry["environment"]["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"] == "PLAINTEXT://kafka:9092"
    assert COMPOSE["x-oncemore"]["environment"]["SCHEMA_REGISTRY_URL"] == "http://schema-registry:8081"
    for name in ONCEMORE_SERVICES:
        assert SERVICES[name]["build"] == "." and SERVICES[name]["image"] == "oncemore:local", name
    assert {tuple(SERVICES[n]["command"]) for n in ONCEMORE_SERVICES if n.startswith("airflow")} == {
        ("db", "migrate"), ("api-server",), ("scheduler",), ("dag-processor",)}
    for name, service in SERVICES.items():
        for dependency in service.get("depends_on", []):
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"


def test_every_airflow_command_exists_in_the_pinned_airflow():
    for name in ONCEMORE_SERVICES:
        if name.startswith("airflow"):
            command = SERVICES[name]["command"]
            result = subprocess.run([sys.executable, "-m", "airflow", *command, "--help"], capture_output=True, text=True,
                                    timeout=120)
            assert result.returncode == 0, (name, result.stderr[-500:])


def test_spark_services_start_the_classes_the_local_cluster_starts():
    local = (ROOT / "devtools" / "sparkcluster.py").read_text()
    for name in ("spark-master", "spark-worker"):
        entrypoint = SERVICES[name]["entrypoint"]
        assert entrypoint[0] == "spark-class" and entrypoint[1] in local, name
    master = SERVICES["spark-master"]["entrypoint"]
    assert SERVICES["spark-worker"]["entrypoint"][2] == f"spark://spark-master:{master[master.index('--port') + 1]}"
    spark = yaml.safe_load(SERVICES["airflow-scheduler"]["environment"]["AIRFLOW_CONN_ONCEMORE_SPARK"])
    assert spark == {"conn_type": "spark", "host": "spark://spark-master:7077"}


def test_the_spark_connect_service_starts_the_server_the_tests_start_with_the_same_redaction():
    from devtools.sparkconnect import SERVER_CLASS, WORKER_DAEMON
    from oncemore.core.redaction import SPARK_CONF_REGEX

    entrypoint = SERVICES["spark-connect"]["entrypoint"]
    assert entrypoint[:3] == ["spark-submit", "--class", SERVER_CLASS] and entrypoint[-1] == "spark-internal"
    confs = dict(entrypoint[i + 1].split("=", 1) for i, arg in enumerate(entrypoint) if arg == "--conf")
    assert confs["spark.redaction.regex"] == SPARK_CONF_REGEX
    assert entrypoint[entrypoint.index("--master") + 1] == "spark://spark-master:7077"
    assert confs["spark.connect.session.manager.defaultSessionTimeout"] == "3h", "hourly runs find their session"
    assert confs["spark.python.daemon.module"] == WORKER_DAEMON
    # The executors import the daemon from the image's package (every service shares the image).
    assert SERVICES["spark-worker"]["image"] == SERVICES["spark-connect"]["image"]
    assert re.search(r"^ENV PYTHONPATH=/opt/oncemore/include:", (ROOT / "Dockerfile").read_text(), re.M)
    connection = yaml.safe_load(SERVICES["airflow-scheduler"]["environment"]["AIRFLOW_CONN_ONCEMORE_CONNECT"])
    assert connection == {"conn_type": "spark_connect", "host": "spark-connect",
                          "port": int(confs["spark.connect.grpc.binding.port"])}


def test_every_variable_the_pipelines_and_the_project_read_is_set():
    env = SERVICES["airflow-scheduler"]["environment"]
    referenced = set()
    pipelines = ROOT / "include" / "pipelines"
    for path in [*pipelines.glob("*.yaml"), *(pipelines / "examples").glob("*.yaml")]:  # values only, not comments
        referenced |= set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", json.dumps(yaml.safe_load(path.read_text()))))
    assert referenced and referenced <= set(env), referenced - set(env)
    assert env["ONCEMORE_PIPELINES_DIR"] == "/opt/oncemore/include/pipelines"
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == "/opt/oncemore/dags"
    assert env["ONCEMORE_DATA_DIR"].startswith("s3://") and env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert "AWS_S3_ALLOW_UNSAFE_RENAME" not in env


def test_the_image_has_java_the_requirements_and_the_project():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM apache/airflow:3\.3\.2-python3\.11$", dockerfile, re.M)
    assert "openjdk-17-jre-headless" in dockerfile
    assert "pip install --no-cache-dir -r /opt/oncemore/requirements.txt" in dockerfile
    for copied in re.findall(r"^COPY (?:--\S+ )?(\S+) ", dockerfile, re.M):
        assert (ROOT / copied).exists(), copied
    pinned = re.search(r"^apache-airflow==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert f"apache/airflow:{pinned}-" in dockerfile, "the image's Airflow is the pinned one"
