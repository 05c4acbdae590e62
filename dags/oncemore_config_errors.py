"""Surfaces broken pipeline configs as an Airflow import error naming each file and its problem.

It defines no DAG (Airflow's safe mode parses only files that mention both words).
"""

from oncemore_airflow.factory import schedulable_pipelines

_broken = schedulable_pipelines()[1]
if _broken:
    raise ImportError("broken oncemore pipeline configs (run `oncemore check` for these, and for the brokers, topics, "
                      "schema registry and tables of the others):\n" + "\n".join(str(e) for e in _broken.values()))
