"""Script entry point for launchers: `fabric run ... src/{{ cookiecutter.package_name }}/train.py --config mine.yaml`.

The loop itself is training/loop.py; `<project> train` runs the same function.
"""

from {{ cookiecutter.package_name }}.training.loop import main

if __name__ == "__main__":
    main()
