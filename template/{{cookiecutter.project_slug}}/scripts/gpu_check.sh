#!/usr/bin/env bash
# Run every GPU recipe of the library for a few steps on this GPU machine: train 4 steps (saving at 2
# and 4), then resume from the newest checkpoint to step 6. Models are shrunk to a tiny GPT on the
# embedded data, so one GPU is enough; recipes that need two nodes (HSDP, HYBRID_SHARD) run as two
# single-GPU "nodes" on this machine when it has 2+ GPUs.
#
#   bash scripts/gpu_check.sh                 # all GPU recipes
#   bash scripts/gpu_check.sh deepspeed-zero3-offload-node fsdp1-node   # some of them
#
# DeepSpeed recipes need `pip install -e '.[deepspeed]'`, the float8 recipe `pip install -e '.[float8]'` and a GPU of
# compute capability 8.9+. Results: one line per recipe, and runs/gpu-check/<recipe>/ for the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
OUT=runs/gpu-check
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$GPUS" -lt 1 ]; then
  echo "gpu_check: no CUDA GPU visible; this script is for GPU machines" >&2
  exit 2
fi
mkdir -p "$OUT"

if [ "$#" -gt 0 ]; then
  RECIPES=("$@")
else
  RECIPES=()
  for path in recipes/*.yaml; do
    name=$(basename "$path" .yaml)
    case "$name" in cpu-*) continue ;; esac
    RECIPES+=("$name")
  done
fi

# A tiny model and a short run; the strategy settings of the recipe stay as they are.
tiny_args() {
  echo --devices 1 --num_nodes 1 \
{%- if cookiecutter.task == "language_model" %}
    --model.vocab_size 256 --model.block_size 128 --model.n_layer 2 --model.n_head 4 --model.n_embd 128 \
    --data.source embedded --train.micro_batch_size 4{% else %}
    --model.image_size 8 --model.patch_size 2 --model.channels 1 --model.num_classes 10 \
    --model.n_layer 2 --model.n_head 4 --model.n_embd 128 --data.source digits --data.crop_padding 1 \
    --train.micro_batch_size 4{% endif %} --train.grad_accum_steps 2 --train.warmup_steps 2 \
    --eval.every_steps 2 --eval.batches 2 --checkpoint.save_every_steps 2 --logger.name csv --logger.log_every_steps 1
}

train() {  # train NAME NODES EXTRA_ARGS... -> runs one launcher per node
  local name=$1 nodes=$2
  shift 2
  if [ "$nodes" -eq 1 ]; then
    "$PYTHON" -m {{ cookiecutter.package_name }} train --config "recipes/$name.yaml" $(tiny_args) "$@"
    return
  fi
  local port=$((29500 + RANDOM % 1000)) pids=() status=0
  for node in $(seq 0 $((nodes - 1))); do
    CUDA_VISIBLE_DEVICES=$node NODE_RANK=$node MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$PYTHON" -m {{ cookiecutter.package_name }} train --config "recipes/$name.yaml" $(tiny_args) "$@" --num_nodes "$nodes" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return $status
}

check() {  # check NAME: train to 4, resume to 6; prints one line
  local name=$1 nodes=1 extra=()
  local text
  text=$(cat "recipes/$name.yaml")
  case "$text" in *"name: hsdp"*|*"sharding: HYBRID_SHARD"*) nodes=2 ;; esac
  case "$text" in *"tensor_parallel_size"*) extra+=(--strategy.fsdp2.tensor_parallel_size 1) ;; esac
  # The tiny model's 4 heads: 2 key/value heads, a narrow MLP, untied (vocab 256).
  case "$text" in *"arch: llama"*) extra+=(--model.n_kv_head 2 --model.intermediate_size 256) ;; esac
  case "$text" in *"nvme_path"*) mkdir -p "$OUT/nvme"; extra+=(--strategy.deepspeed.nvme_path "$PWD/$OUT/nvme") ;; esac
  if [ "$nodes" -gt "$GPUS" ]; then
    echo "SKIP  $name (needs $nodes GPUs to run as $nodes nodes)"
    return 0
  fi
  local dir="$OUT/$name" log="$OUT/$name.log"
  rm -rf "$dir"
  if ! train "$name" "$nodes" --out_dir "$dir" --train.max_steps 4 --checkpoint.resume null "${extra[@]}" >"$log" 2>&1; then
    echo "FAIL  $name (training; see $log)"
    return 1
  fi
  if ! train "$name" "$nodes" --out_dir "$dir" --train.max_steps 6 --checkpoint.resume auto "${extra[@]}" >>"$log" 2>&1; then
    echo "FAIL  $name (resume; see $log)"
    return 1
  fi
  if ! grep -q "Resumed from .* at step 4" "$log" || [ ! -f "$dir/checkpoints/step-00000006/meta.json" ]; then
    echo "FAIL  $name (did not resume from step 4; see $log)"
    return 1
  fi
  echo "PASS  $name (train 4 steps, save, resume to 6)"
}

failed=0
for name in "${RECIPES[@]}"; do
  check "$name" || failed=1
done
"$PYTHON" -c "import torch; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)"
exit $failed
