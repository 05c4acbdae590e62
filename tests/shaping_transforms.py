"""A DAG author's transform, as `transform: {python: "shaping_transforms:upper_customers"}` names it."""

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def upper_customers(records: DataFrame) -> DataFrame:
    return records.withColumn("customer", F.upper("customer"))
