"""``python -m oracle.cli`` is ``refattn-oracle`` (as ``python -m oracle`` is)."""

import sys

from oracle.cli import main

sys.exit(main())
