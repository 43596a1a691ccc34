"""Named alternatives of latent attention (docs/conventions.md, "Latent attention"): the
scale of the key width instead of the model's (MLA's 576 vs 192) and a missing ``qv`` term.

Hooked into :func:`oracle.diagnose.diagnosis.alternatives`."""

from __future__ import annotations

import math

__all__ = ["latent_alternatives"]


def latent_alternatives(options, *, D, E, alternative, set_options) -> list:
    """The latent alternatives of a case with these options (D the width of q and k, E of v);
    ``alternative`` is :class:`oracle.diagnose.diagnosis.Alternative`, ``set_options`` its
    ``_set``."""
    found = []
    scale, qv = options.get("scale"), options.get("qv")
    width = D + (E if qv is not None else 0)
    if scale is not None and not math.isclose(scale, 1 / math.sqrt(width), rel_tol=1e-12):
        found.append(
            alternative(
                f"scale of the key width 1/sqrt({width}) instead of the given {scale:.6g} "
                f"(MLA: the model's head dim, e.g. 1/sqrt(192), not 1/sqrt(576))",
                frozenset({"scale"}),
                set_options(scale=1 / math.sqrt(width)),
            )
        )
    if qv is None:
        return found
    used = 1 / math.sqrt(D + E) if scale is None else scale
    found.append(
        alternative(
            "qv term missing (scores s q.k without s qv.v)",
            frozenset({"qv"}),
            set_options(qv=None, scale=used),
        )
    )
    if scale is None:
        found.append(
            alternative(
                f"qv ignored with q's own scale 1/sqrt({D})",
                frozenset({"qv", "scale"}),
                set_options(qv=None, scale=1 / math.sqrt(D)),
            )
        )
        found.append(
            alternative(
                f"scale 1/sqrt({D}) of q alone instead of 1/sqrt(D + E) = 1/sqrt({D + E})",
                frozenset({"scale"}),
                set_options(scale=1 / math.sqrt(D)),
            )
        )
    return found
