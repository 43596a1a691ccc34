"""``python -m oracle`` is ``refattn-oracle``."""

import sys

from oracle.cli import main

sys.exit(main())
