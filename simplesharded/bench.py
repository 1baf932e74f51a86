"""Old command name, kept as a pointer: ``python -m simplesharded.bench`` is now ``python -m simplesharded.tools.bench``."""
raise SystemExit("python -m simplesharded.bench has moved: use python -m simplesharded.tools.bench")
