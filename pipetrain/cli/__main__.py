"""``python -m pipetrain.cli``: the same as ``pipetrain``."""
from __future__ import annotations

import sys

from pipetrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
