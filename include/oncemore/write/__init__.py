"""Rows to Parquet files under a table's location, with the Delta statistics of each file,
as a task writes them (files.py, filestats.py). Nothing here commits: the files are the commit
stage's input.
"""
