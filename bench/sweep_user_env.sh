#!/usr/bin/env bash
# A sweep as a user starts it on a CPU host, with no OMP_NUM_THREADS of its own (bench.sweep sets it to 1 for
# every arm, which hid #37's thread contention): 4 trials of 50 digits epochs, 2 at a time. Run it on two
# checkouts one after the other (e.g. `git stash`) and compare the walls. PARALLEL=1: one trial at a time;
# MODEL, EPOCHS and TRIALS change the job (e.g. MODEL=cnn EPOCHS=10 TRIALS=2 PARALLEL=1).
# gpuflow sweep as a user runs it on a 2-core CPU host: no OMP_NUM_THREADS in the environment
here=$(cd "$(dirname "$0")/.." && pwd); d=$(mktemp -d); cd "$d"
printf "lr: {type: float, low: 0.001, high: 0.01, log: true}\n" > space.yaml
unset OMP_NUM_THREADS
s=$(date +%s.%N)
"$here/.venv/bin/gpuflow" sweep --space space.yaml --trials ${TRIALS:-4} --parallel ${PARALLEL:-2} --gpus cpu --model ${MODEL:-mlp} --dataset digits --epochs ${EPOCHS:-50} --pruner none > out.json 2> err.log
rc=$?
e=$(date +%s.%N)
python3 -c "print('rc $rc wall %.1f s' % ($e - $s))"
python3 -c "
import json,glob; print('train_time_s per trial', sorted(round(json.load(open(f))['train_time_s'],1) for f in glob.glob('runs/*/result.json')))"
rm -rf $d
