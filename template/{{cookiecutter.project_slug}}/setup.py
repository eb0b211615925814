"""Packaging beyond what pyproject.toml can declare: the recipe library ships inside the package.

`recipes/` stays at the project root (to read, edit and copy); a non-editable install or a wheel
carries it as the package data `{{ cookiecutter.package_name }}/recipes/*.yaml`, so `recipes list` and
`plan <name>` find the library from any folder. pyproject's `packages.find` cannot add a package
whose folder lies outside `src/`, hence this file.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages("src"), "{{ cookiecutter.package_name }}.recipes"],
    package_dir={"": "src", "{{ cookiecutter.package_name }}.recipes": "recipes"},
    package_data={"{{ cookiecutter.package_name }}.recipes": ["*.yaml"]},
)
