"""pytest hooks of the project's tests (shared helpers are in helpers.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import PROJECT, TOY_TASK, with_task_package


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without DeepSpeed (`pip install -e ".[dev]"`, e.g. on macOS) skip the tests that need it, saying how to get it."""
    if importlib.util.find_spec("deepspeed") is not None:
        return
    skip = pytest.mark.skip(reason='DeepSpeed is not installed: pip install -e ".[test]" (Linux) runs these too')
    for item in items:
        if "deepspeed" in item.nodeid.lower():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def toy_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's src/ copied with the toy task (tests/toy_task/) added as a package: what the machinery's
    multi-process tests run (`run_cli(..., source=toy_source)`)."""
    return with_task_package(PROJECT / "tests" / "toy_task", TOY_TASK, tmp_path_factory.mktemp("toy") / "src")


@pytest.fixture
def toy_task_here() -> Iterator[None]:
    """The toy task known to this process too (in-process commands: `plan`, `checkpoint inspect`, ...)."""
    from toy_task.task import VectorRegression

    from {{ cookiecutter.package_name }}.tasks import REGISTRY, register

    register(VectorRegression)
    yield
    REGISTRY.pop(VectorRegression.name)
