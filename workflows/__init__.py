"""Deterministic Temporal workflows, the scheduling policy, and the models that cross the wire.

Nothing here does I/O or imports torch, mlflow, duckdb or boto3: workflow code is replayed.
"""
