# The image of every oncemore process in docker-compose.yaml: Airflow 3 (scheduler, DAG processor,
# API server and the tasks' spark-submit) and the Spark master, worker and executors, which need the
# same Python packages as the driver. Java 17 runs Spark.
FROM apache/airflow:3.3.2-python3.11
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/*
USER airflow
COPY requirements.txt /opt/oncemore/requirements.txt
RUN pip install --no-cache-dir -r /opt/oncemore/requirements.txt
COPY --chown=airflow:root dags /opt/oncemore/dags
COPY --chown=airflow:root plugins /opt/oncemore/plugins
COPY --chown=airflow:root include /opt/oncemore/include
COPY --chown=airflow:root spark_jobs /opt/oncemore/spark_jobs
ENV PYTHONPATH=/opt/oncemore/include:/opt/oncemore/plugins \
    PYSPARK_PYTHON=python3
WORKDIR /opt/oncemore
