#!/usr/bin/env bash
# The GPU checks, run on a lent GPU machine (the device tool), where python3 is 3.12 with
# its own torch and nothing can be downloaded. Our other packages travel as Python 3.12 wheels in .whl/
# (how to fill it: bench/NOTES.md, "GPU"; asyncpg is needed: the Prefect server imports it). Logs and the
# benchmark's tables land in $OUT. The order: FIRST (tests not yet run on a GPU), the benchmark, the other
# `gpu` tests. Two calls fit a 15-minute lease, the second on the still-warm machine:
#   REST=0 bash bench/gpu_lease.sh      FIRST, then python -m bench.gpu --write (~35 s per pair of runs, 6 pairs)
#   FIRST= BENCH=0 bash bench/gpu_lease.sh   the other CUDA tests (~6 min on an H100, 86 s of it the first
#                                       Prefect server on a fresh install)
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
SITE=/tmp/gf/site-packages  # a "site-packages" folder, so the allowlist sees installed code as it would
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
    .whl/*.whl || exit 1
for p in flows tasks training; do rm -rf $SITE/gpuflow/$p; ln -s "$PWD/$p" $SITE/gpuflow/$p; done  # this tree, live
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 PATH=$SITE/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/smi.txt"
python3 -c "import torch, prefect, mlflow, optuna; print(torch.__version__, torch.cuda.is_available(),
    prefect.__version__, mlflow.__version__, optuna.__version__)" 2>&1 | tee -a "$OUT/smi.txt"
# tests never run on a GPU: the sync-free gather (after the change it checks was made, 2026-11-27)
FIRST=${FIRST-tests/test_gpu.py::test_a_batch_of_data_held_on_the_gpu_is_gathered_without_a_host_sync}
[ -n "$FIRST" ] && timeout ${FIRST_S:-170} python3 -m pytest -p no:cacheprovider -o timeout=${TEST_TIMEOUT:-150} -q \
    $FIRST 2>&1 | tee "$OUT/pytest_first.log"
[ "${BENCH:-1}" = 1 ] && timeout ${BENCH_S:-280} python3 -m bench.gpu --write ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
[ "${REST:-1}" = 1 ] && timeout ${REST_S:-330} python3 -m pytest -p no:cacheprovider -o timeout=300 -q -m gpu \
    $(for t in $FIRST; do echo --deselect "$t"; done) ${REST_ARGS:-} 2>&1 | tee "$OUT/pytest_rest.log"
cp bench/RESULTS_GPU.md bench/RESULTS_GPU.json "$OUT/" 2>/dev/null
true
