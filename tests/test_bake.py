"""The template generates a clean, lint-free project for every answer, and refuses bad answers."""

from __future__ import annotations

import datetime
import itertools
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import BIN, LIBRARY, REPO, bake, run
from cookiecutter.exceptions import FailedHookException
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# GitHub Actions expressions (${{ ... }}) are meant to stay in the generated workflow.
JINJA = re.compile(r"(?<!\$)\{\{|\{%|\{#")


def text_files(project: Path) -> list[Path]:
    return [p for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def assert_fully_rendered(project: Path) -> None:
    for path in text_files(project):
        assert not JINJA.search(path.read_text()), f"unrendered template syntax in {path}"


def assert_ruff_clean(project: Path) -> None:
    lint = run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=project)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run([sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."], cwd=project)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_default_answers_give_the_documented_layout(default_project: Path) -> None:
    assert default_project.name == "my-project"
    package = default_project / "src" / "my_project"
    modules = {"cli", "errors", "precision", "project", "train"}
    assert modules <= {p.stem for p in package.glob("*.py")}
    for subpackage, members in {
        "recipe": {"schema", "load", "checks", "library"},
        "tasks": {"base"},
        "tasks/language_model": {"task", "config", "sizing", "hf", "export", "sample"},
        "tasks/language_model/families/gpt": {"model", "hf", "sizing"},
        "tasks/language_model/data": {"sources", "windows", "prepared", "prepare", "tokenizer"},
        "strategies": {"base", "ddp", "fsdp2", "fsdp", "deepspeed"},
        "training": {"run", "loop", "optim", "step_decision", "monitor"},
        "data": {"sampler"},
        "checkpoint": {"layout", "io", "rng"},
        "planner": {"plan", "report", "hardware"},
        "cluster": {"launchers", "preemption", "slurm", "submit"},
    }.items():
        assert members <= {p.stem for p in (package / subpackage).glob("*.py")}, subpackage
    for extra in (
        *("pyproject.toml", "constraints.txt", "README.md", "LICENSE", ".gitignore"),
        *(".pre-commit-config.yaml", ".github/workflows/ci.yml", "scripts/slurm/train.sbatch"),
        *("mkdocs.yml", "docs/index.md", "docs/hooks/reference.py"),
        *("requirements-test.lock", "scripts/lock.sh", ".github/dependabot.yml"),
    ):
        assert (default_project / extra).is_file(), extra
    assert not (default_project / "locks").exists()  # the task's lock is requirements-test.lock, the other's gone
    assert not (default_project / "setup.py").exists()  # pyproject.toml alone builds it
    assert 'DEFAULT_LOGGER = "wandb"' in (package / "project.py").read_text()
    assert "= DEFAULT_LOGGER" in (package / "recipe" / "schema.py").read_text()  # the logger section's default


def test_the_recipe_library_is_copied_verbatim(default_project: Path) -> None:
    library = sorted((LIBRARY / "language_model").glob("*.yaml"))  # the default task's
    assert len(library) >= 5
    for recipe in library:
        assert (default_project / "recipes" / recipe.name).read_bytes() == recipe.read_bytes()


TASKS = ("language_model", "image_classification")
# Every logger and SLURM answer, each baked with each task at least once (the tasks alternate).
CHOICES = [
    (logger, slurm, TASKS[index % 2])
    for index, (logger, slurm) in enumerate(itertools.product(["wandb", "tensorboard", "csv"], ["yes", "no"]))
]


def assert_only_the_task_is_there(project: Path, task: str) -> None:
    """The chosen task's package, recipes and tests, and nothing of the other task's."""
    tasks = project / "src" / "my_project" / "tasks"
    assert {path.name for path in tasks.iterdir() if path.is_dir() and path.name != "__pycache__"} == {task}
    recipes = sorted((project / "recipes").glob("*.yaml"))
    assert [path.name for path in recipes] == sorted(path.name for path in (LIBRARY / task).glob("*.yaml"))
    assert not [path for path in (project / "recipes").iterdir() if path.is_dir()]  # no task's folder is left
    assert all(f"task: {task}" in path.read_text() for path in recipes)
    task_tests = {"language_model": "test_llama.py", "image_classification": "test_image_classification.py"}
    assert [path.name for path in (project / "tests" / "tasks").iterdir()] == [task]  # a task's tests: one folder
    assert (project / "tests" / "tasks" / task / task_tests[task]).is_file()
    assert (project / "docs" / "fine-tuning.md").is_file() == (task == "language_model")  # a page per task topic


def documentation(project: Path) -> str:
    """The project's documentation as one text: the README, then the pages of docs/."""
    pages = sorted((project / "docs").rglob("*.md"))
    return "\n".join(path.read_text() for path in [project / "README.md", *pages])


# The code that writes or submits SLURM jobs: its modules, and what names them or the job scripts.
SLURM_MODULES = ("commands/slurm.py", "commands/submit.py", "cluster/slurm.py", "cluster/submit.py")
SLURM_WRITERS = re.compile(r"sbatch|slurm\.py|submit\.py|import submitit|submitit[>=<]")


def assert_slurm_writers_only_if_chosen(project: Path, include_slurm: bool) -> None:
    """Without SLURM the project neither writes nor submits a SLURM job: no module of it, no command, no line of
    src/, tests/ or pyproject.toml naming an sbatch script, those modules or the submitit package. (A run under
    srun is still recognised: Fabric's rank variables, the requeue of a preempted job stay.)"""
    package = project / "src" / "my_project"
    assert [(package / name).is_file() for name in SLURM_MODULES] == [include_slurm] * len(SLURM_MODULES)
    listed = run([sys.executable, "-m", "my_project", "--help"], cwd=project, PYTHONPATH=str(project / "src"))
    assert listed.returncode == 0, listed.stderr
    offered = set(re.findall(r"^\s{4}(\w+)\s", listed.stdout, re.M))
    assert {"train", "k8s", "ray"} <= offered and ({"slurm", "submit"} <= offered) == include_slurm, listed.stdout
    if not include_slurm:
        files = [*text_files(package), *text_files(project / "tests"), project / "pyproject.toml"]
        naming = [str(p.relative_to(project)) for p in files if SLURM_WRITERS.search(p.read_text())]
        assert not naming, naming


# Whose quick tests CI runs: the other loggers, each task, SLURM on and off (the default answers' language-model
# project runs its own in test_generated_project.py, the image classifier's its task's only: the machinery's run on
# the image bake here); the other combinations' quick tests under `scripts/test.sh --full`.
QUICK_IN_CI = {("tensorboard", "no", "image_classification"), ("csv", "yes", "language_model")}
# What an answer changes is the machinery's (the default logger, the SLURM modules): in CI these bakes run the
# machinery's quick tests, which train the toy task; a task's own tests do not depend on the answers and run in the
# default answers' projects. `scripts/test.sh --full` runs every combination's whole quick selection.
MACHINERY_TESTS = ["tests/unit", "tests/e2e"]


@pytest.mark.parametrize(("logger", "include_slurm", "task"), CHOICES)
def test_every_choice_renders_and_lints(tmp_path: Path, logger: str, include_slurm: str, task: str) -> None:
    project = bake(tmp_path, logger=logger, include_slurm=include_slurm, task=task)
    assert_fully_rendered(project)
    assert_only_the_task_is_there(project, task)
    assert_ruff_clean(project)
    assert (project / "scripts" / "slurm" / "train.sbatch").exists() == (include_slurm == "yes")
    assert ("sbatch" in documentation(project)) == (include_slurm == "yes")
    assert_slurm_writers_only_if_chosen(project, include_slurm == "yes")
    facts = (project / "src" / "my_project" / "project.py").read_text()
    assert re.search(rf'^DEFAULT_LOGGER = "{logger}"', facts, re.M)


@pytest.mark.parametrize(
    ("logger", "include_slurm", "task"),
    [choice if choice in QUICK_IN_CI else pytest.param(*choice, marks=pytest.mark.full) for choice in CHOICES],
)
def test_every_choice_passes_its_quick_tests(
    tmp_path: Path, logger: str, include_slurm: str, task: str, request: pytest.FixtureRequest
) -> None:
    project = bake(tmp_path, logger=logger, include_slurm=include_slurm, task=task)
    whole = request.config.getoption("markexpr", "") != "not full"  # scripts/test.sh --full
    selection = [] if whole else MACHINERY_TESTS
    quick = run(
        [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", *selection], cwd=project
    )
    assert quick.returncode == 0, quick.stdout[-3000:] + quick.stderr[-2000:]
    assert " passed" in quick.stdout and not re.search(r"\b\d+ skipped\b", quick.stdout), quick.stdout[-500:]


@pytest.mark.parametrize("task", TASKS)
def test_custom_names_flow_into_package_command_and_imports(tmp_path: Path, task: str) -> None:
    project = bake(tmp_path, project_name="Deep Net 2", author="Ada O'Neil", description="Trains it.", task=task)
    assert project.name == "deep-net-2"
    assert (project / "src" / "deep_net_2" / "train.py").is_file()
    assert 'deep-net-2 = "deep_net_2.cli:main"' in (project / "pyproject.toml").read_text()
    assert_fully_rendered(project)
    assert_ruff_clean(project)
    listed = run([sys.executable, "-m", "deep_net_2", "recipes", "list"], cwd=project, PYTHONPATH=str(project / "src"))
    assert listed.returncode == 0 and "cpu-debug" in listed.stdout, listed.stderr


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ({"package_name": "2fast"}, "package_name '2fast' is not a valid Python package name"),
        ({"package_name": "class"}, "package_name 'class' is not a valid Python package name"),
        ({"project_slug": "team/project"}, "project_slug 'team/project' is not a valid folder"),
        ({"description": 'say "hi"'}, "description"),
    ],
)
def test_invalid_answers_stop_generation_with_a_message(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], answers: dict[str, str], message: str
) -> None:
    with pytest.raises(FailedHookException):
        bake(tmp_path, **answers)
    assert message in capfd.readouterr().err
    # cookiecutter itself may leave an empty parent folder of a slug with '/'; no file may remain.
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "a refused project must leave nothing behind"


