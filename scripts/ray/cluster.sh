#!/usr/bin/env bash
# Start a Ray cluster for jaxrl-llm (one node per training host) and submit the trainer as a Ray job.
#
#   scripts/ray/cluster.sh head    [--accelerator=gpu|tpu|cpu] [--gpus-per-host=8] [--ray-port=6379]
#   scripts/ray/cluster.sh worker  --head=HEAD_IP [--accelerator=...]    (run on every other host)
#   scripts/ray/cluster.sh up      --hosts=h0,h1,... [--accelerator=...]  (head on h0, workers on the rest, over ssh)
#   scripts/ray/cluster.sh submit  --head=HEAD_IP --num-hosts=N -- --config=configs/grpo_gsm8k.py [--config.a=b ...]
#   scripts/ray/cluster.sh status  --head=HEAD_IP
#   scripts/ray/cluster.sh down    [--hosts=h0,h1,...]                    (ray stop here, or on every host)
#
# Every node gets the custom resource {"jaxrl_host": 1}: the trainer's Ray backend places exactly one
# HostWorker actor on each such node; the actors call jax.distributed.initialize (coordinator: a free
# port on actor 0's node) before touching devices. GPUs are declared with --num-gpus; TPU chips are
# detected by Ray on TPU VMs (resource "TPU"). `submit` runs the trainer once as the single
# controller (`ray job submit --working-dir=<repo>`, backend=ray, --num_hosts=N).
# Options: --dashboard-port=8265, --python=python3, --repo-dir=<this checkout>, --dry-run (print
# every command, run nothing), -h/--help.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY_RUN=0; ACCEL=gpu; GPUS=8; RAY_PORT=6379; DASH_PORT=8265; HEAD=""; HOSTS=""; NUM_HOSTS=""; PYTHON=python3
COMMAND=""; TRAIN=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --accelerator=*) ACCEL="${1#*=}" ;;
    --gpus-per-host=*) GPUS="${1#*=}" ;;
    --ray-port=*) RAY_PORT="${1#*=}" ;;
    --dashboard-port=*) DASH_PORT="${1#*=}" ;;
    --head=*) HEAD="${1#*=}" ;;
    --hosts=*) HOSTS="${1#*=}" ;;
    --num-hosts=*) NUM_HOSTS="${1#*=}" ;;
    --python=*) PYTHON="${1#*=}" ;;
    --repo-dir=*) REPO_DIR="${1#*=}" ;;
    --) shift; TRAIN=("$@"); break ;;
    -*) echo "cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [[ -z "$COMMAND" ]] || { echo "cluster.sh: one command only" >&2; exit 2; }; COMMAND="$1" ;;
  esac
  shift
done

q() { if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi; }
run() { local line="+" a; for a in "$@"; do line+=" $(q "$a")"; done; echo "$line"; if [[ $DRY_RUN == 0 ]]; then "$@"; fi; }
words() { local out="" a; for a in "$@"; do out+="$(q "$a") "; done; echo "${out% }"; }

case "$ACCEL" in
  gpu) RES=(--resources='{"jaxrl_host": 1}' --num-gpus="$GPUS") ;;
  tpu|cpu) RES=(--resources='{"jaxrl_host": 1}') ;;
  *) echo "cluster.sh: --accelerator must be gpu, tpu or cpu, got '$ACCEL'" >&2; exit 2 ;;
esac
HEAD_CMD=(ray start --head --port="$RAY_PORT" --dashboard-host=0.0.0.0 --dashboard-port="$DASH_PORT" "${RES[@]}")
need() { [[ -n "${!1}" ]] || { echo "cluster.sh: $COMMAND needs --$2" >&2; exit 2; }; }

case "$COMMAND" in
  head) run "${HEAD_CMD[@]}" ;;
  worker) need HEAD head; run ray start --address="$HEAD:$RAY_PORT" "${RES[@]}" ;;
  up)
    need HOSTS hosts
    IFS=',' read -r -a H <<< "$HOSTS"
    run ssh "${H[0]}" "$(words "${HEAD_CMD[@]}")"
    for h in "${H[@]:1}"; do run ssh "$h" "$(words ray start --address="${H[0]}:$RAY_PORT" "${RES[@]}")"; done
    ;;
  submit)
    need HEAD head; need NUM_HOSTS num-hosts
    [[ ${#TRAIN[@]} -gt 0 ]] || { echo "cluster.sh: pass the training flags after --, at least --config=FILE, e.g. --config=configs/grpo_gsm8k.py" >&2; exit 2; }
    run ray job submit --address="http://$HEAD:$DASH_PORT" --working-dir="$REPO_DIR" \
      --runtime-env-json='{"excludes": [".git", "runs", "*.egg-info"]}' -- \
      "$PYTHON" -m jaxrl_llm.train "${TRAIN[@]}" --config.trainer.backend=ray --num_hosts="$NUM_HOSTS"
    ;;
  status) need HEAD head; run ray status --address="$HEAD:$RAY_PORT" ;;
  down)
    if [[ -n "$HOSTS" ]]; then
      IFS=',' read -r -a H <<< "$HOSTS"
      for h in "${H[@]}"; do run ssh "$h" "ray stop"; done
    else run ray stop; fi
    ;;
  "") echo "cluster.sh: give a command: head, worker, up, submit, status or down (see --help)" >&2; exit 2 ;;
  *) echo "cluster.sh: unknown command '$COMMAND' (see --help)" >&2; exit 2 ;;
esac
