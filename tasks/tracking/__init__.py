"""MLflow: the store, the run a flow owns, results, the registry (see gpuflow/tasks/__init__.py)."""
