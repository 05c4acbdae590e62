"""The Delta commits: a part's files validated and committed with the new positions, the
quarantine table's commit first (part.py, committer.py), from the tasks' RangeResults
(inputs.py); the tables made ready and what of them oncemore can write (tables.py,
tablefeatures.py, evolution.py); the committed positions mirrored to a consumer group
(groupmirror.py).
"""
