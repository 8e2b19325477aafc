"""Model files: GGUF metadata and the tiny DeepSeek-V4 model writer.

Docstring only: importing a module of this package loads nothing else."""
