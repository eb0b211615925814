"""pytest hooks of the project's tests (shared helpers are in helpers.py)."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without DeepSpeed (`pip install -e ".[dev]"`, e.g. on macOS) skip the tests that need it, saying how to get it."""
    if importlib.util.find_spec("deepspeed") is not None:
        return
    skip = pytest.mark.skip(reason='DeepSpeed is not installed: pip install -e ".[test]" (Linux) runs these too')
    for item in items:
        if "deepspeed" in item.nodeid.lower():
            item.add_marker(skip)
