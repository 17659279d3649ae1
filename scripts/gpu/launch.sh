#!/usr/bin/env bash
# Launch jaxrl-llm on GPU hosts: over ssh from a host list, or by submitting scripts/gpu/slurm.sbatch.
#
#   scripts/gpu/launch.sh ssh   --hosts=gpu1,gpu2 [--port=12345] [--dry-run] -- --config=configs/grpo_gsm8k.py ...
#   scripts/gpu/launch.sh ssh   --hostfile=hosts.txt ...          (one host per line, # comments)
#   scripts/gpu/launch.sh stop  --hosts=gpu1,gpu2                 (kill the runs `ssh` started, by pid)
#   scripts/gpu/launch.sh slurm --nodes=4 [--tasks-per=node|gpu] [--dry-run] -- --config=configs/grpo_gsm8k.py ...
#
# ssh: host i runs `python3 -m jaxrl_llm.train --coordinator_address=HOST0:PORT --num_processes=N
#   --process_id=i <training flags>` in --repo-dir (same path on every host: a shared filesystem or
#   a copy; default: this checkout's path), logging to <repo-dir>/jaxrl_run.<i>.log and recording its
#   pid in <repo-dir>/jaxrl_run.<i>.pid. The first host is the coordinator; every host must reach it
#   on --port.
# stop: on each host, kills the processes whose pids `ssh` recorded (if they still run jaxrl_llm.train)
#   and removes the pid files; other users' runs are never touched.
# slurm: `sbatch --nodes=N scripts/gpu/slurm.sbatch <training flags>` (one task per node or per GPU).
# Options: --python=python3, --gpus-per-node=8 (slurm), -h/--help, --dry-run (print, run nothing).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY_RUN=0; HOSTS=""; HOSTFILE=""; PORT=12345; PYTHON=python3; NODES=""; TASKS_PER=node; GPUS_PER_NODE=8
COMMAND=""; TRAIN=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --hosts=*) HOSTS="${1#*=}" ;;
    --hostfile=*) HOSTFILE="${1#*=}" ;;
    --port=*) PORT="${1#*=}" ;;
    --python=*) PYTHON="${1#*=}" ;;
    --repo-dir=*) REPO_DIR="${1#*=}" ;;
    --nodes=*) NODES="${1#*=}" ;;
    --tasks-per=*) TASKS_PER="${1#*=}" ;;
    --gpus-per-node=*) GPUS_PER_NODE="${1#*=}" ;;
    --) shift; TRAIN=("$@"); break ;;
    -*) echo "launch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [[ -z "$COMMAND" ]] || { echo "launch.sh: one command only" >&2; exit 2; }; COMMAND="$1" ;;
  esac
  shift
done

q() { if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi; }
run() { local line="+" a; for a in "$@"; do line+=" $(q "$a")"; done; echo "$line"; if [[ $DRY_RUN == 0 ]]; then "$@"; fi; }

host_list() {
  local hosts=()
  if [[ -n "$HOSTFILE" ]]; then
    [[ -f "$HOSTFILE" ]] || { echo "launch.sh: hostfile '$HOSTFILE' not found" >&2; exit 2; }
    while read -r line; do line="${line%%#*}"; line="${line// /}"; [[ -n "$line" ]] && hosts+=("$line"); done < "$HOSTFILE"
  elif [[ -n "$HOSTS" ]]; then IFS=',' read -r -a hosts <<< "$HOSTS"
  fi
  [[ ${#hosts[@]} -gt 0 ]] || { echo "launch.sh: give --hosts=a,b or --hostfile=FILE" >&2; exit 2; }
  echo "${hosts[@]}"
}

need_train_flags() {
  [[ ${#TRAIN[@]} -gt 0 ]] || { echo "launch.sh: pass the training flags after --, at least --config=FILE, e.g. --config=configs/grpo_gsm8k.py" >&2; exit 2; }
}

case "$COMMAND" in
  ssh)
    need_train_flags
    HS=$(host_list); read -r -a H <<< "$HS"
    n=${#H[@]}
    for i in "${!H[@]}"; do
      cmd="cd $(q "$REPO_DIR") && nohup $PYTHON -m jaxrl_llm.train --coordinator_address=${H[0]}:$PORT --num_processes=$n --process_id=$i"
      for a in "${TRAIN[@]}"; do cmd+=" $(q "$a")"; done
      cmd+=" --config.trainer.backend=local > jaxrl_run.$i.log 2>&1 & echo \$! > jaxrl_run.$i.pid"
      run ssh "${H[$i]}" "$cmd"
    done
    ;;
  stop)
    HS=$(host_list); read -r -a H <<< "$HS"
    stop_cmd="cd $(q "$REPO_DIR") && for f in jaxrl_run.*.pid; do [ -f \"\$f\" ] || continue; p=\$(cat \"\$f\");"
    stop_cmd+=" ps -ww -p \"\$p\" -o args= | grep -q jaxrl_llm.train && kill \"\$p\"; rm -f \"\$f\"; done; true"
    for h in "${H[@]}"; do run ssh "$h" "$stop_cmd"; done
    ;;
  slurm)
    need_train_flags
    [[ -n "$NODES" ]] || { echo "launch.sh: slurm needs --nodes=N" >&2; exit 2; }
    case "$TASKS_PER" in node|gpu) ;; *) echo "launch.sh: --tasks-per must be node or gpu" >&2; exit 2 ;; esac
    ntasks=1; [[ $TASKS_PER == gpu ]] && ntasks=$GPUS_PER_NODE
    run env TASKS_PER="$TASKS_PER" GPUS_PER_NODE="$GPUS_PER_NODE" PYTHON="$PYTHON" REPO_DIR="$REPO_DIR" \
      sbatch --nodes="$NODES" --ntasks-per-node="$ntasks" --gpus-per-node="$GPUS_PER_NODE" \
      "$REPO_DIR/scripts/gpu/slurm.sbatch" "${TRAIN[@]}"
    ;;
  "") echo "launch.sh: give a command: ssh, stop or slurm (see --help)" >&2; exit 2 ;;
  *) echo "launch.sh: unknown command '$COMMAND' (see --help)" >&2; exit 2 ;;
esac
