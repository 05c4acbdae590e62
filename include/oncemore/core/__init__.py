"""The shared vocabulary every stage speaks: Kafka coordinates (coordinates.py), typed errors
(errors.py), the tables' columns as Arrow schemas (columns.py), Spark DDL (ddl.py), table
locations (storage.py), which option values may be shown (redaction.py), options naming local
files (clientfiles.py), the "did you mean" of errors (suggest.py), the phase stopwatch
(stopwatch.py) and the test-only crash points product code reaches (crashpoints.py). It imports
nothing of oncemore.
"""
