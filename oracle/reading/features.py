"""The features and shape classes a case exercises: the vocabulary of the coverage table of
:class:`oracle.report.run_report.Report` and of ``--require``."""

from __future__ import annotations

__all__ = ["HEADLINE_FEATURES", "SHAPE_CLASSES", "KNOWN_FEATURES", "LONG_ROWS", "case_features"]

SHAPE_CLASSES = ("single-query", "L<S", "L=S", "L>S", "long-rows", "batched")
KNOWN_FEATURES = (
    "causal",
    "align-bottom-right",
    "window",
    "mask",
    "bias",
    "gqa",
    "softcap",
    "dropout",
    "alibi",
    "scale",
    "empty-rows-nan",
    "poison",
    "gradients",
    "sinks",
    "kv-lengths",
    "fp8",
    "sparse-indices",
    "sparse-blocks",
    "fp4",
    "sigmoid",
    "qv",
    "single-query",
    "L<S",
    "L=S",
    "L>S",
    "long-rows",
    "batched",
)

#: features whose absence from a run is reported prominently (and fails it with --require)
HEADLINE_FEATURES = ("causal", "mask", "gqa", "long-rows", "gradients")
#: S from which a case counts as "long rows"
LONG_ROWS = 512


def case_features(case, grads=False, inputs=()) -> tuple[list[str], list[str]]:
    """(features, shape classes) a case exercises, for the coverage table; ``inputs`` are the
    names of its arrays (a fixture's ``inputs``: mask, bias, alibi_slopes...).

    Features: causal, align-bottom-right, window, mask, bias, gqa, softcap, dropout, alibi,
    scale, empty-rows-nan, poison (robustness), gradients (only when ``grads`` is asked),
    sinks, kv-lengths, fp8 (float8 q, k, v with descales), fp4 (float4 k, v with block
    scales), sparse-indices, sparse-blocks, sigmoid
    (``normalizer="sigmoid"``), qv (FlashAttention 3's latent term).
    Shape classes: single-query (L = 1), L<S, L=S, L>S, long-rows (S >= 512), batched (B > 1).
    Variant cases give their function name (and gradients, when asked on a gradient case);
    refusal cases (malformed inputs, :mod:`oracle.judging.must_refuse`) give "refusal" alone.
    """
    n, options = case.shapes, case.options
    if case.function != "attention":
        return [case.function] + (["gradients"] if grads and case.grads else []), []
    if case.category == "refusal":  # malformed inputs: they test no option
        return ["refusal"], []
    features = []
    if options.get("causal"):
        features.append("causal")
    if options.get("align") == "bottom_right" and (options.get("causal") or options.get("window")):
        features.append("align-bottom-right")
    for name, feature in (
        ("window", "window"),
        ("softcap", "softcap"),
        ("dropout_p", "dropout"),
        ("scale", "scale"),
    ):
        if options.get(name):
            features.append(feature)
    for name, feature in (
        ("mask", "mask"),
        ("bias", "bias"),
        ("alibi_slopes", "alibi"),
        ("sinks", "sinks"),
        ("kv_lengths", "kv-lengths"),
        ("q_descale", "fp8"),
        ("key_indices", "sparse-indices"),
        ("key_block_indices", "sparse-blocks"),
        ("k_block_scale", "fp4"),
        ("qv", "qv"),
    ):
        if name in inputs and not (feature == "fp8" and "k_block_scale" in inputs):
            features.append(feature)
    if n.H != n.K:
        features.append("gqa")
    if options.get("empty_rows") == "nan":
        features.append("empty-rows-nan")
    if options.get("normalizer") == "sigmoid":
        features.append("sigmoid")
    if case.category == "robustness":
        features.append("poison")
    if grads and case.grads:
        features.append("gradients")
    shapes = [
        "single-query" if n.L == 1 else ("L<S" if n.L < n.S else "L=S" if n.L == n.S else "L>S")
    ]
    if n.S >= LONG_ROWS:
        shapes.append("long-rows")
    if n.batch > 1:
        shapes.append("batched")
    return features, shapes
