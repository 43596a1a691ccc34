"""How many conformance cases each planted broken tiled kernel fails: now
``refattn-oracle power`` (:mod:`oracle.power`); this script forwards its arguments to it.

Usage::

    python -m oracle.cli generate --suite default --out fixtures/ --workers 2
    python tools/broken_counts.py --fixtures fixtures/
    python tools/broken_counts.py --suite default --case 'k-*' --dtype float32 --list
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracle.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["power", *sys.argv[1:]]))
