"""Stopping the local servers the demo and the tests start (kafkabroker, schemaregistry, s3server,
sparkcluster): politely (SIGTERM, so a broker with a data directory flushes it), then surely, so no
test leaves a process behind."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen, grace_seconds: float = 10) -> None:
    process.terminate()
    try:
        process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
