"""Recipes: the schema (schema.py), reading one (load.py), every rule (checks.py), the library (library.py)."""
