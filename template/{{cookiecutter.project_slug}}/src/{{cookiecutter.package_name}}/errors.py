"""The exceptions a user sees: a recipe that cannot run, and a run that stopped on purpose."""


class RecipeError(ValueError):
    """A recipe that cannot run; the message is one line that names the field and what is allowed."""


class TrainingStopped(Exception):
    """Training stopped before max_steps on purpose (preempted, or a non-finite loss); the message is one line."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
