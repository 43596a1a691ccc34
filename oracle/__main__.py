"""``python -m oracle`` is ``refattn-oracle``."""

from oracle.cli import console

console()
