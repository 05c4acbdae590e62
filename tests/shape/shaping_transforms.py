"""A DAG author's transform, as `transform: {python: "shaping_transforms:upper_customers"}` names it."""

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def upper_customers(records: DataFrame) -> DataFrame:
    """A pandas UDF: it runs in the workers that read and write the records (run/jobs.py keeps pandas there)."""
    upper = F.pandas_udf(lambda customers: customers.str.upper(), "string")
    return records.withColumn("customer", upper("customer"))


def twice_through_an_rdd(records: DataFrame) -> DataFrame:
    """Two rows of every record, out of Spark's sight: an RDD's rows carry no lineage to the records."""
    return records.rdd.flatMap(lambda row: [row, row]).toDF(records.schema)


def nothing(records: DataFrame) -> DataFrame:
    return records.where(F.lit(False))


def fails_each_tasks_first_attempt(records: DataFrame) -> DataFrame:
    """A Python UDF that fails the first attempt of every task it runs in (the retry succeeds)."""
    from pyspark import TaskContext

    def first_attempt_fails(customer):
        if TaskContext.get().attemptNumber() == 0:
            raise RuntimeError("this task's first attempt fails")
        return customer

    return records.withColumn("customer", F.udf(first_attempt_fails, "string")("customer"))
