"""MLflow tracking and registry: runs, model versions with lineage, aliases, approval records."""
