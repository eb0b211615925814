#!/usr/bin/env bash
# Soak test of exact resume (not run in CI): train a tiny GPT with 2 CPU processes (FSDP2, gloo), kill the
# whole job with SIGKILL KILLS times (at random moments after a random coming checkpoint; every fourth
# inside a save, through TRAIN_FAULT=kill-in-save; every fifth right after a restart, before it got
# anywhere), let each restart resume from the newest complete checkpoint, and compare the final
# weights bitwise with an uninterrupted run of the same recipe.
#
#   bash scripts/soak.sh            # 20 kills
#   bash scripts/soak.sh 50 ddp 300 # 50 kills, strategy ddp, 300 steps
#
# Prints one line per kill and a summary; exit code 0 only when the final weights are bitwise equal.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python}
KILLS=${1:-20}
STRATEGY=${2:-fsdp2}
STEPS=${3:-150}
WORK=$(mktemp -d -t soak-XXXXXX)
ARGS=(train --config recipes/cpu-debug.yaml --strategy.name "$STRATEGY" --model.n_layer 2 --model.n_embd 64
  --model.n_head 2{% if cookiecutter.task == "language_model" %} --model.block_size 64{% endif %} --train.micro_batch_size 4 --train.max_steps "$STEPS"
  --checkpoint.save_every_steps 3 --checkpoint.keep_last 3 --eval.every_steps 0 --logger.name csv
  --logger.log_every_steps 1000)

echo "soak: reference run ($STEPS steps, $STRATEGY, 2 processes) in $WORK/reference"
"$PYTHON" -m {{ cookiecutter.package_name }} "${ARGS[@]}" --out_dir "$WORK/reference" --checkpoint.resume null > "$WORK/reference.log" 2>&1 \
  || { echo "soak: the reference run failed; see $WORK/reference.log" >&2; exit 1; }

RUN=$WORK/killed
in_save=0 back_to_back=0
newest_step() {  # the step of the newest complete checkpoint of the killed run (0 if none)
  local name
  name=$(ls "$RUN/checkpoints" 2>/dev/null | grep -v partial | tail -1)
  if [ -z "$name" ]; then echo 0; else echo $((10#${name#step-})); fi
}
for ((kill = 1; kill <= KILLS; kill++)); do
  fault=""
  if ((kill % 4 == 0)); then  # every fourth kill lands inside the save of a random coming checkpoint
    fault="kill-in-save:$(($(newest_step) + 3 * (RANDOM % 2 + 1)))"
  fi
  TRAIN_FAULT=$fault setsid "$PYTHON" -m {{ cookiecutter.package_name }} "${ARGS[@]}" --out_dir "$RUN" --checkpoint.resume auto >> "$WORK/killed.log" 2>&1 &
  pid=$!
  if ((kill % 5 == 0)); then
    # Right after a restart, before it got anywhere.
    sleep 0.$((RANDOM % 9 + 1)); back_to_back=$((back_to_back + 1))
  elif [ -z "$fault" ]; then
    # At a random moment: once the run has passed a random coming checkpoint, within the next steps.
    target=$(($(newest_step) + 3 * (RANDOM % 2 + 1)))
    while kill -0 "$pid" 2>/dev/null && [ "$(newest_step)" -lt "$target" ]; do sleep 0.2; done
    sleep 0.$((RANDOM % 10))
  fi
  if [ -n "$fault" ]; then
    wait "$pid" 2>/dev/null  # the fault kills the whole job inside that save
  else
    kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  fi
  partial=0  # an unfinished save newer than the newest complete checkpoint: this kill landed in it
  for folder in "$RUN"/checkpoints/step-*.partial; do
    [ -e "$folder" ] || continue
    name=${folder##*/step-}
    if ((10#${name%.partial} > $(newest_step))); then partial=1; fi
  done
  in_save=$((in_save + (partial > 0)))
  echo "soak: kill $kill${fault:+ ($fault)}; newest complete checkpoint: step $(newest_step)$([ "$partial" -gt 0 ] && echo ', killed during a save')"
  if [ "$(newest_step)" -ge "$STEPS" ]; then
    echo "soak: the run finished before kill $kill; stopping early"
    break
  fi
done
echo "soak: final run to step $STEPS"
"$PYTHON" -m {{ cookiecutter.package_name }} "${ARGS[@]}" --out_dir "$RUN" --checkpoint.resume auto >> "$WORK/killed.log" 2>&1 \
  || { echo "soak: the final run failed; see $WORK/killed.log" >&2; exit 1; }
"$PYTHON" - "$WORK" "$STEPS" "$((kill - 1))" "$in_save" "$back_to_back" <<'PY'
import sys
from pathlib import Path

import torch

from {{ cookiecutter.package_name }}.checkpoint.io import consolidate
from {{ cookiecutter.package_name }}.checkpoint.layout import find_latest

work, steps, kills, in_save, back_to_back = Path(sys.argv[1]), *map(int, sys.argv[2:])
weights = []
for run in ("reference", "killed"):
    latest = find_latest(work / run / "checkpoints")
    assert latest is not None and latest.name == f"step-{steps:08d}", latest
    weights.append(consolidate(latest, work / f"{run}.pt"))
equal = weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
print(
    f"soak: {kills} kills ({in_save} during a save, {back_to_back} right after a restart), final weights"
    f" {'bitwise equal' if equal else 'DIFFERENT'} to the uninterrupted run"
)
sys.exit(0 if equal else 1)
PY
