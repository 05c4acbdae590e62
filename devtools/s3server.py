"""A local S3 API server (moto's, as ``moto_server`` serves it) for local runs and the tests.

Started and stopped by whoever calls ``start_s3_server``; nothing outlives it (in-memory store).
It speaks the real S3 API, conditional puts (``If-None-Match``/ETag) included, so delta-rs
commits on it exactly as on AWS S3 with ``conditional_put=etag``. Conditional, as S3 makes them:
moto checks the condition and then stores, and serves each request in a thread of its own, so two
racing commits of one Delta version both succeeded now and then, the later overwriting the
earlier (seen under load in the commit race of tests/run/test_ingest.py). Here requests that
change the store run one at a time; reads stay concurrent.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from devtools.kafkabroker import free_port, wait_listening
from devtools.processes import stop_process


ROOT = Path(__file__).resolve().parents[1]


class S3Server:
    def __init__(self, endpoint: str, process: subprocess.Popen):
        self.endpoint, self.process = endpoint, process

    def storage_options(self) -> dict[str, str]:
        """delta-rs storage options for this server (moto takes any credentials)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": "oncemore-local", "AWS_SECRET_ACCESS_KEY": "oncemore-local-secret"}

    def client(self):
        import boto3

        options = self.storage_options()
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=options["AWS_REGION"],
                            aws_access_key_id=options["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=options["AWS_SECRET_ACCESS_KEY"])

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def download(self, uri: str, target: Path) -> Path:
        """Copies every object under ``s3://bucket/prefix`` into ``target`` (for readers without S3)."""
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/"):
            for item in page.get("Contents", []):
                if item["Key"].endswith("/"):  # a directory marker (pyarrow's create_dir)
                    continue
                local = target / item["Key"][len(prefix.rstrip("/")) + 1:]
                local.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, item["Key"], str(local))
        return target

    def stop(self) -> None:
        stop_process(self.process)


def start_s3_server(port: int | None = None) -> S3Server:
    port = port or free_port()
    process = subprocess.Popen([sys.executable, "-m", "devtools.s3server", str(port)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(process, port, "the S3 server (moto)")
    return S3Server(f"http://127.0.0.1:{port}", process)


def serve(port: int) -> None:
    """moto's application as ``moto_server`` runs it, its changes of the store one at a time."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    app, changing = DomainDispatcherApplication(create_backend_app), threading.Lock()

    def one_change_at_a_time(environ, start_response):
        if environ["REQUEST_METHOD"] in ("GET", "HEAD"):
            return app(environ, start_response)
        with changing:
            return list(app(environ, start_response))

    run_simple("127.0.0.1", port, one_change_at_a_time, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
