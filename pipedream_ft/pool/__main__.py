"""``python -m pipedream_ft.pool``: the ``pipedream-pool`` command."""

import sys

from .cli import main

sys.exit(main())
