"""The peer: what a Spark user writes instead of oncemore to land a Kafka topic in a Delta table,
Structured Streaming with Spark's own Kafka source, `from_json` or `from_avro`, a delta-spark sink
and `Trigger.AvailableNow`, its checkpoint on local disk. Run by benchmarks/peers.py through
spark-submit (with devtools.sparkjars' jars) or as a Spark Connect client (--remote); it reads read_committed
and keeps the Kafka coordinates as columns, as oncemore does, so both write the same rows.

    spark-submit <sparkjars.submit_arguments()> peer_streaming.py --bootstrap HOST:PORT --topic T
        --table PATH --checkpoint PATH (--ddl 'id BIGINT, ...' | --avro-schema JSON) [--transform SQL]
        [--remote sc://...]

``--transform`` is Spark SQL over the view ``records`` (the rows it would write otherwise), as an
oncemore pipeline's ``transform`` reads them.
"""

from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--bootstrap", "--topic", "--table", "--checkpoint"):
        parser.add_argument(name, required=True)
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--ddl", help="the JSON values' schema, Spark DDL")
    shape.add_argument("--avro-schema", help="the Avro values' writer schema (Confluent's wire format)")
    parser.add_argument("--transform", help="Spark SQL over the view records, as an oncemore pipeline's transform")
    parser.add_argument("--remote", help="a Spark Connect server instead of this process's own Spark")
    args = parser.parse_args()
    builder = SparkSession.builder.appName("peer")
    spark = (builder.remote(args.remote) if args.remote else builder).getOrCreate()
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    records = (spark.readStream.format("kafka")
               .option("kafka.bootstrap.servers", args.bootstrap).option("subscribe", args.topic)
               .option("startingOffsets", "earliest").option("kafka.isolation.level", "read_committed").load())
    if args.ddl:
        value = F.from_json(F.col("value").cast("string"), args.ddl)
    else:
        from pyspark.sql.avro.functions import from_avro

        # Confluent's serializer puts a magic byte and a 4-byte schema ID before the Avro body.
        value = from_avro(F.expr("substring(value, 6, length(value) - 5)"), args.avro_schema)
    rows = records.select(value.alias("value"), F.col("key"), F.col("topic").alias("_kafka_topic"),
                          F.col("partition").alias("_kafka_partition"), F.col("offset").alias("_kafka_offset"),
                          F.col("timestamp").alias("_kafka_timestamp")).select(
        "key", "value.*", "_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp")
    if args.transform:
        rows.createOrReplaceTempView("records")
        rows = spark.sql(args.transform)
    query = (rows.writeStream.format("delta").option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True).start(args.table))
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