def test_command_line_no_input_generates_the_default_project(tmp_path: Path) -> None:
    result = run(
        [str(Path(sys.executable).parent / "cookiecutter"), "--no-input", str(REPO), "-o", str(tmp_path)], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "my-project" / "recipes" / "cpu-debug.yaml").is_file()


@pytest.mark.parametrize(("answer", "value"), [("logger", "mlflow"), ("license", "GPL-3.0"), ("task", "speech")])
def test_unknown_choice_is_refused(tmp_path: Path, answer: str, value: str) -> None:
    with pytest.raises(ValueError, match=answer):
        bake(tmp_path, **{answer: value})


def test_every_recipe_says_when_to_choose_it() -> None:
    for recipe in sorted(LIBRARY.glob("*/*.yaml")):
        header = recipe.read_text().splitlines()[:2]
        assert all(line.startswith("# ") for line in header), recipe.name
        assert "choose" in " ".join(header).lower(), recipe.name


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize(
    ("license_id", "first_line", "copyright_line"),
    [
        ("MIT", "MIT License", "Copyright (c) {year} Ada O'Neil"),
        ("Apache-2.0", "Apache License", "Copyright {year} Ada O'Neil"),
        ("BSD-3-Clause", "BSD 3-Clause License", "Copyright (c) {year}, Ada O'Neil"),
    ],
)
def test_the_chosen_license_is_written_in_full_and_declared(
    tmp_path: Path, license_id: str, first_line: str, copyright_line: str, task: str
) -> None:
    project = bake(tmp_path, license=license_id, author="Ada O'Neil", task=task)
    text = (project / "LICENSE").read_text()
    year = str(datetime.datetime.now(datetime.UTC).year)
    assert text.strip().splitlines()[0].strip() == first_line
    assert copyright_line.format(year=year) in text
    assert len(text) > {"MIT": 1000, "Apache-2.0": 11000, "BSD-3-Clause": 1400}[license_id]  # the full text
    assert "[yyyy]" not in text and "{{" not in text
    project_table = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert project_table["license"] == license_id
    assert project_table["license-files"] == ["LICENSE"]


