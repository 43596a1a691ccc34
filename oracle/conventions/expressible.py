"""The message of a case a layout cannot carry (:mod:`oracle.conventions.layouts` and the
library layouts beside it): reports count these apart from the options a function lacks,
there being nothing the user can do about them in that layout."""

from __future__ import annotations

__all__ = ["NOT_EXPRESSIBLE"]

NOT_EXPRESSIBLE = "not expressible in this layout"
