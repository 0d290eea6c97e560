"""Test this source tree, not whatever copy of the plugin happens to be installed.

``pip install -e .`` makes this unnecessary; it keeps ``pytest tests`` honest
after a plain ``pip install .`` too.  Nothing here needs torch: the plugin and
its tests import only the public ``interlace`` package.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
