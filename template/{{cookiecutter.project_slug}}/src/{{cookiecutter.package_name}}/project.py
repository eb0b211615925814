"""What the project is: the answers it was generated with. Every other module reads them from here."""

PROJECT = "{{ cookiecutter.project_slug }}"  # the command's name and the distribution's
TASK = "{{ cookiecutter.task }}"  # what the project trains: the task its commands, `--help` and recipes default to
DEFAULT_LOGGER = "{{ cookiecutter.logger }}"  # the experiment logger that is a dependency (the others are extras)
