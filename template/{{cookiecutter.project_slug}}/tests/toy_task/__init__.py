"""The toy task, a package as a task of the project is: task.py (what the machinery reads, torch-free to import),
config.py (its recipe's sections), model.py (the model and the samples), sizing.py (what `plan` reads)."""
