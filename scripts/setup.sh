#!/usr/bin/env bash
# Make .venv with everything the template, its tests and the generated project need. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade "pip>=25.1"
# torch first and pinned exactly: a looser requirement lets pip choose a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check --group test
