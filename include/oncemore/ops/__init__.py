"""Deliberate operations on a pipeline's tables: reset (positions moved, the move recorded), delete
(rows removed by a predicate, what was removed recorded), maintain (compaction, checkpoints,
vacuum), and check, the preflight of a pipeline before its first run.
"""
