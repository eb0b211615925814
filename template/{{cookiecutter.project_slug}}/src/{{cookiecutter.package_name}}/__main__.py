"""`python -m {{ cookiecutter.package_name }}` runs the command line."""

from {{ cookiecutter.package_name }}.cli import main

main()
