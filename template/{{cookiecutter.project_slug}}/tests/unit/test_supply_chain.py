"""What gets installed: no range admits a release an advisory names, the hash-locked test set
(requirements-test.lock) is the tested set of constraints.txt, and Dependabot updates the torch family as one."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli, which pytest and mypy install there
    import tomli as tomllib

ROOT = Path(__file__).parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Releases that must never be installed, with the advisory; pyproject.toml leaves each out beside its requirement.
EXCLUDED = {
    "lightning": ["2.6.2", "2.6.3"],  # a payload that stole credentials on import (GHSA-w37p-236h-pfx3)
    "torch": ["2.5.1"],  # torch.load(weights_only=True) could run code (CVE-2025-32434, fixed in 2.6.0)
    "tqdm": ["4.66.2"],  # command-line arguments passed to eval (CVE-2024-34062, fixed in 4.66.3)
    "jinja2": ["3.1.4", "3.1.5"],  # sandbox escapes (CVE-2024-56326, fixed in 3.1.5; CVE-2025-27516, in 3.1.6)
    "pillow": ["10.1.0", "10.2.0"],  # code run by ImageMath.eval (CVE-2023-50447), an overflow (CVE-2024-28219)
}
# torch (and the CUDA packages of its PyPI build) come from PyTorch's own index, outside the lock.
NOT_LOCKED = {"torch"}
# The interpreters the lock and CI cover: the oldest Python pyproject.toml claims and the test group's.
ENVIRONMENTS = [
    {"python_version": "3.10", "python_full_version": "3.10.16", "sys_platform": "linux"},
    {"python_version": "3.13", "python_full_version": "3.13.1", "sys_platform": "linux"},
]


def declared() -> list[Requirement]:
    """Every requirement of pyproject.toml: the dependencies and every extra's (the project's own extras aside)."""
    lines = [*PROJECT["dependencies"], *itertools.chain(*PROJECT["optional-dependencies"].values())]
    return [requirement for requirement in map(Requirement, lines) if requirement.name != PROJECT["name"]]


def extra(name: str) -> list[Requirement]:
    """An extra's requirements, the project's own extras that it names expanded."""
    found = []
    for requirement in map(Requirement, PROJECT["optional-dependencies"][name]):
        if requirement.name == PROJECT["name"]:
            found += [inner for named in sorted(requirement.extras) for inner in extra(named)]
        else:
            found.append(requirement)
    return found


def pins(text: str, environment: dict[str, str]) -> dict[str, str]:
    """The exact version of each package a constraints or lock file installs in `environment`."""
    found = {}
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" --hash")[0].strip()
        if not line or line.startswith("#"):
            continue
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(environment):
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", line
            found[canonicalize_name(requirement.name)] = specifier.version
    return found


def test_no_requirement_admits_a_release_an_advisory_names() -> None:
    checked = set()
    for requirement in declared():
        for version in EXCLUDED.get(canonicalize_name(requirement.name), []):
            assert not requirement.specifier.contains(version), f"{requirement} admits {version}"
            checked.add(requirement.name)
    assert checked >= {"lightning", "torch", "tqdm"}, checked  # the project's own dependencies are checked


@pytest.mark.parametrize("environment", ENVIRONMENTS, ids=lambda environment: environment["python_version"])
def test_the_lock_is_the_tested_set_with_a_hash_for_every_package(environment: dict[str, str]) -> None:
    lock_text = (ROOT / "requirements-test.lock").read_text()
    blocks = re.split(r"\n(?=[a-z0-9])", lock_text.split("\n# The following packages were excluded")[0])
    for block in blocks[1:]:  # after the header
        assert "--hash=sha256:" in block, f"no hash: {block.splitlines()[0]}"
    locked = pins(lock_text, environment)
    constrained = pins((ROOT / "constraints.txt").read_text(), environment)
    # Every dependency of the `test` extra, at the version constraints.txt pins.
    for requirement in [*map(Requirement, PROJECT["dependencies"]), *extra("test")]:
        name = canonicalize_name(requirement.name)
        if name in NOT_LOCKED or (requirement.marker and not requirement.marker.evaluate(environment)):
            continue
        assert name in locked, f"{requirement} is not in requirements-test.lock"
        assert locked[name] == constrained.get(name, locked[name]), (
            f"{name}: the lock has {locked[name]}, constraints.txt {constrained[name]} (bash scripts/lock.sh)"
        )
    disagree = {name: (locked[name], pin) for name, pin in constrained.items() if locked.get(name, pin) != pin}
    assert not disagree, f"lock, constraints.txt: {disagree} (bash scripts/lock.sh)"
    for name, versions in EXCLUDED.items():
        assert locked.get(name) not in versions and constrained.get(name) not in versions, name


def test_dependabot_updates_the_torch_family_together_weekly() -> None:
    config = yaml.safe_load((ROOT / ".github" / "dependabot.yml").read_text())
    updates = {update["package-ecosystem"]: update for update in config["updates"]}
    assert set(updates) == {"pip", "github-actions"}
    assert all(update["schedule"]["interval"] == "weekly" for update in updates.values())
    family = set(updates["pip"]["groups"]["torch"]["patterns"])
    assert family >= {"torch", "lightning", "torchmetrics", "torchao"}, family
