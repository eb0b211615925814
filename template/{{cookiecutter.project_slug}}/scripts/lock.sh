#!/usr/bin/env bash
# Write requirements-test.lock: the `test` extra's whole closure at the versions constraints.txt pins (the rest at
# the newest the ranges allow), each with the sha256 of its files, for Python 3.10+ on every platform (uv's
# universal resolution: pip-tools locks one Python and one platform at a time). CI installs it with
# --require-hashes. Left out: torch and the CUDA packages of its PyPI build; CI installs the CPU build of torch
# from PyTorch's own index first, whose wheels differ from PyPI's (PyPI's hashes would not match them).
# After changing constraints.txt or pyproject.toml: bash scripts/lock.sh (needs uv: pip install uv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! command -v uv >/dev/null; then
  echo "scripts/lock.sh needs uv: pip install uv" >&2
  exit 2
fi
compile() {
  uv pip compile pyproject.toml --extra test -c constraints.txt --universal --python-version 3.10 \
    --generate-hashes --no-config --no-python-downloads --quiet --custom-compile-command "bash scripts/lock.sh" "$@"
}
draft=$(mktemp)
trap 'rm -f "$draft"' EXIT
compile --annotation-style line -o "$draft"
# torch, and the CUDA packages (nvidia-*, cuda-*, triton) that nothing but torch and its CUDA packages needs.
left_out=$("$PYTHON" - "$draft" <<'PY'
import re, sys

needed_by = {}
for block in re.split(r"\n(?=[a-z0-9])", open(sys.argv[1]).read()):
    name = re.match(r"[A-Za-z0-9._-]+", block)
    via = re.search(r"# via (.*)", block)
    if name and via:
        needed_by[name.group().lower()] = {item.strip() for item in via.group(1).split(",")}
left_out, grown = {"torch"}, True
while grown:
    cuda = {name for name, users in needed_by.items() if re.match(r"(nvidia-|cuda-|triton$)", name) and users <= left_out}
    grown = not cuda <= left_out
    left_out |= cuda
print(" ".join(f"--no-emit-package {name}" for name in sorted(left_out)))
PY
)
# shellcheck disable=SC2086 # one word per flag
compile $left_out -o requirements-test.lock
echo "wrote requirements-test.lock ($(grep -c '^[a-z0-9]' requirements-test.lock) packages with hashes; left out: ${left_out//--no-emit-package /})"
