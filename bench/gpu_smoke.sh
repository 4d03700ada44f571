#!/usr/bin/env bash
# The vLLM backend on a lent GPU machine, in well under five minutes: a fresh built-in policy, then
# SmolLM2-135M-Instruct when its folder is present (`crucible models add smollm2-135m`, carried to
# the machine as MODEL_DIR). Each run samples, checks vLLM's log-probs against the learner's at the
# same temperature and top_p, and hot-swaps weights. Needs `pip install vllm` on that machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
timeout 150 python bench/bench_vllm.py --prompts 64 --group 4 --max-tokens 32
MODEL_DIR=${MODEL_DIR:-${CRUCIBLE_HOME:-$HOME/.cache/crucible}/models/smollm2-135m}
if [ -f "$MODEL_DIR/config.json" ]; then
  timeout 150 python bench/bench_vllm.py --prompts 64 --group 4 --max-tokens 32 --model "$MODEL_DIR"
else
  echo "no $MODEL_DIR: skipping the SmolLM2 run"
fi
GPUS=$(python -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" -ge 2 ]; then  # the generator's tensor parallelism (CRUCIBLE_VLLM_TENSOR_PARALLEL)
  timeout 150 python bench/bench_vllm.py --prompts 64 --group 4 --max-tokens 32 --tensor-parallel 2
else
  echo "one GPU: skipping the tensor-parallel run"
fi
