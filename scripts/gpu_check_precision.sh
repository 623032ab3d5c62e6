#!/usr/bin/env bash
# GPU check for the precision group: a few hundred steps of fp32, bf16 and amp (fp16 +
# GradScaler) with DDP on every visible GPU, then each run's samples/s, loss scale, skipped
# steps and accuracy. Needs CUDA; takes well under 5 minutes.
#   bash scripts/gpu_check_precision.sh            (from the repo root, after `make install`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d)}

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$PY" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.device_count(), 'x',
          torch.cuda.get_device_name(0), '| bf16 supported:', torch.cuda.is_bf16_supported())"

for precision in fp32 bf16 amp; do
    timeout 120 "$PY" -m mgpu precision=$precision strategy=ddp train.steps=300 \
        train.warmup_steps=50 train.log_every=50 eval.every_steps=0 tracking.enabled=false \
        precision.pad_to_multiple_of=8 "hydra.run.dir=$OUT/$precision" > "$OUT/$precision.log"
    "$PY" - "$OUT/$precision/summary.json" "$precision" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>5}: {s['train/samples_per_s']:>10,.0f} samples/s  "
      f"loss scale {s['amp/loss_scale']:>8g}  skipped {s['amp/skipped_steps']:g}  "
      f"loss {s['train/loss']:.4f}  eval/accuracy {s['eval/accuracy']:.4f}")
PY
done
echo "outputs and logs: $OUT"
