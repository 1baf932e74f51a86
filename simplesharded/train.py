"""Old command name, kept as a pointer: ``python -m simplesharded.train`` is now ``python -m simplesharded.trainer``."""
raise SystemExit("python -m simplesharded.train has moved: use python -m simplesharded.trainer")
