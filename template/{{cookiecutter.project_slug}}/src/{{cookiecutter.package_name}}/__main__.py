"""`python -m <package>` runs the command line."""

from .cli import main

main()
