#!/usr/bin/env bash
# Set up (same as the demo), then run the whole test suite: the template is baked with every choice
# of every prompt, and the generated project's own tests run, including 2-process training on CPU.
# `--full` adds the broader matrix (the image classifier's project runs the machinery's multi-process tests too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = --full ]; then
  shift
  set -- -m "" "$@"
fi
.venv/bin/python -m pytest "$@"
