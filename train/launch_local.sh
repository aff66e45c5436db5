#!/usr/bin/env bash
# Starts N training processes on this machine (a multi-host run in miniature, gloo collectives).
#   bash train/launch_local.sh 2 --config configs/tiny.yaml --set train.steps=3
set -euo pipefail
n=${1:?usage: launch_local.sh NUM_PROCESSES ARGS...}; shift
port=${PORT:-$((20000 + RANDOM % 10000))}
pids=()
for ((i = 0; i < n; i++)); do
  python -m train.main --num-processes "$n" --process-id "$i" --coordinator "127.0.0.1:$port" \
    --no-progress "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
