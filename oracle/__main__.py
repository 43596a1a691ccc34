"""``python -m oracle`` is ``refattn-oracle``."""

import sys

from .cli import main

sys.exit(main())
