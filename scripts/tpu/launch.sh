#!/usr/bin/env bash
# Launch jaxrl-llm on a Cloud TPU VM slice (single host or pod), driven by a config file.
#
#   scripts/tpu/launch.sh -c my-slice.env [--dry-run] COMMAND [-- --config.a.b=v ...]
#   (my-slice.env: your copy of scripts/tpu/example.env, edited for your slice)
#
# Commands (run in this order, or `up` for create+setup+run+logs):
#   check    compile the run's programs for TOPOLOGY here, on this machine (no TPU needed;
#            scripts/tpu/aot_compile.py, needs libtpu) and fail if one does not fit in HBM
#   create   gcloud compute tpus tpu-vm create (or `queued-resources create` when QUEUED=1)
#   setup    copy this working tree to every worker (--worker=all) and pip-install it
#   run      start the same training command on every worker (jax.distributed auto-detects the pod)
#   logs     stream worker 0's log (LOG_WORKER=all|N to pick others)
#   stop     kill the training process on every worker
#   delete   delete the TPU VM (and the queued resource)
#   up       create, setup, run, logs
#
# Options: -c/--config-file FILE (required), --dry-run (print every command, run nothing),
#          --check (run `check` first; a config that cannot fit stops before anything is booked),
#          -h/--help. Anything after `--` is appended to the training command (config overrides).
#
# The config file is a bash file of KEY=VALUE lines (see scripts/tpu/example.env):
#   TPU_NAME PROJECT ZONE ACCELERATOR_TYPE RUNTIME_VERSION   the slice
#   QUEUED=0|1  SPOT=0|1                                      queued resource / spot capacity
#   CONFIG        training config, e.g. configs/grpo_gsm8k.py
#   OVERRIDES     extra `--config.x=y` flags (space separated)
#   REMOTE_DIR    where the code goes on the workers (default: jaxrl_llm, under $HOME)
#   PIP_EXTRAS    pip extras to install (default: tpu)
#   RUN_LOG       log file on each worker (default: jaxrl_run.log)
#   TOPOLOGY      the slice for `check`, e.g. v5p:2x2x2 (v5p-16), v5e:2x4 (v5e-8), v6e:4x4
#   AOT_MODEL     architecture preset for `check` (e.g. qwen2.5-7b) when model.path is a worker path
#   PYTHON        local python for `check` (default: python3)
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

DRY_RUN=0
CHECK=0
CONFIG_FILE=""
COMMAND=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --check) CHECK=1; shift ;;
    -c|--config-file) CONFIG_FILE="$2"; shift 2 ;;
    --config-file=*) CONFIG_FILE="${1#*=}"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) echo "launch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) if [[ -n "$COMMAND" ]]; then echo "launch.sh: one command only, got '$COMMAND' and '$1'" >&2; exit 2; fi
       COMMAND="$1"; shift ;;
  esac
done
[[ -n "$COMMAND" ]] || { echo "launch.sh: give a command (see --help)" >&2; exit 2; }
[[ -n "$CONFIG_FILE" ]] || { echo "launch.sh: -c/--config-file is required (see scripts/tpu/example.env)" >&2; exit 2; }
[[ -f "$CONFIG_FILE" ]] || { echo "launch.sh: config file '$CONFIG_FILE' not found" >&2; exit 2; }

QUEUED=0; SPOT=0; REMOTE_DIR=jaxrl_llm; PIP_EXTRAS=tpu; RUN_LOG=jaxrl_run.log; OVERRIDES=""
RUNTIME_VERSION=""; LOG_WORKER=0; TOPOLOGY=""; AOT_MODEL=""; PYTHON=python3
# shellcheck disable=SC1090
source "$CONFIG_FILE"
for key in TPU_NAME PROJECT ZONE ACCELERATOR_TYPE RUNTIME_VERSION CONFIG; do
  [[ -n "${!key:-}" ]] || { echo "launch.sh: $key is not set in $CONFIG_FILE" >&2; exit 2; }
done

