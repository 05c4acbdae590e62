"""A DAG author's transform, as `transform: {python: "shaping_transforms:upper_customers"}` names it."""

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def upper_customers(records: DataFrame) -> DataFrame:
    return records.withColumn("customer", F.upper("customer"))


def twice_through_an_rdd(records: DataFrame) -> DataFrame:
    """Two rows of every record, out of Spark's sight: an RDD's rows carry no lineage to the records."""
    return records.rdd.flatMap(lambda row: [row, row]).toDF(records.schema)


def nothing(records: DataFrame) -> DataFrame:
    return records.where(F.lit(False))
