"""Which offsets a run ingests: the positions and batch history the table's own Delta log
holds (ledger.py, in the commit records of commitinfo.py), where ranges start and end
(bounds.py), whether positions may be continued (continuity.py), and the plan, batches of
per-partition ranges (planner.py). No Spark.
"""
