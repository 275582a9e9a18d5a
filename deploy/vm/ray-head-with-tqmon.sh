#!/usr/bin/env bash
# Start a Ray head and tqmon next to it, on a VM or as the head step of a Slurm job
# (`srun --nodes=1 --ntasks=1 -w "$head_node" deploy/vm/ray-head-with-tqmon.sh &`, see docs/deploy.md).
# tqmon follows the drivers' logs of this head's session, reads the checkpoints, watches the live
# TransferQueue and announces itself to Prometheus through a file_sd file in a shared directory.
# Stop with SIGTERM: tqmon removes its file_sd target, then the Ray head is stopped.
set -euo pipefail

RAY_PORT=${RAY_PORT:-6379}
RAY_TEMP_DIR=${RAY_TEMP_DIR:-/tmp/ray}
TQMON_HOST=${TQMON_HOST:-0.0.0.0}
TQMON_PORT=${TQMON_PORT:-9842}
FILE_SD_DIR=${FILE_SD_DIR:?set FILE_SD_DIR to the directory your Prometheus file_sd job reads}
: "${TQMON_TOKEN:?set TQMON_TOKEN (the verl event poster uses the same token)}"
export TQMON_TOKEN

ray start --head --port="$RAY_PORT" --temp-dir="$RAY_TEMP_DIR" --block "$@" &
ray_pid=$!

args=(serve --listen "$TQMON_HOST:$TQMON_PORT" --state-dir "${TQMON_STATE_DIR:-$HOME/.local/state/tqmon}"
  --log "$RAY_TEMP_DIR/session_latest/logs/job-driver-*.log"
  --file-sd "$FILE_SD_DIR/tqmon-$(hostname)-${SLURM_JOB_ID:-vm}.json")
if [[ -n ${CHECKPOINT_DIR:-} ]]; then args+=(--checkpoint-dir "$CHECKPOINT_DIR"); fi
if [[ ${TQMON_LIVE_TQ:-1} == 1 ]]; then args+=(--ray-address "127.0.0.1:$RAY_PORT"); fi
tqmon "${args[@]}" &
tqmon_pid=$!

stop() {
  kill -TERM "$tqmon_pid" 2>/dev/null || true
  wait "$tqmon_pid" || true
  kill -TERM "$ray_pid" 2>/dev/null || true
  wait "$ray_pid" || true
}
trap stop TERM INT
wait -n "$ray_pid" "$tqmon_pid" || true
stop
