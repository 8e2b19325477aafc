"""Exactness proven and recorded: qualification records, evidence, provenance, qualify, bench,
diff, the width choice.

Docstring only: importing a module of this package loads nothing else."""
