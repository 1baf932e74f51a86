"""``python -m simplesharded.trainer``: see :mod:`simplesharded.trainer.cli`."""
from simplesharded.mesh import exit_rank
from simplesharded.trainer.cli import main

# Not sys.exit: interpreter shutdown under gloo's threads, which outlive the process group, can
# abort a rank that trained to the end, and torchrun then reports the run failed (exit_rank).
exit_rank(main())
