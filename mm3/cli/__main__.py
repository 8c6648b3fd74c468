"""``python -m mm3.cli``: the ``mm3`` command where its console script is not on PATH."""

import sys

from mm3.cli.main import main

sys.exit(main())
