"""Old command name, kept as a pointer: ``python -m simplesharded.checkpoint`` is now ``python -m simplesharded.trainer.export``."""
raise SystemExit("python -m simplesharded.checkpoint has moved: use python -m simplesharded.trainer.export")
