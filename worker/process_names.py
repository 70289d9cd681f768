"""The local stack's processes by name: each one's pid file (run/NAME.pid), log
(logs/NAME.log) and metrics address (run/NAME.metrics) are named so. Its own module, so a node
agent learns them without importing the stack's machinery."""

TEMPORAL, MLFLOW, CONTROL, API = "temporal", "mlflow", "control-worker", "api"
REPLICATOR = "replicator"  # only with a twin site (twin_store_url)
NODE_PREFIX = "node-"
DATA_PREFIX = "data-"
