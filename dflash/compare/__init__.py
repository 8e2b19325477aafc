"""Many runs side by side, one library per process: sweep, matrix, the GPU check.

Docstring only: importing a module of this package loads nothing else."""
