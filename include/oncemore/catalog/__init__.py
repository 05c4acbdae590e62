"""Catalog registration: a pipeline's tables named in a Hive Metastore or AWS Glue after its commits."""
