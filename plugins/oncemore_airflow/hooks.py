"""OncemoreHook: a pipeline config with Kafka settings from an optional Airflow connection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook
from airflow.sdk.log import mask_secret

from oncemore.config.loading import load_pipeline, with_kafka_overrides
from oncemore.config.model import Pipeline


class OncemoreHook(BaseHook):
    """Loads a pipeline YAML; a Kafka connection (``kafka_conn_id``) overrides its bootstrap
    servers (host[:port]), SASL credentials (login/password) and librdkafka options (extra JSON).
    The password is registered with Airflow's secret masker, so logs never show it."""

    conn_name_attr = "kafka_conn_id"
    conn_type = "kafka"
    hook_name = "oncemore Kafka"

    def __init__(self, config_path: str | Path, kafka_conn_id: str | None = None):
        super().__init__()
        self.config_path, self.kafka_conn_id = str(config_path), kafka_conn_id

    def kafka_overrides(self) -> dict[str, Any]:
        if not self.kafka_conn_id:
            return {}
        connection = self.get_connection(self.kafka_conn_id)
        options = {str(k): v for k, v in (connection.extra_dejson or {}).items()}
        if connection.login:
            options["sasl.username"] = connection.login
        if connection.password:
            mask_secret(connection.password)
            options["sasl.password"] = connection.password
        overrides: dict[str, Any] = {"kafka_options": options}
        if connection.host:
            overrides["bootstrap_servers"] = ",".join(
                f"{host}:{connection.port}" if connection.port and ":" not in host else host
                for host in connection.host.split(",")
            )
        return overrides

    def get_pipeline(self) -> Pipeline:
        pipeline = load_pipeline(self.config_path)
        overrides = self.kafka_overrides()
        return with_kafka_overrides(pipeline, overrides) if overrides else pipeline
