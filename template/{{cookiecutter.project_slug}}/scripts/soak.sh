#!/usr/bin/env bash
# Soak test of exact resume and of process lifecycle (not run in CI): train a tiny model with 2 CPU processes
# (FSDP2, gloo) and stop it KILLS times:
#   - SIGKILL to the whole job at a random moment after a random coming checkpoint;
#   - every third of those to the launcher alone: the rank it started must die with it (no orphan);
#   - every fourth inside a save (TRAIN_FAULT=kill-in-save);
#   - every fifth right after a restart, during set-up, before it got anywhere;
#   - every sixth a step that hangs (TRAIN_FAULT=hang-at-step) and SIGTERM: the run must exit 75 within the
#     stop deadline, without saving that step.
# After each stop no process of the run may be left. Each restart resumes from the newest complete
# checkpoint; the final weights must be bitwise those of an uninterrupted run of the same recipe.{% if cookiecutter.task == "language_model" %}
# First, `prepare` is SIGKILLed PREPARE_KILLS times (3) mid-way: no worker may be left, and a prepare
# after each kill gives the same bytes as one never interrupted.{% endif %}
#
#   bash scripts/soak.sh            # 20 kills
#   bash scripts/soak.sh 50 ddp 300 # 50 kills, strategy ddp, 300 steps
#
# Prints one line per kill and a summary; exit code 0 only when every check holds.
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

left_behind() {  # processes of this soak's runs still alive (their command lines name $WORK)
  pgrep -f -- "$WORK/" | grep -v "^$$\$" || true
}
no_process_left() {  # wait up to 10 s for every process of the run to end; fail the soak otherwise
  for _ in $(seq 50); do [ -z "$(left_behind)" ] && return 0; sleep 0.2; done
  echo "soak: FAILED: processes left after $1:" >&2; ps -o pid,ppid,args -p "$(left_behind | paste -sd,)" >&2
  exit 1
}
{%- if cookiecutter.task == "language_model" %}

PREPARE_KILLS=${PREPARE_KILLS:-3}
"$PYTHON" -c "from {{ cookiecutter.package_name }}.tasks.language_model.data import make_demo_text; open('$WORK/corpus.txt', 'w').write(make_demo_text() * 400)"
PREPARE=(prepare "$WORK/corpus.txt" --train_tokenizer 300 --workers 2 --shard_tokens 200000)
"$PYTHON" -m {{ cookiecutter.package_name }} "${PREPARE[@]}" --out "$WORK/prepared-reference" > "$WORK/prepare.log" 2>&1 \
  || { echo "soak: the reference prepare failed; see $WORK/prepare.log" >&2; exit 1; }
for ((kill = 1; kill <= PREPARE_KILLS; kill++)); do
  "$PYTHON" -m {{ cookiecutter.package_name }} "${PREPARE[@]}" --out "$WORK/prepared" >> "$WORK/prepare.log" 2>&1 &
  pid=$!
  sleep "$((RANDOM % 3)).$((RANDOM % 10))"
  kill -KILL "$pid" 2>/dev/null  # the parent only: its workers must end with it
  wait "$pid" 2>/dev/null
  no_process_left "prepare kill $kill"
  rm -rf "$WORK/prepared.partial"  # an interrupted prepare leaves it; prepare refuses to delete what is not its own
  "$PYTHON" -m {{ cookiecutter.package_name }} "${PREPARE[@]}" --out "$WORK/prepared" >> "$WORK/prepare.log" 2>&1 \
    || { echo "soak: prepare after kill $kill failed; see $WORK/prepare.log" >&2; exit 1; }
  cmp -s "$WORK/prepared/manifest.json" "$WORK/prepared-reference/manifest.json" \
    || { echo "soak: FAILED: prepare after kill $kill gave other shards than the reference" >&2; exit 1; }
  echo "soak: prepare kill $kill: no worker left, the rerun's shards are the reference's"
  rm -rf "$WORK/prepared"
done
{%- endif %}

