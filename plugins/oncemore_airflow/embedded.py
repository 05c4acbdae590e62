"""The embedded default Airflow: SQLite under a home directory, this checkout's DAGs and plugins,
Spark local[2]. Call before Airflow is first imported: it reads its configuration then."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def settings(home: str) -> dict[str, str]:
    """The environment of the embedded default's Airflow processes."""
    return {
        "AIRFLOW_HOME": home,
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW_CONN_ONCEMORE_SPARK": '{"conn_type": "spark", "host": "local[2]"}',
        # Task processes and spark-submit's Python find the core package and the plugins.
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "include"), str(ROOT / "plugins")] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        ),
    }


def configure(home: str) -> None:
    """Sets up this process for the embedded default's Airflow (before Airflow is imported)."""
    os.environ.update(settings(home))
