"""The device rules: probe the host, assign a plan, lock its cards (see gpuflow/tasks/__init__.py)."""
