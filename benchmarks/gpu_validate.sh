#!/usr/bin/env bash
# One GPU's fidelity check (issue 10, item 4): time the ops of two Llama-style steps on this
# GPU with `topomesh validate --device cuda` (op table into OUTDIR/ops.sqlite), predict each
# one-GPU step on the GPU's cluster preset, run it for real, and see where the first real
# step's time goes (benchmarks/bench_gpu_step.py). Run from the repository root on a CUDA
# machine:
#
#     bash benchmarks/gpu_validate.sh OUTDIR
#
# Writes OUTDIR/validate_gpu.json and OUTDIR/validate_gpu.png (benchmarks/validate_gpu_llama.json:
# 8 layers, hidden 2048, 2 micro-batches of 2 x 2048 tokens), OUTDIR/validate_gpu_8b.json
# (benchmarks/validate_gpu_llama8b.json: 4 Llama-3-8B layers and its vocabulary, 2 micro-batches
# of 1 x 4096 tokens), OUTDIR/ops.sqlite and OUTDIR/step_profile.json. Each part runs even
# when one before it failed. The repo keeps them in benchmarks/data/gpu/ with the GPU's name
# appended (validate_gpu_h200.json, h200_ops.sqlite, ...).
set -u
out=${1:?usage: bash benchmarks/gpu_validate.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"

validate() {  # MODEL MICRO_BATCH REPORT [more flags]
    local model=$1 micro=$2 report=$3 start
    shift 3
    start=$(date +%s)
    timeout 300 python3 -m topomesh validate --device cuda --model "$model" --layouts dp_shard=1 \
        --micro-batch "$micro" --steps 10 --repeats 3 --db "$out/ops.sqlite" --json "$@" > "$out/$report"
    echo "validate $model: exit $? after $(( $(date +%s) - start )) s"
    python3 - "$out/$report" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["layouts"]:
    print(f"{r['model']} {x['layout']}: predicted {x['predicted_s'] * 1e3:.2f} ms, measured {x['measured_s'] * 1e3:.2f} ms "
          f"(runs {[round(s * 1e3, 2) for s in x['measured_runs_s']]}), error {x['error'] * 100:+.1f} %; peak predicted "
          f"{x['predicted_peak_bytes'] / 1e9:.3f} GB, measured {x['measured_peak_bytes'] / 1e9:.3f} GB; {x['breakdown']}")
PY
}

validate benchmarks/validate_gpu_llama.json 2 validate_gpu.json --png "$out/validate_gpu.png"
validate benchmarks/validate_gpu_llama8b.json 1 validate_gpu_8b.json
timeout 150 python3 benchmarks/bench_gpu_step.py --model benchmarks/validate_gpu_llama.json --micro-batch 2 \
    --out "$out/step_profile.json"
echo "bench_gpu_step: exit $?"
