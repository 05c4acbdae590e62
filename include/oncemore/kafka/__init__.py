"""Kafka as oncemore talks to it: a pipeline's clients and the log's facts (offsets by
time, log bounds, topic identities) with the one loop that reads a range (clients.py), one admin
client and its lookups per cluster for pipelines read together (cluster.py), how the clients are
made and what Kafka may refuse them, said (access.py), and a range read into bounded Arrow batches
(batches.py). Below the plan: planning asks the log where ranges may start and end.
"""
