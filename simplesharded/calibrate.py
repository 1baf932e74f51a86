"""Old command name, kept as a pointer: ``python -m simplesharded.calibrate`` is now ``python -m simplesharded.tools.calibrate``."""
raise SystemExit("python -m simplesharded.calibrate has moved: use python -m simplesharded.tools.calibrate")
