#!/usr/bin/env bash
# The learner's ranks on a lent GPU machine (NCCL), in a few minutes: the same two steps on the CPU
# in one process and on the GPUs under torchrun (FSDP2, so a distributed group even on one GPU),
# compared as tests/test_learner_ranks.py compares gloo ranks; then step times of 1 against N ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
GPUS=$(python -c 'import torch; print(torch.cuda.device_count())')
RANKS=$(( GPUS >= 2 ? 2 : 1 ))
OUT=$(mktemp -d)
export PYTHONHASHSEED=0 OMP_NUM_THREADS=1
CUDA_VISIBLE_DEVICES= python -m tests.learner_ranks_step "$OUT/cpu" ddp grpo 3 3
mkdir -p "$OUT/gpu"
timeout 300 python -m torch.distributed.run --standalone --nproc-per-node "$RANKS" -m tests.learner_ranks_step "$OUT/gpu" fsdp grpo 3 3
python - "$OUT" <<'PY'
import json, sys, torch
out = sys.argv[1]
a, b = torch.load(f"{out}/cpu/state.pt"), torch.load(f"{out}/gpu/state.pt")
diff = max(float((a["weights"][k] - b["weights"][k].cpu()).abs().max()) for k in a["weights"])
ma, mb = json.load(open(f"{out}/cpu/metrics.json")), json.load(open(f"{out}/gpu/metrics.json"))
print(f"max |w_cpu - w_gpu| after two steps: {diff:.2e}")
for name in ("loss", "kl", "grad_norm"):
    print(f"{name}: cpu {ma[1][name]:.6f} gpu {mb[1][name]:.6f}")
PY
if [ "$GPUS" -ge 2 ]; then
  timeout 300 python bench/bench_learner_ranks.py --ranks "$GPUS"
fi
