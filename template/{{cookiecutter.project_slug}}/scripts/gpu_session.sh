#!/usr/bin/env bash
# Everything a GPU session should check, most important first, in about 10 minutes of one GPU; each part
# runs under its own time limit, so a slow part cannot eat the others:
#   1. the same tiny run (seed, data, bf16-mixed, 8 steps) under ddp, fsdp2, fsdp (FSDP1) and DeepSpeed
#      ZeRO-3 on one GPU: the losses side by side and each one's largest difference from ddp's;
#   2. scripts/gpu_bench.sh mfu: MFU, tokens/s and peak memory of a ~1B GPT, eager and compiled, beside
#      what `plan` estimates for that run;
#   3. scripts/gpu_check.sh: every GPU recipe shrunk, trained 4 steps, saved, resumed to 6.
#
#   bash scripts/gpu_session.sh 2>&1 | tee gpu-session.log
#
# Results on stdout; logs under runs/gpu-session/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
OUT=runs/gpu-session
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_session: no CUDA GPU visible; this script is for GPU machines" >&2
  exit 2
fi
mkdir -p "$OUT"
"$PYTHON" -c "import torch; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)"
date -u +"%Y-%m-%d %H:%M UTC"

echo
echo "1. the same run under four strategies (tiny GPT, bf16-mixed, one GPU, seed 1337, 8 steps)"
TINY=(--devices 1 --num_nodes 1 --accelerator cuda --precision bf16-mixed --train.seed 1337
  --model.vocab_size 256 --model.block_size 128 --model.n_layer 2 --model.n_head 4 --model.n_embd 128
  --data.source embedded --train.micro_batch_size 4 --train.grad_accum_steps 2 --train.warmup_steps 2
  --train.max_steps 8 --eval.every_steps 0 --checkpoint.save_every_steps 0 --checkpoint.resume null
  --logger.name csv --logger.log_every_steps 1)
declare -A STRATEGY=([ddp]="--strategy.name ddp" [fsdp2]="--strategy.name fsdp2"
  [fsdp1]="--strategy.name fsdp" [zero3]="--strategy.name deepspeed --strategy.deepspeed.stage 3")
for name in ddp fsdp2 fsdp1 zero3; do
  rm -rf "${OUT:?}/losses-$name"
  # shellcheck disable=SC2086  # the strategy options are words
  timeout 120 "$PYTHON" -m {{ cookiecutter.package_name }} train --config recipes/single-gpu.yaml "${TINY[@]}" ${STRATEGY[$name]} \
    --out_dir "$OUT/losses-$name" >"$OUT/losses-$name.log" 2>&1 || echo "  $name failed (exit $?): $OUT/losses-$name.log"
done
"$PYTHON" - "$OUT" <<'PYTHON'
import csv, glob, sys
def losses(name):
    rows = [r for p in glob.glob(f"{sys.argv[1]}/losses-{name}/csv/**/metrics.csv", recursive=True) for r in csv.DictReader(open(p))]
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
runs = {name: losses(name) for name in ("ddp", "fsdp2", "fsdp1", "zero3")}
print(f"  {'step':>4}" + "".join(f"{name:>10}" for name in runs))
for step in sorted(runs["ddp"]):
    print(f"  {step:>4}" + "".join(f"{run[step]:>10.4f}" if step in run else f"{'-':>10}" for run in runs.values()))
for name, run in runs.items():
    if name != "ddp" and run and runs["ddp"]:
        print(f"  {name}: largest |loss - ddp's| = {max(abs(run[s] - runs['ddp'][s]) for s in run if s in runs['ddp']):.4f}")
PYTHON

echo
echo "2. MFU (scripts/gpu_bench.sh mfu), and plan's estimate of that run's memory"
OUT=$OUT/bench timeout 270 bash scripts/gpu_bench.sh mfu || echo "  gpu_bench mfu stopped (exit $?)"
"$PYTHON" -m {{ cookiecutter.package_name }} plan single-gpu --devices 1 --accelerator cuda --precision bf16-mixed \
  --model.vocab_size 50304 --model.block_size 2048 --model.n_layer 16 --model.n_head 16 --model.n_embd 2048 \
  --train.micro_batch_size 4 --strategy.activation_checkpointing false | grep -E "^(strategy|ddp) " || true

echo
echo "3. every GPU recipe, shrunk: train, save, resume (scripts/gpu_check.sh)"
timeout 180 bash scripts/gpu_check.sh || echo "  gpu_check stopped or failed (exit $?): runs/gpu-check/"
