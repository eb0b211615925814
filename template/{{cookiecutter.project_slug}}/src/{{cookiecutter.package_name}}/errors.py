"""The one exception a user sees for a recipe that cannot run."""


class RecipeError(ValueError):
    """A recipe that cannot run; the message is one line that names the field and what is allowed."""
