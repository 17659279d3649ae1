#!/usr/bin/env bash
# The SmolLM2 gym run (configs/grpo_smollm2_gym.py) padded, then packed, on one GPU; prints a
# JSON summary of both (scripts/summarize_runs.py). docs/benchmarks.md, "Packing on the SmolLM2
# gym workload". Needs the model folder (scripts/fetch_smollm2.py /tmp/smollm2) and the gym extra.
#   STEPS=40 OUT=/tmp/out bash scripts/gpu/smollm2_gym_packing.sh
set -e
STEPS=${STEPS:-40}
OUT=${OUT:-/tmp/gym_packing}
mkdir -p "$OUT"
for mode in padded packed; do
  extra=()
  [ "$mode" = packed ] && extra=(--config.model.use_remove_padding=True --config.actor.use_dynamic_bsz=True
                                 --config.actor.ppo_max_token_len_per_device=49152)
  python -m jaxrl_llm.train --config=configs/grpo_smollm2_gym.py --config.model.path=/tmp/smollm2 \
    --config.trainer.total_training_steps="$STEPS" --config.trainer.test_freq=20 \
    --config.trainer.default_local_dir=/tmp/run_$mode "${extra[@]}" > "$OUT/gym_$mode.log" 2>&1 \
    || tail -30 "$OUT/gym_$mode.log"
  cp "$(find /tmp/run_$mode -name metrics.jsonl | head -1)" "$OUT/gym_$mode.metrics.jsonl"
done
python scripts/summarize_runs.py "$OUT/gym_padded.metrics.jsonl" "$OUT/gym_packed.metrics.jsonl"
