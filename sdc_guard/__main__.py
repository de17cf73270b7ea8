"""``python -m sdc_guard`` is ``sdc-guard``."""

import sys

from .tools.cli import main

sys.exit(main())
