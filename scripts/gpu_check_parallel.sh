#!/usr/bin/env bash
# GPU check for the sharded strategies: fsdp (ZeRO-3, then ZeRO-2 with CPU offload and bf16 where
# the precision group offers it) and tp, on CUDA with nccl, a few steps each, under 5 minutes.
# One process per visible GPU (world size 1 on a single GPU: 1-rank meshes); needs `make install`.
#   scripts/gpu_check_parallel.sh            # all visible GPUs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPUS=$($PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.device_count())")
HEADS_OK=$(( GPUS == 1 || GPUS == 2 || GPUS == 4 ))  # model.heads=4 must split over tp ranks
QUICK=(model=gpt train.steps=20 train.warmup_steps=5 train.log_every=10 eval.every_steps=0
       tracking.enabled=false data.batch_size=$(( 64 * GPUS )) launch.nproc_per_node="$GPUS")
OUT=$(mktemp -d)
echo "gpu_check_parallel: $GPUS GPU(s), outputs in $OUT"

check() {  # name, overrides...
  local name=$1; shift
  echo "== $name"
  timeout 120 $PY -m mgpu "${QUICK[@]}" "$@" hydra.run.dir="$OUT/$name"
  $PY - "$OUT/$name/summary.json" <<'PYEOF'
import json, math, sys
s = json.load(open(sys.argv[1]))
assert math.isfinite(s["train/loss"]) and s["train/loss"] < 2.5, s
print(f"   loss {s['train/loss']:.4f}  accuracy {s['eval/accuracy']:.3f}  "
      f"params/rank {s['memory/param_bytes_per_rank']:.0f} B  peak {s['memory/peak_bytes']:.0f} B")
PYEOF
}

check fsdp_zero3 strategy=fsdp
check fsdp_zero2_offload strategy=fsdp strategy.reshard_after_forward=false strategy.cpu_offload=true
check fsdp_checkpointing strategy=fsdp strategy.activation_checkpointing=selective
if (( HEADS_OK )); then
  check tp strategy=tp
  check tp_sequence_parallel strategy=tp strategy.sequence_parallel=true
fi
if (( GPUS >= 4 )); then
  check hybrid_dp_tp strategy=hybrid strategy.dp=$(( GPUS / 2 )) strategy.tp=2
fi
echo "gpu_check_parallel: all checks passed"
