#!/usr/bin/env bash
# What the loop achieves on one GPU, and how large a model one GPU trains:
#   1. MFU, tokens/s and peak memory of a ~1B-parameter GPT in bf16-mixed on one GPU, eager and with
#      strategy.compile (torch.compile per block), the project's `train` as a user runs it;
#   2. the largest GPT (width 2048, more and more blocks) that trains 3 steps on one GPU under ddp, and
#      under fsdp2 with strategy.fsdp2.cpu_offload (parameters, gradients, optimizer state in host RAM).
#
#   bash scripts/gpu_bench.sh                  # both parts (~20 minutes on an H100)
#   bash scripts/gpu_bench.sh mfu              # part 1 only
#   bash scripts/gpu_bench.sh largest          # part 2 only
#
# Results: one table per part on stdout, and runs/gpu-bench/ for the logs (deleted checkpoints aside).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
OUT=${OUT:-runs/gpu-bench}
PART=${1:-all}
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_bench: no CUDA GPU visible; this script is for GPU machines" >&2
  exit 2
fi
mkdir -p "$OUT"
"$PYTHON" -c "import torch; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)"

# A GPT of width 2048 on the embedded data; n_layer 16 makes ~1.0B parameters with a 50k vocabulary.
model_args() {  # model_args N_LAYER
  echo --model.vocab_size 50304 --model.block_size 2048 --model.n_layer "$1" --model.n_head 16 --model.n_embd 2048
}

train() {  # train NAME MAX_STEPS ARGS... -> runs/gpu-bench/NAME; the final checkpoint is deleted afterwards
  local name=$1 steps=$2
  shift 2
  rm -rf "${OUT:?}/$name"
  timeout 1200 "$PYTHON" -m {{ cookiecutter.package_name }} train --config recipes/single-gpu.yaml --devices 1 --num_nodes 1 \
    --accelerator cuda --precision bf16-mixed --data.source embedded --train.max_steps "$steps" \
    --train.warmup_steps 2 --eval.every_steps 0 --checkpoint.save_every_steps 0 --checkpoint.resume null \
    --logger.name csv --logger.log_every_steps 10 --out_dir "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
  local status=$?
  rm -rf "${OUT:?}/$name/checkpoints"
  return $status
}

metrics() {  # metrics NAME -> "tokens/s mfu peak_gib" of the last logged step
  "$PYTHON" - "$OUT/$1" <<'EOF'
import csv, glob, sys
rows = [row for path in glob.glob(f"{sys.argv[1]}/csv/**/metrics.csv", recursive=True) for row in csv.DictReader(open(path))]
rows = [row for row in rows if row.get("throughput/tokens_per_second")]
if not rows:
    print("- - -")
else:
    last = rows[-1]
    mfu = last.get("throughput/mfu") or "nan"
    print(f"{float(last['throughput/tokens_per_second']):.0f} {float(mfu):.3f} {float(last['memory/peak_allocated_gib']):.1f}")
EOF
}

if [ "$PART" = all ] || [ "$PART" = mfu ]; then
  echo
  printf '%-28s %12s %7s %14s\n' "~1B GPT, bf16-mixed, 1 GPU" "tokens/s" "MFU" "peak GiB"
  for compile in false true; do
    name="mfu-compile-$compile"
    if train "$name" 60 $(model_args 16) --strategy.name ddp --strategy.compile "$compile" \
      --train.micro_batch_size 4 --train.grad_accum_steps 1 --strategy.activation_checkpointing false; then
      read -r rate mfu peak <<<"$(metrics "$name")"
    else
      rate="failed" mfu="-" peak="-"
    fi
    printf '%-28s %12s %7s %14s\n' "compile=$compile" "$rate" "$mfu" "$peak"
  done
fi

if [ "$PART" = all ] || [ "$PART" = largest ]; then
  echo
  echo "largest GPT (width 2048) that trains 3 steps on 1 GPU (micro batch 1, sequence 2048, activation checkpointing):"
  for strategy in ddp fsdp2-offload; do
    largest="none"
    for layers in 8 16 24 32 48 64 96 128 192; do
      case "$strategy" in
        ddp) extra=(--strategy.name ddp) ;;
        fsdp2-offload) extra=(--strategy.name fsdp2 --strategy.fsdp2.cpu_offload true) ;;
      esac
      name="largest-$strategy-$layers"
      if train "$name" 3 $(model_args "$layers") "${extra[@]}" --train.micro_batch_size 1 --train.grad_accum_steps 1 \
        --strategy.activation_checkpointing true --logger.log_every_steps 1; then
        largest="$layers blocks = $("$PYTHON" -c "
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.sizing import model_parameters
print(f'{model_parameters(ModelConfig(vocab_size=50304, block_size=2048, n_layer=$layers, n_head=16, n_embd=2048)) / 1e9:.1f}B')
") parameters, peak $(metrics "$name" | cut -d' ' -f3) GiB"
      else
        break  # out of memory (see $OUT/$name.log)
      fi
    done
    printf '  %-14s %s\n' "$strategy" "$largest"
  done
fi
