"""``python -m simplesharded.trainer``: see :mod:`simplesharded.trainer.cli`."""
import sys

from simplesharded.trainer.cli import main

sys.exit(main())
