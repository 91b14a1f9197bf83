# The README's commands. Each creates .venv on first use.
PY      := .venv/bin/python
VENV_OK := .venv/.installed
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
HOST    ?= 127.0.0.1

.PHONY: run test probe server serve ui bench clean

$(VENV_OK): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(VENV_OK)

run: $(VENV_OK)          ## the main job: the training pipeline flow on its defaults
	.venv/bin/gpuflow run $(ARGS)

test: $(VENV_OK)         ## the test suite (CPU; gpu-marked tests skip without CUDA)
	$(PY) -m pytest $(PYTEST_ARGS)

probe: $(VENV_OK)        ## print what this machine offers for training
	.venv/bin/gpuflow probe

server: $(VENV_OK)       ## a Prefect server on 127.0.0.1:4200
	.venv/bin/prefect server start --host $(HOST) --port 4200

serve: $(VENV_OK)        ## serve the deployments (needs `make server` in another terminal)
	PREFECT_API_URL=http://$(HOST):4200/api $(PY) -m gpuflow.flows.serve

ui: $(VENV_OK)           ## the MLflow UI on 127.0.0.1:5000 over mlflow.db
	.venv/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host $(HOST) --port 5000

bench: $(VENV_OK)        ## CPU benchmarks, results in bench/RESULTS.md
	$(PY) -m pip install -q -e '.[bench]'  # the Lightning comparison (a bench extra only)
	$(PY) -m bench.run_all $(ARGS)

clean:
	rm -rf runs checkpoints bench/out
