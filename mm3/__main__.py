"""``python -m mm3 ARGS``: the ``mm3`` command, for when its console script is not on PATH."""

import sys

from mm3.cli.main import main

sys.exit(main())
