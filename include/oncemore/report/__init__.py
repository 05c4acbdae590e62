"""Reading a pipeline back: its status and freshness (status.py), whether a run landed
(landed.py), the oncemore page's overview (overview.py), every pipeline a row (fleet.py: the
page's index and ``status`` with no pipeline), and verify, the exactly-once audit from the tables
alone (verify.py over history.py's committed pieces, tablescan.py), an upsert table's checks
(upserts.py) and replay from Kafka (replay.py), with its kept verdict (verdict.py).
"""
