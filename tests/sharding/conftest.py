"""The helper scripts of this directory (harness.py, subprocess_util.py) are imported by plain module name."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
