"""Old command name, kept as a pointer: ``python -m simplesharded.plan`` is now ``python -m simplesharded.tools.forecast``."""
raise SystemExit("python -m simplesharded.plan has moved: use python -m simplesharded.tools.forecast")
