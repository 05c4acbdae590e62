"""The dev and test servers the demo, the tests and the benchmarks start on this machine: Apache
Kafka, Apicurio Registry, an S3 API server, a Spark standalone cluster, Spark Connect servers, the
real Airflow services; and the Maven poms of their jars. Never part of the oncemore package, never
shipped to Spark's executors; on the path of the tests, the scripts and the benchmarks only.
"""
