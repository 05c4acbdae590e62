"""The stages wired together on Spark: a run (runner.py) plans, prepares how records are
decoded and the tables that take them, and per part of a batch runs a Spark job (jobs.py) whose
tasks read, decode and write (tasks.py, through kafkasource.py's reads and the sink of
deltasink.py), then commits it; what it did (runreport.py); the session (session.py) and what
keeps it warm (connectslots.py, classarchive.py, workerdaemon.py, workermemory.py).
"""
