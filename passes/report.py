"""Old command name, kept as a pointer: ``python -m simplesharded.passes.report`` is now ``python -m simplesharded.tools.report``."""
raise SystemExit("python -m simplesharded.passes.report has moved: use python -m simplesharded.tools.report")
