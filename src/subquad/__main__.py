"""``python -m subquad``: the ``subquad`` command (see :mod:`subquad.cli`)."""

import sys

from .cli import main

sys.exit(main())
