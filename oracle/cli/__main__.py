"""``python -m oracle.cli`` is ``refattn-oracle`` (as ``python -m oracle`` is)."""

from oracle.cli import console

console()
