"""Reject answers that would generate a broken project, with one line saying what is allowed."""

import keyword
import re
import sys

# tojson renders every answer as a valid Python string literal, whatever characters it holds.
ANSWERS = {
    "project_slug": {{ cookiecutter.project_slug | tojson }},
    "package_name": {{ cookiecutter.package_name | tojson }},
    "author": {{ cookiecutter.author | tojson }},
    "description": {{ cookiecutter.description | tojson }},
    "license": {{ cookiecutter.license | tojson }},
    "logger": {{ cookiecutter.logger | tojson }},
    "include_slurm": {{ cookiecutter.include_slurm | tojson }},
    "task": {{ cookiecutter.task | tojson }},
}
TASKS = ("language_model", "image_classification")
LICENSES = ("MIT", "Apache-2.0", "BSD-3-Clause", "none")
SLUG = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
PACKAGE = re.compile(r"^[a-z_][a-z0-9_]*$")


def problems(answers: dict[str, str]) -> list[str]:
    """Return one message per invalid answer."""
    found = []
    slug, package = answers["project_slug"], answers["package_name"]
    if not SLUG.match(slug):
        found.append(
            f"project_slug {slug!r} is not a valid folder and command name: use lowercase letters,"
            " digits, '-', '_' or '.', starting with a letter or digit (no path separators or spaces)"
        )
    if not PACKAGE.match(package) or keyword.iskeyword(package):
        found.append(
            f"package_name {package!r} is not a valid Python package name: use lowercase letters,"
            " digits and '_', not starting with a digit, and not a Python keyword"
        )
    for name in ("author", "description"):  # they land in TOML and Python string literals
        value = answers[name]
        if any(char in value for char in '"\\\n'):
            found.append(f"{name} {value!r} may not contain double quotes, backslashes or line breaks")
    if answers["license"] not in LICENSES:
        found.append(f"license {answers['license']!r} is not one of: {', '.join(LICENSES)}")
    if answers["logger"] not in ("wandb", "tensorboard", "csv"):
        found.append(f"logger {answers['logger']!r} is not one of: wandb, tensorboard, csv")
    if answers["task"] not in TASKS:
        found.append(f"task {answers['task']!r} is not one of: {', '.join(TASKS)}")
    if answers["include_slurm"] not in ("yes", "no"):
        found.append(f"include_slurm {answers['include_slurm']!r} is not one of: yes, no")
    return found


if __name__ == "__main__":
    errors = problems(ANSWERS)
    for error in errors:
        print(f"ERROR: {error}", file=sys.stderr)
    sys.exit(1 if errors else 0)
