#!/usr/bin/env bash
# The main job on a fresh machine: set up, generate a project with the default answers, and train it
# on the embedded data with 2 CPU processes (FSDP2 over gloo). Offline; takes a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=$PWD/.venv
rm -rf build/demo
mkdir -p build/demo
"$VENV/bin/cookiecutter" --no-input . --output-dir build/demo
cd build/demo/my-project
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
"$VENV/bin/my-project" recipes list
"$VENV/bin/my-project" train --config recipes/cpu-debug.yaml
echo
echo "What the model writes after \"The old sailor\" (greedy, from the newest checkpoint):"
"$VENV/bin/my-project" sample runs/cpu-debug --prompt "The old sailor" --max-new-tokens 80 --temperature 0
echo
echo "Generated project:  $PWD"
echo "Checkpoints:        $PWD/runs/cpu-debug/checkpoints/"
for run in runs/cpu-debug/wandb/offline-run-*; do
  [ -e "$run" ] && echo "W&B offline run:    $PWD/$run  (upload later with: wandb sync $run)"
done
echo "Train it again and it resumes from the newest checkpoint: cd $PWD && $VENV/bin/my-project train --config recipes/cpu-debug.yaml --train.max_steps 160"
