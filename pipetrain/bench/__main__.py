"""``python -m pipetrain.bench``: the same as ``pipetrain bench`` (see :mod:`pipetrain.cli.bench`)."""
from __future__ import annotations

import sys

from pipetrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
