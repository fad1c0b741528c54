"""``python -m askonce``: the ``askonce`` command."""

import sys

from askonce.cli import main

sys.exit(main())
