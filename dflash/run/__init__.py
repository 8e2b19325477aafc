"""A loaded model at work: the band planner (pure), the engine, prefill, memory, the supervisor.

Docstring only: importing a module of this package loads nothing else."""
