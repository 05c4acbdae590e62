"""The real Airflow services on one machine, for local runs and the tests: ``airflow db migrate``,
then the scheduler, the DAG processor and the API server as separate processes (LocalExecutor on
SQLite), this checkout's DAGs and plugins. Started and stopped here; ``api()`` calls the REST API
the way Airflow's UI does.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Mapping
from urllib.error import HTTPError

from devtools.kafkabroker import free_port, wait_listening
from oncemore_airflow import embedded

SERVICES = ("api-server", "dag-processor", "scheduler")


USERNAME = "admin"


class AirflowServices:
    """The running services; ``username``/``password`` log in to the UI and the REST API (the
    simple auth manager's one admin user, its password generated for this home)."""

    def __init__(self, url: str, home: Path, env: dict[str, str], processes: dict[str, subprocess.Popen]):
        self.url, self.home, self.env, self.processes = url, home, env, processes
        self.username = USERNAME
        self._token: str | None = None

    @property
    def password(self) -> str:
        return json.loads(Path(self.env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).read_text())[self.username]

    def api(self, method: str, path: str, body: Mapping[str, Any] | None = None, attempts: int = 10) -> Any:
        """One REST call (``/api/v2/...``) with a token from ``POST /auth/token``. A 503 is
        retried: on SQLite the API answers it while the scheduler holds the database lock."""
        if self._token is None:
            self._token = self._call("POST", "/auth/token", {"username": self.username, "password": self.password},
                                     token=None)["access_token"]
        for attempt in range(attempts):
            try:
                return self._call(method, path, body, self._token)
            except HTTPError as error:
                if error.code != 503 or attempt == attempts - 1:
                    raise
                time.sleep(1 + attempt)

    def create_backfill(self, body: Mapping[str, Any]) -> dict:
        """``POST /api/v2/backfills``. On SQLite a create can commit and still answer 503 (the lock
        met after the write); its retry then gets 409 (one active backfill per DAG): that active
        backfill is the one this call created."""
        try:
            return self.api("POST", "/api/v2/backfills", body)
        except HTTPError as error:
            if error.code != 409:
                raise
        backfills = self.api("GET", f"/api/v2/backfills?dag_id={body['dag_id']}")["backfills"]
        (active,) = [b for b in backfills if not b["completed_at"]]
        return active

    def dag_runs(self, dag_id: str) -> list[dict]:
        """The DAG's runs by logical date; none while the DAG processor has not parsed it yet (404)."""
        try:
            return self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns?order_by=logical_date&limit=100")["dag_runs"]
        except HTTPError as error:
            if error.code == 404:
                return []
            raise

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None, token: str | None) -> Any:
        request = urllib.request.Request(self.url + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {token}"} if token else {})})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def service_environment(home: Path, port: int, extra: Mapping[str, str]) -> dict[str, str]:
    """What every Airflow process of the local topology shares: the embedded default's settings,
    the LocalExecutor, one JWT secret (tasks report to the API server with tokens it signs), one
    admin user whose password is generated into a file only this user can read."""
    passwords = home / "simple_auth_manager_passwords.json"
    if not passwords.exists():
        passwords.touch(mode=0o600)
        passwords.write_text(json.dumps({USERNAME: secrets.token_urlsafe(16)}))
    env = {**os.environ, **embedded.settings(str(home))}
    env.update({
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        **extra,
    })
    return env


def start_airflow(home: Path, extra_env: Mapping[str, str] | None = None) -> AirflowServices:
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = service_environment(home, port, extra_env or {})
    airflow = [sys.executable, "-m", "airflow"]
    subprocess.run([*airflow, "db", "migrate"], env=env, check=True, capture_output=True, timeout=600)
    processes = {}
    try:
        for service in SERVICES:
            log = (home / f"{service}.log").open("w")
            arguments = [service, "--port", str(port)] if service == "api-server" else [service]
            processes[service] = subprocess.Popen([*airflow, *arguments], env=env, stdout=log, stderr=subprocess.STDOUT)
            if service == "api-server":  # tasks report to it: up before the scheduler starts any
                wait_listening(processes[service], port, f"airflow api-server (log: {home / 'api-server.log'})", 120)
        return AirflowServices(f"http://127.0.0.1:{port}", home, env, processes)
    except BaseException:
        AirflowServices("", home, env, processes).stop()
        raise


def wait_for(condition, seconds: float, what: str, interval: float = 2.0):
    """Polls ``condition()`` until it returns something truthy; raises naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval)
    raise TimeoutError(f"waited {seconds:.0f}s for {what}")
