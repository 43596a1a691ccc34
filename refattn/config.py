"""Named defaults and thresholds of refattn (no magic numbers elsewhere)."""

#: Bits above the target format's precision at which the Ziv loop starts.
ZIV_GUARD_BITS = 40

#: Largest working precision (bits) of the Ziv loop before an exact fallback is required.
#: Results that underflow in float64 need about 1100 bits; this leaves ample room.
ZIV_MAX_PREC = 1 << 14

#: Extra bits mpmath elementary functions are evaluated with before the enclosure is widened
#: outward by two units in the last place (guards against a last-bit error in libmp).
ELEMENTARY_GUARD_BITS = 8

#: Default float dtype of exact-path outputs.
DEFAULT_OUT_DTYPE = "float64"

#: Engine of ``precision="exact"`` attention forward: "fast" (compiled double-double first
#: step, rows it cannot decide go to the referee) or "referee" (the arbitrary-precision engine
#: alone). Both give bit-identical results; "referee" is for tests and benchmarks.
EXACT_ENGINE = "fast"

#: How the fast exact forward reads set-read sparse key indices (``key_indices``,
#: ``key_block_indices``): "gather" (each row visits only its listed keys,
#: :mod:`refattn.exact.fast.gather`; no (L, S) plane) or "mask" (the listed set ANDed into a
#: dense mask, every key of each row's interval walked). Both give bit-identical results.
#: The exact ``attention_vjp`` reads them the same way: "gather" runs it on the listed keys
#: compacted (:mod:`refattn.exact.fast.vjp_gather`; without bias or ALiBi), "mask" on all S.
EXACT_SPARSE_KEYS = "gather"

#: Engine of precision="exact" attention_vjp: "fast" (double-double enclosures with rigorous
#: bounds, undecided elements re-evaluated by the referee) or "referee" (the arbitrary-precision
#: Ziv loop on every element). Both give the same bits.
EXACT_VJP_ENGINE = "fast"

#: Engine of precision="exact" linear_attention: "fast" (a compiled double-double first step
#: decides most elements; the (sequence, value head) rows holding an undecided element go to the
#: arbitrary-precision referee) or "referee" (the referee on every row). Both give the same bits.
LINEAR_EXACT_ENGINE = "fast"

#: Engine of precision="exact" sigmoid attention (``normalizer="sigmoid"``) forward: "fast" (a
#: compiled double-double first step decides most rows; the undecided rows go to the
#: arbitrary-precision referee) or "referee" (the referee on every row). Both give the same bits.
SIGMOID_EXACT_ENGINE = "fast"

#: The epsilon inside the root of linear attention's q/k normalisation,
#: ``x / sqrt(sum x^2 + eps)`` (flash-linear-attention's ``l2norm``; the float64 number 1e-6).
LINEAR_L2NORM_EPS = 1e-6
