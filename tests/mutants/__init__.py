"""Mutant check: the lossless tests must fail under deliberately broken acceptance rules
(mutants.py); `python -m tests.mutants` runs it (see __main__.py)."""