@pytest.mark.parametrize("task", TASKS)
def test_license_none_writes_no_license_file_and_declares_none(tmp_path: Path, task: str) -> None:
    project = bake(tmp_path, license="none", task=task)
    assert_fully_rendered(project)
    assert not (project / "LICENSE").exists()
    assert "license" not in tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert_ruff_clean(project)


def test_the_template_repository_itself_is_mit_licensed() -> None:
    assert (REPO / "LICENSE").read_text().startswith("MIT License\n")


def test_gitignore_keeps_run_output_builds_and_caches_out_of_git(default_project: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(default_project, project)
    ignored = [
        "runs/cpu-debug/checkpoints/step-00000010/meta.json",
        "wandb/offline-run-1/run.wandb",
        "logs/train-1.out",
        "build/lib/my_project/cli.py",
        "dist/my_project-0.1.0-py3-none-any.whl",
        "src/my_project.egg-info/PKG-INFO",
        ".venv/bin/python",
        "src/my_project/__pycache__/cli.cpython-311.pyc",
        ".pytest_cache/README.md",
        ".ruff_cache/CACHEDIR.TAG",
        ".mypy_cache/CACHEDIR.TAG",
        "data/prepared/train.bin",
        "model.pt",
        "site/index.html",
    ]
    for name in ignored:
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("x")
    assert run(["git", "init", "-q"], cwd=project).returncode == 0
    status = run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored=no"], cwd=project).stdout
    listed = {line[3:] for line in status.splitlines()}
    assert not [name for name in ignored if name in listed]
    for kept in (
        "src/my_project/cli.py",
        "recipes/cpu-debug.yaml",
        "pyproject.toml",
        "constraints.txt",
        "LICENSE",
        "docs/index.md",
    ):
        assert kept in listed, kept


def root_test_group() -> dict[str, str]:
    """The exact versions of the template repository's test group (and of its float8 group, torchao, which the
    tests leave out of their environment), by normalised package name."""
    groups = tomllib.loads((REPO / "pyproject.toml").read_text())["dependency-groups"]
    pins = {}
    for line in [*groups["test"], *groups["float8"]]:
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", line
        pins[canonicalize_name(requirement.name)] = specifier.version
    return pins


@pytest.mark.parametrize("project", ["default_project", "image_project"])
def test_constraints_pin_exactly_the_versions_the_template_tests_ran_with(
    project: str, request: pytest.FixtureRequest
) -> None:
    default_project: Path = request.getfixturevalue(project)  # each task declares its own dependencies
    pins, seen = root_test_group(), set()
    for line in (default_project / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", line
        if requirement.marker is None or requirement.marker.evaluate():  # the test group's Python
            name = canonicalize_name(requirement.name)
            assert pins.get(name) == specifier.version, f"{line}: the test group has {pins.get(name)}"
            seen.add(name)
    # Every dependency and extra of the generated project is pinned.
    project_table = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]
    declared = [*project_table["dependencies"], *itertools.chain(*project_table["optional-dependencies"].values())]
    names = {canonicalize_name(Requirement(line).name) for line in declared} - {"my-project"}
    assert names <= seen, names - seen


def test_dependencies_are_ranges_bounded_above_where_private_apis_are_used(default_project: Path) -> None:
    project_table = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]
    requirements = {
        canonicalize_name(Requirement(line).name): Requirement(line) for line in project_table["dependencies"]
    }
    extras = project_table["optional-dependencies"]
    requirements["deepspeed"] = Requirement(extras["deepspeed"][0])
    for name in ("torch", "lightning", "jsonargparse", "deepspeed"):
        operators = {spec.operator for spec in requirements[name].specifier} - {"!="}  # != : releases left out
        assert operators == {">=", "<"}, requirements[name]
    pins = root_test_group()
    for name, requirement in requirements.items():
        assert requirement.specifier.contains(pins[name]), f"{requirement} excludes the tested {name}=={pins[name]}"
    # Each feature's extra (the tools of `dev` aside) is bounded above and holds the tested version.
    for extra in set(extras) - {"dev", "test"}:
        for requirement in map(Requirement, extras[extra]):
            assert "<" in {spec.operator for spec in requirement.specifier}, f"{extra}: {requirement}"
            assert requirement.specifier.contains(pins[canonicalize_name(requirement.name)]), f"{extra}: {requirement}"
    # `dev` works on any OS: no DeepSpeed; `test` adds it on Linux.
    assert not any(line.startswith("deepspeed") for line in extras["dev"])
    assert any(line.startswith("deepspeed") and "linux" in line for line in extras["test"])


