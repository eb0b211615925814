"""{{ cookiecutter.description }}"""

# The tasks and strategy families fill the tables the layers below them look them up in (recipe/registry.py):
# importing any module of the package imports these two first. Neither imports torch.
from . import strategies, tasks  # noqa: F401

__version__ = "0.1.0"
