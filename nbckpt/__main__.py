"""``python -m nbckpt``: the command line (see :mod:`nbckpt.cli`)."""

import sys

from .cli import main

# Guarded: strategies that spawn a checkpoint process (dcp-async-stager) re-import the main
# module in the child, which must not run the command a second time.
if __name__ == "__main__":
    sys.exit(main())
