"""Old private name of :mod:`refattn.broadcast`, kept only so modules that other branches of
issue 21 move or split still import while those branches merge. Import :mod:`refattn.broadcast`;
delete this file once ``grep -rn _broadcast refattn oracle tools tests`` finds nothing."""

from .broadcast import expand_kv, fold_kv, reduce_to

__all__ = ["reduce_to", "expand_kv", "fold_kv"]
