"""``python -m nereus.cli``: the ``nereus`` command."""

import sys

from nereus.cli import main

sys.exit(main())
