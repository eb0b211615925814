"""The image classifier's own commands: `prepare`, `predict` and `export` (ImageClassification.commands names them).

Each module has the shape of every command (commands/__init__.py): HELP, add_arguments(parser, prog), run(argv, prog).
None imports torch at the top, so `<project> --help` lists them without loading it.
"""
