"""The decoded records shaped in Spark: a pipeline's transform and its expectations,
checked by Spark's analysis before a record is read.
"""
