"""``python -m interlace.engine_ext.sim``: the ``interlace sim`` command."""

import sys

from .cli import main

sys.exit(main())
