#!/usr/bin/env bash
# Issue 34's GPU measurement: the SmolLM2 gym run (configs/grpo_smollm2_gym.py, bf16) with the
# old-log-prob pass always on, three ways, on one GPU; prints a JSON summary of the runs
# (scripts/summarize_runs.py: rollout/logprob_abs_diff/{max,mean} per step, every stage's time):
#   fast      the trainer's forward as the pass, rollout.batch_invariant off (the default path)
#   invariant the trainer's forward, rollout.batch_invariant on
#   engine    actor.old_log_prob_pass=engine (the engine's own programs replay each response),
#             rollout.batch_invariant on: logprob_abs_diff/max should be 0 at every step
# Needs the model folder (scripts/fetch_smollm2.py /tmp/smollm2) and the gym extra.
#   STEPS=20 MODES="fast invariant engine" OUT=/tmp/out bash scripts/gpu/smollm2_gym_logprob.sh
#   CONFIG=configs/grpo_smollm2_gym.py:cpu STEPS=2 ...   # a CPU smoke run
set -e
CONFIG=${CONFIG:-configs/grpo_smollm2_gym.py}
STEPS=${STEPS:-20}
MODES=${MODES:-fast invariant engine}
OUT=${OUT:-/tmp/gym_logprob}
mkdir -p "$OUT"
files=()
for mode in $MODES; do
  case "$mode" in
    fast) extra=() ;;
    invariant) extra=(--config.rollout.batch_invariant=True) ;;
    engine) extra=(--config.rollout.batch_invariant=True --config.actor.old_log_prob_pass=engine) ;;
    *) echo "unknown mode $mode (fast | invariant | engine)" >&2; exit 2 ;;
  esac
  run=/tmp/run_logprob_$mode
  python -m jaxrl_llm.train --config="$CONFIG" --config.model.path=/tmp/smollm2 \
    --config.trainer.total_training_steps="$STEPS" --config.trainer.test_freq="${TEST_FREQ:-0}" \
    --config.trainer.val_before_train=False --config.actor.skip_redundant_old_log_prob=False \
    --config.trainer.default_local_dir="$run" "${extra[@]}" > "$OUT/gym_logprob_$mode.log" 2>&1 \
    || tail -30 "$OUT/gym_logprob_$mode.log"
  cp "$(find "$run" -name metrics.jsonl | head -1)" "$OUT/gym_logprob_$mode.metrics.jsonl"
  files+=("$OUT/gym_logprob_$mode.metrics.jsonl")
done
python scripts/summarize_runs.py "${files[@]}"
