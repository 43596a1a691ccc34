"""The exact path: interval enclosures + the Ziv loop, rounded once to the target dtype.

The exact twin of every concept of refattn (``attention``, ``attention_vjp``, ``logspace``,
``transformer``, ``gmm``, ``mgk``, ``hopfield``, ``meanfield``) and the machinery they share:
``rounding`` (formats, the Ziv loop), ``intervals`` and ``_fixed`` (enclosures), ``numbers``
(interval and rational number systems), ``rows`` (row-wise evaluation), ``autodiff``
(reverse-mode derivatives of row evaluators in those number systems), ``rationals`` (exact
linear algebra), ``krawczyk`` (certified zeros), ``certify`` (checking a given result).
"""

from .rounding import FORMATS, Format, UndecidedRoundingError, correctly_round, format_of

__all__ = ["FORMATS", "Format", "UndecidedRoundingError", "correctly_round", "format_of"]