q() {  # one word, quoted for a POSIX shell only when it needs it
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

run() {  # prints the command (shell-quoted, copy-pastable); runs it unless --dry-run
  local line="+" a; for a in "$@"; do line+=" $(q "$a")"; done
  echo "$line"
  if [[ $DRY_RUN == 0 ]]; then "$@"; fi
}

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TARBALL="/tmp/${TPU_NAME}-jaxrl_llm.tar.gz"
WHERE=(--project="$PROJECT" --zone="$ZONE")
SSH_ALL=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${WHERE[@]}" --worker=all)

train_command() {
  # The same command on every worker. JAXRL_DISTRIBUTED=auto lets jax.distributed detect the
  # slice (coordinator, process count and id) from the TPU metadata.
  local cmd="cd ~/$REMOTE_DIR && JAXRL_DISTRIBUTED=auto python3 -m jaxrl_llm.train --config=$CONFIG --config.trainer.backend=local"
  local o
  for o in $OVERRIDES "${EXTRA[@]}"; do cmd+=" $(q "$o")"; done
  echo "$cmd"
}

do_check() {  # ahead-of-time compile for the slice, here; exits non-zero when it does not fit
  [[ -n "$TOPOLOGY" ]] || { echo "launch.sh: check needs TOPOLOGY (e.g. v5p:2x2x2) in $CONFIG_FILE" >&2; exit 2; }
  local cmd=("$PYTHON" "$REPO_ROOT/scripts/tpu/aot_compile.py" --topology="$TOPOLOGY" --config="$CONFIG"
             --check --no-cost --out="/tmp/${TPU_NAME}-aot.json")
  [[ -n "$AOT_MODEL" ]] && cmd+=(--model="$AOT_MODEL")
  local o
  for o in $OVERRIDES "${EXTRA[@]}"; do cmd+=("$o"); done
  run "${cmd[@]}"
}

do_create() {
  local spot=(); [[ $SPOT == 1 ]] && spot=(--spot)
  if [[ $QUEUED == 1 ]]; then
    run gcloud compute tpus queued-resources create "${TPU_NAME}-qr" --node-id="$TPU_NAME" "${WHERE[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" "${spot[@]}"
    # wait until the slice is provisioned
    local state_cmd=(gcloud compute tpus queued-resources describe "${TPU_NAME}-qr" "${WHERE[@]}" --format='value(state.state)')
    if [[ $DRY_RUN == 1 ]]; then run "${state_cmd[@]}"; return; fi
    until [[ "$(run "${state_cmd[@]}" | tail -n 1)" == ACTIVE ]]; do sleep 30; done
  else
    run gcloud compute tpus tpu-vm create "$TPU_NAME" "${WHERE[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${spot[@]}"
  fi
}

do_setup() {
  run tar -C "$REPO_ROOT" --exclude=.git --exclude=runs --exclude='*.egg-info' -czf "$TARBALL" .
  run gcloud compute tpus tpu-vm scp "$TARBALL" "$TPU_NAME:~/jaxrl_llm.tar.gz" "${WHERE[@]}" --worker=all
  run "${SSH_ALL[@]}" --command="mkdir -p ~/$REMOTE_DIR && tar -xzf ~/jaxrl_llm.tar.gz -C ~/$REMOTE_DIR && cd ~/$REMOTE_DIR && python3 -m pip install -q -e \".[$PIP_EXTRAS]\""
}

do_run() {
  run "${SSH_ALL[@]}" --command="nohup bash -c $(q "$(train_command)") > ~/$RUN_LOG 2>&1 &"
}

do_logs() {
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${WHERE[@]}" --worker="$LOG_WORKER" --command="tail -n +1 -F ~/$RUN_LOG"
}

do_stop() {
  run "${SSH_ALL[@]}" --command="pkill -f 'jaxrl_llm.train' || true"
}

do_delete() {
  if [[ $QUEUED == 1 ]]; then
    run gcloud compute tpus queued-resources delete "${TPU_NAME}-qr" "${WHERE[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${WHERE[@]}" --quiet
  fi
}

if [[ $CHECK == 1 && "$COMMAND" != check ]]; then do_check; fi
case "$COMMAND" in
  check) do_check ;;
  create) do_create ;;
  setup) do_setup ;;
  run) do_run ;;
  logs) do_logs ;;
  stop) do_stop ;;
  delete) do_delete ;;
  up) do_create; do_setup; do_run; do_logs ;;
  *) echo "launch.sh: unknown command '$COMMAND' (see --help)" >&2; exit 2 ;;
esac