@pytest.mark.parametrize(("logger", "needed"), [("wandb", "wandb"), ("csv", None)])
def test_only_the_chosen_logger_is_a_hard_dependency(tmp_path: Path, logger: str, needed: str | None) -> None:
    project = bake(tmp_path, logger=logger)
    project_table = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    names = {canonicalize_name(Requirement(line).name) for line in project_table["dependencies"]}
    assert names & {"wandb", "tensorboard"} == ({needed} if needed else set())
    # The other loggers are extras of their name; the default one is not also an extra.
    loggers = {"wandb", "tensorboard"} - names
    assert set(project_table["optional-dependencies"]) & {"wandb", "tensorboard"} == loggers
    readme = (project / "README.md").read_text()
    (row,) = [line for line in readme.splitlines() if "the other logger" in line]
    assert set(re.findall(r"`(\w+)`", row.split("|")[1])) == loggers, row


@pytest.mark.parametrize("project", ["default_project", "image_project"])
def test_the_readme_extras_table_lists_every_extra(project: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(project)
    extras = set(tomllib.loads((folder / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    table = (folder / "README.md").read_text().split("| extra | what | when |\n")[1].split("\n\n")[0]
    rows = table.splitlines()[1:]  # below the | --- | line
    assert {name for row in rows for name in re.findall(r"`([\w-]+)`", row.split("|")[1])} == extras, table


def test_generated_ci_lints_type_checks_and_tests_on_the_oldest_and_newest_python(default_project: Path) -> None:
    workflow = yaml.safe_load((default_project / ".github" / "workflows" / "ci.yml").read_text())
    classifiers = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]["classifiers"]
    claimed = sorted(
        (line.rsplit(" :: ", 1)[1] for line in classifiers if re.search(r"Python :: 3\.\d+$", line)),
        key=lambda version: int(version.split(".")[1]),
    )
    job = workflow["jobs"]["test"]
    assert job["strategy"]["matrix"]["python-version"] == [claimed[0], claimed[-1]]
    steps = [step.get("run", "") for step in job["steps"]]
    assert job["steps"][1]["with"]["python-version"] == "${{ matrix.python-version }}"
    # CPU torch from PyTorch's index, then the hash-locked test set, then the project without resolving again.
    installs = [step for step in steps if step.startswith("pip install")]
    assert installs == [
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        "pip install --require-hashes -r requirements-test.lock",
        "pip install --no-deps -e .",
    ], installs
    for command in ("ruff check", "ruff format --check", "mypy", "pytest"):
        assert any(command in step for step in steps), command
    readme = (default_project / "README.md").read_text()
    assert 'pip install -e ".[dev]" -c constraints.txt' in readme
    assert workflow["permissions"] == {"contents": "read"}
    checkout, setup_python = job["steps"][:2]
    assert checkout["with"]["persist-credentials"] is False
    assert setup_python["with"]["cache"] == "pip"
    assert set(setup_python["with"]["cache-dependency-path"].split()) == {"pyproject.toml", "requirements-test.lock"}


# Each action pinned to a full commit hash, the release it is in named beside it.
PINNED_ACTION = re.compile(
    r"^\s*- uses: (?P<action>[\w-]+/[\w-]+)@(?P<commit>[0-9a-f]{40}) # v(?P<major>\d+)\.\d+\.\d+$"
)
CURRENT_MAJOR = {"actions/checkout": 7, "actions/setup-python": 7}  # the majors that run on Node 24


@pytest.mark.parametrize("workflow", ["generated", "template"])
def test_workflows_pin_current_actions_to_commits_and_pass_the_actions_audits(
    default_project: Path, workflow: str
) -> None:
    path = {"generated": default_project, "template": REPO}[workflow] / ".github" / "workflows" / "ci.yml"
    uses = [line for line in path.read_text().splitlines() if "uses:" in line]
    pins = [PINNED_ACTION.match(line) for line in uses]
    assert all(pins), uses
    assert {pin["action"]: int(pin["major"]) for pin in pins if pin} == CURRENT_MAJOR
    audit = run(
        [str(BIN / "zizmor"), "--offline", "--no-config", "--min-severity", "medium", str(path)], cwd=path.parent
    )
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-2000:]
    schema = run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(path)], cwd=path.parent
    )
    assert schema.returncode == 0, schema.stdout[-3000:] + schema.stderr[-2000:]
    if workflow == "generated":  # its Dependabot configuration, against the published schema too
        dependabot = default_project / ".github" / "dependabot.yml"
        schema = run(
            [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.dependabot", str(dependabot)], cwd=REPO
        )
        assert schema.returncode == 0, schema.stdout[-3000:] + schema.stderr[-2000:]


def test_pre_commit_runs_the_ruff_of_the_tested_set(default_project: Path) -> None:
    config = yaml.safe_load((default_project / ".pre-commit-config.yaml").read_text())
    (ruff,) = [repo for repo in config["repos"] if "ruff-pre-commit" in repo["repo"]]
    assert ruff["rev"] == f"v{root_test_group()['ruff']}"
    assert {hook["id"] for hook in ruff["hooks"]} == {"ruff-check", "ruff-format"}
    validated = run([str(BIN / "pre-commit"), "validate-config", ".pre-commit-config.yaml"], cwd=default_project)
    assert validated.returncode == 0, validated.stdout[-3000:] + validated.stderr[-2000:]


def test_the_generated_package_passes_mypy(default_project: Path) -> None:
    checked = run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", "/dev/null"], cwd=default_project)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-2000:]
    assert "Success" in checked.stdout


README_LINES = 300  # one screen; the generated project's documentation goes on in its docs/


@pytest.mark.parametrize("project", ["default_project", "image_project"])
def test_both_readmes_are_one_screen_and_point_to_the_documentation(
    project: str, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(project)
    for readme in (REPO / "README.md", folder / "README.md"):
        lines = readme.read_text().splitlines()
        assert len(lines) <= README_LINES, f"{readme}: {len(lines)} lines"
    assert "docs/" in (REPO / "README.md").read_text()
    readme = (folder / "README.md").read_text()
    pages = {path.relative_to(folder).as_posix() for path in (folder / "docs").glob("*.md")}
    linked = set(re.findall(r"\]\((docs/[\w./-]+\.md)\)", readme))
    assert linked == pages, (
        f"pages the README does not link: {sorted(pages - linked)}; missing: {sorted(linked - pages)}"
    )
