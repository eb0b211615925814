#!/usr/bin/env bash
# The main job on a fresh machine: set up, generate a project with the default answers (or the task given:
# `bash scripts/demo.sh image_classification`), and train it with 2 CPU processes (FSDP2 over gloo) on its
# offline data: the embedded text (language_model) or scikit-learn's digits (image_classification).
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${1:-language_model}
case "$TASK" in
  language_model | image_classification) ;;
  *) echo "usage: bash scripts/demo.sh [language_model|image_classification] (got: $TASK)" >&2; exit 2 ;;
esac
# DEMO_VENV: an environment that already holds the test group (tests/test_demo.py runs the demo in one); DEMO_DIR:
# where the project is generated.
if [ -z "${DEMO_VENV:-}" ]; then
  bash scripts/setup.sh
fi
VENV=${DEMO_VENV:-$PWD/.venv}
DEMO_DIR=${DEMO_DIR:-$PWD/build/demo}
rm -rf "$DEMO_DIR"
mkdir -p "$DEMO_DIR"
"$VENV/bin/cookiecutter" --no-input . --output-dir "$DEMO_DIR" task="$TASK"
cd "$DEMO_DIR/my-project"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
"$VENV/bin/my-project" recipes list
"$VENV/bin/my-project" train --config recipes/cpu-debug.yaml
echo
if [ "$TASK" = language_model ]; then
  echo "What the model writes after \"The old sailor\" (greedy, from the newest checkpoint):"
  "$VENV/bin/my-project" sample runs/cpu-debug --prompt "The old sailor" --max_new_tokens 80 --temperature 0
  echo
  echo "The same checkpoint exported for transformers (GPT2LMHeadModel in hf-out/), greedy from the same prompt:"
  "$VENV/bin/my-project" export runs/cpu-debug hf-out
  "$VENV/bin/python" -c "
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained('hf-out')
ids = torch.tensor([list(b'The old sailor')])
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=80, do_sample=False, pad_token_id=0)
print(bytes(out[0].tolist()).decode('utf-8', errors='replace'))"
  more_steps=160
else
  echo "Its top classes for five digits saved as PNG files (a 0, 1, 2, 3 and 4):"
  "$VENV/bin/python" -c "
from PIL import Image
from sklearn.datasets import load_digits
for index in range(5):
    Image.fromarray((load_digits().images[index] * 255 / 16).astype('uint8')).save(f'digit-{index}.png')"
  "$VENV/bin/my-project" predict runs/cpu-debug digit-0.png digit-1.png digit-2.png digit-3.png digit-4.png
  more_steps=400
fi
echo
# The run's metrics drawn into one HTML file (matplotlib: the generated project's `report` extra, in setup's test group).
"$VENV/bin/my-project" report runs/cpu-debug
echo
echo "Generated project:  $PWD"
echo "Checkpoints:        $PWD/runs/cpu-debug/checkpoints/"
[ -d hf-out ] && echo "Hugging Face model: $PWD/hf-out  (transformers.AutoModelForCausalLM.from_pretrained)"
for run in runs/cpu-debug/wandb/offline-run-*; do
  [ -e "$run" ] && echo "W&B offline run:    $PWD/$run  (upload later with: wandb sync $run)"
done
echo "Train it again and it resumes from the newest checkpoint: cd $PWD && $VENV/bin/my-project train --config recipes/cpu-debug.yaml --train.max_steps $more_steps"