RUN=$WORK/killed
in_save=0 back_to_back=0 launcher_only=0 hangs=0
newest_step() {  # the step of the newest complete checkpoint of the killed run (0 if none)
  local name
  name=$(ls "$RUN/checkpoints" 2>/dev/null | grep -v partial | tail -1)
  if [ -z "$name" ]; then echo 0; else echo $((10#${name#step-})); fi
}
for ((kill = 1; kill <= KILLS; kill++)); do
  fault=""
  if ((kill % 4 == 0)); then  # every fourth kill lands inside the save of a random coming checkpoint
    fault="kill-in-save:$(($(newest_step) + 3 * (RANDOM % 2 + 1)))"
  elif ((kill % 6 == 0)); then  # every sixth, a step that never ends, then SIGTERM
    fault="hang-at-step:$(($(newest_step) + RANDOM % 3 + 1))"
  fi
  TRAIN_FAULT=$fault setsid "$PYTHON" -m {{ cookiecutter.package_name }} "${ARGS[@]}" --out_dir "$RUN" --checkpoint.resume auto \
    --checkpoint.stop_deadline_seconds 3 >> "$WORK/killed.log" 2>&1 &
  pid=$!
  if [[ $fault == hang-at-step:* ]]; then
    before=$(grep -c "hangs after step" "$WORK/killed.log")
    while kill -0 "$pid" 2>/dev/null && [ "$(grep -c "hangs after step" "$WORK/killed.log")" -eq "$before" ]; do sleep 0.2; done
    started=$SECONDS
    kill -TERM -- "-$pid" 2>/dev/null  # the whole job, as scancel does
    wait "$pid"
    code=$?
    if [ "$code" -ne 75 ] || ((SECONDS - started > 30)); then
      echo "soak: FAILED: a hung step signalled with SIGTERM ended with exit $code after $((SECONDS - started)) s (want 75 within the deadline)" >&2
      exit 1
    fi
    hangs=$((hangs + 1))
  elif ((kill % 5 == 0)); then
    # Right after a restart, before it got anywhere.
    sleep 0.$((RANDOM % 9 + 1)); back_to_back=$((back_to_back + 1))
  elif [ -z "$fault" ]; then
    # At a random moment: once the run has passed a random coming checkpoint, within the next steps.
    target=$(($(newest_step) + 3 * (RANDOM % 2 + 1)))
    while kill -0 "$pid" 2>/dev/null && [ "$(newest_step)" -lt "$target" ]; do sleep 0.2; done
    sleep 0.$((RANDOM % 10))
  fi
  if [[ $fault == kill-in-save:* ]]; then
    wait "$pid" 2>/dev/null  # the fault kills the whole job inside that save
  elif [ -z "$fault" ] && ((kill % 3 == 0)); then
    kill -KILL "$pid" 2>/dev/null  # the launcher alone: the rank it started must end with it
    wait "$pid" 2>/dev/null
    launcher_only=$((launcher_only + 1))
  elif [ -z "$fault" ]; then
    kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  fi
  no_process_left "kill $kill"
  partial=0  # an unfinished save newer than the newest complete checkpoint: this kill landed in it
  for folder in "$RUN"/checkpoints/step-*.partial; do
    [ -e "$folder" ] || continue
    name=${folder##*/step-}
    if ((10#${name%.partial} > $(newest_step))); then partial=1; fi
  done
  in_save=$((in_save + (partial > 0)))
  echo "soak: kill $kill${fault:+ ($fault)}; no process left; newest complete checkpoint: step $(newest_step)$([ "$partial" -gt 0 ] && echo ', killed during a save')"
  if [ "$(newest_step)" -ge "$STEPS" ]; then
    echo "soak: the run finished before kill $kill; stopping early"
    break
  fi
done
echo "soak: final run to step $STEPS"
"$PYTHON" -m {{ cookiecutter.package_name }} "${ARGS[@]}" --out_dir "$RUN" --checkpoint.resume auto >> "$WORK/killed.log" 2>&1 \
  || { echo "soak: the final run failed; see $WORK/killed.log" >&2; exit 1; }
"$PYTHON" - "$WORK" "$STEPS" "$((kill - 1))" "$in_save" "$back_to_back" "$launcher_only" "$hangs" <<'PY'
import sys
from pathlib import Path

import torch

from {{ cookiecutter.package_name }}.checkpoint.load import consolidate
from {{ cookiecutter.package_name }}.checkpoint.layout import find_latest

work, steps, kills, in_save, back_to_back, launcher_only, hangs = Path(sys.argv[1]), *map(int, sys.argv[2:])
weights = []
for run in ("reference", "killed"):
    latest = find_latest(work / run / "checkpoints")
    assert latest is not None and latest.name == f"step-{steps:08d}", latest
    weights.append(consolidate(latest, work / f"{run}.pt"))
equal = weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
print(
    f"soak: {kills} kills ({in_save} during a save, {back_to_back} right after a restart, {launcher_only} of the"
    f" launcher alone, {hangs} hung steps stopped by SIGTERM), no process left behind, final weights"
    f" {'bitwise equal' if equal else 'DIFFERENT'} to the uninterrupted run"
)
sys.exit(0 if equal else 1)
PY
