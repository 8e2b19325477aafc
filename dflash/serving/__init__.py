"""llama-server kept exact: configurations, the server process and its HTTP client, workloads,
serve records, the serving check.

Docstring only: importing a module of this package loads nothing else."""
