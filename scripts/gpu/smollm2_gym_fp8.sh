#!/usr/bin/env bash
# Issue 35's accuracy check: the SmolLM2 gym run (configs/grpo_smollm2_gym.py, 60 steps) with a
# bf16 rollout and with an fp8 one (rollout.quantization=fp8; token-level TIS on by default), each
# with every seed in SEEDS, on one GPU; prints a JSON summary of the runs (scripts/summarize_runs.py:
# held-out accuracy, step times). Needs the model folder (scripts/fetch_smollm2.py /tmp/smollm2)
# and the gym extra. MODES picks the rollouts (split a long comparison over several calls):
#   STEPS=60 SEEDS="0 1" MODES="bf16 fp8" OUT=/tmp/out bash scripts/gpu/smollm2_gym_fp8.sh
#   MODES=fp8_kv ...   # fp8 weights and an fp8 KV cache (rollout.kv_cache_dtype=fp8)
#   CONFIG=configs/grpo_smollm2_gym.py:cpu STEPS=2 SEEDS=0 ...   # a CPU smoke run
set -e
CONFIG=${CONFIG:-configs/grpo_smollm2_gym.py}
STEPS=${STEPS:-60}
SEEDS=${SEEDS:-0 1}
MODES=${MODES:-bf16 fp8}
OUT=${OUT:-/tmp/gym_fp8}
mkdir -p "$OUT"
files=()
for mode in $MODES; do
  case "$mode" in
    bf16) extra=() ;;
    fp8) extra=(--config.rollout.quantization=fp8) ;;
    fp8_kv) extra=(--config.rollout.quantization=fp8 --config.rollout.kv_cache_dtype=fp8) ;;
    *) echo "unknown mode $mode (bf16 | fp8 | fp8_kv)" >&2; exit 2 ;;
  esac
  for seed in $SEEDS; do
    run=/tmp/run_${mode}_s$seed
    python -m jaxrl_llm.train --config="$CONFIG" --config.model.path=/tmp/smollm2 \
      --config.trainer.total_training_steps="$STEPS" --config.trainer.test_freq="${TEST_FREQ:-20}" \
      --config.trainer.seed="$seed" --config.trainer.default_local_dir="$run" "${extra[@]}" \
      > "$OUT/gym_${mode}_s$seed.log" 2>&1 || tail -30 "$OUT/gym_${mode}_s$seed.log"
    cp "$(find "$run" -name metrics.jsonl | head -1)" "$OUT/gym_${mode}_s$seed.metrics.jsonl"
    files+=("$OUT/gym_${mode}_s$seed.metrics.jsonl")
  done
done
python scripts/summarize_runs.py "${files[@]}"
