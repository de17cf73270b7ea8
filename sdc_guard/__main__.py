"""``python -m sdc_guard`` is ``sdc-guard``."""

import sys

from .cli import main

sys.exit(main())
