#!/usr/bin/env bash
# The CUDA paths, in one run on a machine with a GPU (CI has none; see docs/architecture.md,
# "On GPUs"): the gpu-marked tests (CUDA tensors through every strategy against single on
# the GPU, NCCL or gloo among GPU workers, the MoE layer on the GPU), the MoE layer's
# throughput on the GPU (benchmarks/moe.py --device cuda), and `polytrain train --device cuda`.
#
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default $OUT, else benchmarks/results/gpu_check)
# Runs from a checkout with the python that has torch (PYTHON=...); installs nothing.
# Writes env.txt, gpu_tests.log, moe_cuda.json, moe_cuda.log, train.log, train_cuda.json.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-${OUT:-benchmarks/results/gpu_check}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
{
    nvidia-smi -L
    "$py" -c "import sys, torch; print('python', sys.version.split()[0], '| torch',
torch.__version__, '| cuda', torch.version.cuda, '| nccl', torch.cuda.nccl.version(), '| gpus',
torch.cuda.device_count(), torch.cuda.get_device_name(0))"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

echo "== gpu tests ($((SECONDS - start)) s)"
timeout 240 "$py" -m pytest -m gpu -p no:cacheprovider -q --tb=short --durations=0 tests \
    >"$out/gpu_tests.log" 2>&1
echo "pytest rc=$?" >>"$out/gpu_tests.log"
tail -25 "$out/gpu_tests.log"

echo "== MoE throughput on the GPU ($((SECONDS - start)) s)"
timeout 150 "$py" benchmarks/moe.py --device cuda --out "$out/moe_cuda.json" \
    >"$out/moe_cuda.log" 2>&1
echo "moe rc=$?" >>"$out/moe_cuda.log"
cat "$out/moe_cuda.log"

echo "== polytrain train --device cuda ($((SECONDS - start)) s)"
: >"$out/train.log"
runs=(
    "single|--strategy single --steps 300"
    "ddp-2-shared-gpu|--strategy ddp --workers 2 --steps 300"
    "moe-2|--strategy moe --model gpt-moe --workers 2 --steps 100"
)
for run in "${runs[@]}"; do
    name="${run%%|*}"
    # shellcheck disable=SC2086  # the options split into words
    timeout 40 "$py" -c "import sys; from polytrain.cli import main; sys.exit(main())" \
        train --device cuda --out "$out/train-$name" ${run#*|} >>"$out/train.log" 2>&1
    echo "$name rc=$?" >>"$out/train.log"
done
"$py" - "$out" <<'PY' >>"$out/train.log" 2>&1
import json, pathlib, shutil, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for d in sorted(out.glob("train-*")):
    m = json.loads((d / "metrics.json").read_text()) if (d / "metrics.json").exists() else {}
    rows[d.name.removeprefix("train-")] = {k: m.get(k) for k in (
        "strategy", "model", "workers", "steps", "batch_size", "final_loss", "samples_per_s",
        "step_time_s", "wall_time_s", "versions")}
    shutil.rmtree(d)
(out / "train_cuda.json").write_text(json.dumps(rows, indent=1) + "\n")
print(json.dumps({k: (v["final_loss"], v["step_time_s"]) for k, v in rows.items()}))
PY
tail -8 "$out/train.log"
echo "== done in $((SECONDS - start)) s"
