"""The words every layer speaks: errors, settings, typed results, paths, files, stages, statistics.

Docstring only: importing a module of this package loads nothing else."""
