"""The helper scripts of this directory (harness.py, wiring.py) import each other by plain module name."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
