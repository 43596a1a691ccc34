"""The exact path: interval enclosures + the Ziv loop, rounded once to the target dtype."""

from .rounding import FORMATS, Format, UndecidedRoundingError, correctly_round, format_of

__all__ = ["FORMATS", "Format", "UndecidedRoundingError", "correctly_round", "format_of"]
