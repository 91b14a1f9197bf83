# The README's commands. Each creates .venv on first use.
PY      := .venv/bin/python
VENV_OK := .venv/.installed
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
# Addresses are gpuflow settings (127.0.0.1:4200 for Prefect, :5000 for MLflow); change them
# with GPUFLOW_PREFECT_HOST / _PORT and GPUFLOW_MLFLOW_HOST / _PORT (flows/settings.py).

.PHONY: run test test-fast probe server serve ui bench clean

$(VENV_OK): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(VENV_OK)

run: $(VENV_OK)          ## the main job: the training pipeline flow on its defaults
	.venv/bin/gpuflow run $(ARGS)

test: $(VENV_OK)         ## the test suite (CPU; gpu-marked tests skip without CUDA), modules on 2 workers
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: $(VENV_OK)    ## the pure parts only (parameters, space, devices, rules), under a minute
	$(PY) -m pytest -m fast $(PYTEST_ARGS)

probe: $(VENV_OK)        ## print what this machine offers for training
	.venv/bin/gpuflow probe

server: $(VENV_OK)       ## a Prefect server on 127.0.0.1:4200
	.venv/bin/gpuflow server

serve: $(VENV_OK)        ## serve the deployments (needs `make server` in another terminal)
	.venv/bin/gpuflow serve

ui: $(VENV_OK)           ## the MLflow UI on 127.0.0.1:5000 over ./mlflow.db
	.venv/bin/gpuflow ui

bench: $(VENV_OK)        ## CPU benchmarks, results in bench/RESULTS.md
	$(PY) -m pip install -q -e '.[bench]'  # the Lightning comparison (a bench extra only)
	$(PY) -m bench.run_all $(ARGS)

clean:
	rm -rf runs checkpoints bench/out
