"""One DAG per pipeline config in include/pipelines/ (or ONCEMORE_PIPELINES_DIR).

Broken configs are left out here and reported by oncemore_config_errors.py, so one bad file
never hides the other pipelines.
"""

from oncemore_airflow.factory import load_dags

globals().update(load_dags())
