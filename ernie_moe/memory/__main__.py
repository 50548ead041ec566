"""``python -m ernie_moe.memory``: the memory a layout needs, before launching it (see ``report``)."""

import sys

from .report import main

sys.exit(main())
