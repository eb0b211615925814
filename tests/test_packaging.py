"""The generated project installs like a package: a wheel or `pip install .` carries the recipe library."""

from __future__ import annotations

import shutil
import site
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import run

LIBRARY_NAMES = ("cpu-debug", "fsdp2-node", "fsdp2-multinode", "deepspeed-zero3-offload-node")


@pytest.fixture
def project_copy(default_project: Path, tmp_path: Path) -> Path:
    """A copy of the default project, so that build output stays out of the shared one."""
    return Path(shutil.copytree(default_project, tmp_path / "my-project"))


def venv(path: Path) -> Path:
    """A fresh virtual environment that sees this interpreter's packages (torch, lightning, ...); its python."""
    assert run([sys.executable, "-m", "venv", str(path)], cwd=path.parent).returncode == 0
    python = path / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=path).stdout
    # This interpreter may itself be a virtual environment: point the new one at its site-packages.
    (Path(purelib.strip()) / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def pip_install(python: Path, *args: str) -> None:
    installed = run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", *args],
        cwd=python.parent,
    )
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]


def assert_library_found_from_another_folder(python: Path, folder: Path) -> None:
    folder.mkdir()
    command = python.parent / "my-project"
    listed = run([str(command), "recipes", "list"], cwd=folder)
    assert listed.returncode == 0, listed.stderr[-2000:]
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert set(LIBRARY_NAMES) <= set(names) and len(names) >= 20, listed.stdout
    planned = run([str(command), "plan", "fsdp2-node"], cwd=folder)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "fsdp2" in planned.stdout


def test_a_regular_install_lists_the_library_from_any_folder(project_copy: Path, tmp_path: Path) -> None:
    python = venv(tmp_path / "venv")
    pip_install(python, str(project_copy))  # not editable: the package is copied into site-packages
    assert_library_found_from_another_folder(python, tmp_path / "elsewhere")


def test_the_wheel_carries_every_library_recipe(project_copy: Path, tmp_path: Path) -> None:
    built = run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(project_copy)],
        cwd=tmp_path,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("my_project-*.whl")
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    library = sorted((project_copy / "recipes").glob("*.yaml"))
    assert len(library) >= 20
    # Every recipe of the library, byte for byte, and nothing else under the package's recipes/.
    assert {name for name in names if name.startswith("my_project/recipes/")} == {
        f"my_project/recipes/{path.name}" for path in library
    }
    for path in library:
        assert archive.read(f"my_project/recipes/{path.name}") == path.read_bytes(), path.name
    assert not (project_copy / "setup.py").exists()  # pyproject.toml alone puts them there
    assert any(name.endswith("licenses/LICENSE") for name in names)
    python = venv(tmp_path / "venv")
    pip_install(python, str(wheel))
    assert_library_found_from_another_folder(python, tmp_path / "elsewhere")


def test_an_editable_install_reads_the_checkouts_recipes(project_copy: Path, tmp_path: Path) -> None:
    python = venv(tmp_path / "venv")
    pip_install(python, "-e", str(project_copy))
    (project_copy / "recipes" / "my-own.yaml").write_text("# mine: choose it to test an editable install\n")
    assert_library_found_from_another_folder(python, tmp_path / "elsewhere")
    listed = run([str(python.parent / "my-project"), "recipes", "list"], cwd=tmp_path / "elsewhere")
    assert "my-own" in listed.stdout
