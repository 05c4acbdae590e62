"""Airflow integration of oncemore: hook, operators and the DAG factory (dags/ only calls it)."""
