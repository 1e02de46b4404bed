"""``python -m nbckpt``: the command line (see :mod:`nbckpt.cli`)."""

import sys

from .cli import main

sys.exit(main())
