"""Convention diagnosis: which named alternative semantics does a failing output match?

When a case fails, the oracle re-evaluates the truth in float64 under each *named alternative*
of the conventions pinned in docs/conventions.md and reports those the implementation's output
fits within the case's own threshold (:mod:`oracle.judging.tolerance`, (T2)). These are the
silent mismatches that fill peers' issue trackers:

=================================  ==========================================================
label                              alternative
=================================  ==========================================================
``align='bottom_right'`` (etc.)    causal/window alignment flipped (flash-attention #951)
``gqa='tile'`` (etc.)              query head h reads kv head h % K instead of h // G
``softcap after bias``             ``c tanh((t + bias + alibi)/c)`` (onnx #7865)
``softcap after mask``             excluded positions enter tanh as -inf and come out as ``-c``:
                                   they stay in the softmax with weight ``~exp(-c)``
``empty_rows='nan'`` (etc.)        fully-masked rows NaN instead of 0 (pytorch #103749)
``fully masked rows average ...``  masking by ``finfo.min`` instead of removing: a row with
                                   no allowed key averages every value (JAX, many kernels)
``mask polarity inverted``         True = masked out
``dropout without 1/(1-p)``        kept weights not rescaled
``dropout_mask polarity inverted`` True = dropped
``scale 1/sqrt(E)``                the value size instead of the key size
``no scale``                       scale = 1
``window=(l+-1, r)`` (etc.)        inclusive/exclusive window bounds
``causal excludes the diagonal``   ``j < i + offset`` (and the converse, one key more)
``bias ignored``, ``ALiBi ignored`` the additive term dropped
``sinks ignored``                  no sink term in the normaliser
``kv_lengths as a key-padding      causal/window aligned to the padded S (a padding mask)
mask``                             instead of each row's own length (FlashAttention's
                                   KV-cache reading, which refattn pins)
=================================  ==========================================================

Single alternatives are tried first; when none fits, pairs (lowerings often get several wrong
at once, tracel-ai/burn #5783). The alternatives are evaluated by
:func:`oracle.reading.baseline.textbook_attention` in float64, whose own error is at most the
float64 floor of (T5); that floor is added to the case threshold.

Examples
--------
>>> import numpy as np
>>> from oracle.diagnose.diagnosis import alternatives
>>> [a.label for a in alternatives({"causal": True, "align": "top_left"}, H=2, K=2, L=2, S=3,
...                                D=4, E=4, has_empty=False, has_excluded=True)][:2]
["align='bottom_right'", 'causal excludes the diagonal (j < i + offset)']
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from oracle.diagnose import budget, sample
from oracle.diagnose.alternative import Alternative
from oracle.diagnose.latent import latent_alternatives
from oracle.diagnose.models import error_models, exact_parts, narrow_accumulation  # noqa: F401
from oracle.diagnose.peers import peer_alternatives
from oracle.diagnose.sigmoid import sigmoid_alternatives
from oracle.diagnose.sparse import sparse_alternatives, sparse_lse_models
from oracle.diagnose.tiles import no_rescale_weights, split_combine_weights, tile_alternatives
from oracle.judging import tolerance as tol
from oracle.reading.allowed import allowed_positions
from oracle.reading.baseline import textbook_attention

__all__ = [
    "Alternative",
    "alternatives",
    "kernel_alternatives",
    "diagnose",
    "diagnose_lse",
    "describe_failure",
    "error_models",
]


def _set(**changes):
    def apply(options, extras):
        return {**options, **changes}, extras

    return apply


def _extra(**changes):
    def apply(options, extras):
        return options, {**extras, **changes}

    return apply


def _causal_admits_one_more(options, extras):
    """Causal frontier one key past the diagonal: the window's right side becomes 1."""
    left, _ = options.get("window") or (None, None)
    return {**options, "causal": False, "window": (left, 1)}, extras


def _causal_excludes_diagonal(L, S):
    """Causal frontier one key before the diagonal: the diagonal ``j = i + o_b`` (each row's
    own offset, :func:`oracle.reading.allowed.allowed_positions`) masked out. A window side cannot
    say
    this: refattn.spec reads a side of -1 as unbounded."""

    def apply(options, extras):
        diagonal = allowed_positions(
            L,
            S,
            window=(0, 0),
            align=options.get("align") or "top_left",
            kv_lengths=options.get("kv_lengths"),
        )
        mask = options.get("mask")
        mask = ~diagonal if mask is None else np.asarray(mask, dtype=bool) & ~diagonal
        return {**options, "mask": mask}, extras

    return apply


def _window_alternatives(window):
    left, right = window
    found = []
    for side, value in (("left", left), ("right", right)):
        if value is None:
            continue
        for delta in (1, -1):
            if value + delta < 0:
                continue
            new = (value + delta, right) if side == "left" else (left, value + delta)
            found.append(Alternative(f"window={new}", frozenset({"window"}), _set(window=new)))
    return found


def alternatives(options, *, H, K, L, S, D, E, has_empty, has_excluded) -> list[Alternative]:
    """The named alternatives that can change the result of a case with these options/sizes."""
    causal, window = bool(options.get("causal")), options.get("window")
    align = options.get("align") or "top_left"
    found = _structure_alternatives(options, H=H, K=K, L=L, S=S)
    found += _softcap_and_empty_alternatives(
        options, has_empty=has_empty, has_excluded=has_excluded
    )
    found += _polarity_alternatives(options)
    found += _scale_and_ignored_alternatives(options, D=D, E=E)
    found += [Alternative(lb, ks, _set(**ch)) for lb, ks, ch in sigmoid_alternatives(options)]
    if (
        options.get("kv_lengths") is not None
        and (causal or window is not None)
        and align == "bottom_right"
    ):
        found.append(
            Alternative(
                "kv_lengths as a key-padding mask (causal/window aligned to "
                "the padded S, not to each row's length)",
                frozenset({"kv_lengths", "mask"}),
                _padding_reading(S),
            )
        )
    found += peer_alternatives(options, L=L, S=S, D=D, has_empty=has_empty)
    found += latent_alternatives(options, D=D, E=E, alternative=Alternative, set_options=_set)
    return found + sparse_alternatives(options, H=H, L=L, S=S, alternative=Alternative)


def _structure_alternatives(options, *, H, K, L, S) -> list[Alternative]:
    """The other alignment, causal off by one key, window readings, the other GQA layout."""
    found = []
    causal, window = bool(options.get("causal")), options.get("window")
    align = options.get("align") or "top_left"
    if (causal or window is not None) and L != S:
        other = "bottom_right" if align == "top_left" else "top_left"
        found.append(Alternative(f"align={other!r}", frozenset({"align"}), _set(align=other)))
    if causal:
        found.append(
            Alternative(
                "causal excludes the diagonal (j < i + offset)",
                frozenset({"causal", "window", "mask"}),
                _causal_excludes_diagonal(L, S),
            )
        )
        found.append(
            Alternative(
                "causal admits one key past the diagonal",
                frozenset({"causal", "window"}),
                _causal_admits_one_more,
            )
        )
    if window is not None:
        found.extend(_window_alternatives(window))
    gqa = options.get("gqa") or "interleave"
    if K > 1 and H // K > 1:
        other = "tile" if gqa == "interleave" else "interleave"
        found.append(Alternative(f"gqa={other!r}", frozenset({"gqa"}), _set(gqa=other)))
    return found


def _softcap_and_empty_alternatives(options, *, has_empty, has_excluded) -> list[Alternative]:
    """Softcap in another place of the score pipeline; other readings of empty rows."""
    found = []
    if options.get("softcap") is not None:
        if options.get("bias") is not None or options.get("alibi_slopes") is not None:
            found.append(
                Alternative(
                    "softcap after bias",
                    frozenset({"softcap_order"}),
                    _extra(softcap_order="after_bias"),
                )
            )
        if has_excluded:
            found.append(
                Alternative(
                    "softcap after mask (masked scores become -softcap)",
                    frozenset({"softcap_order"}),
                    _extra(softcap_order="after_mask"),
                )
            )
    if has_empty:
        other = "nan" if (options.get("empty_rows") or "zero") == "zero" else "zero"
        found.append(
            Alternative(f"empty_rows={other!r}", frozenset({"empty_rows"}), _set(empty_rows=other))
        )
        found.append(
            Alternative(
                "fully masked rows average every value (masking by a large "
                "finite negative such as finfo.min)",
                frozenset({"empty_rows"}),
                _extra(empty_uniform=True),
            )
        )
    return found


def _polarity_alternatives(options) -> list[Alternative]:
    """Inverted boolean masks; dropout without its rescale."""
    found = []
    if options.get("mask") is not None:
        inverted = ~np.asarray(options["mask"], dtype=bool)
        found.append(
            Alternative(
                "mask polarity inverted (True = masked out)",
                frozenset({"mask"}),
                _set(mask=inverted),
            )
        )
    p = options.get("dropout_p") or 0.0
    if options.get("dropout_mask") is not None:
        if p > 0:
            found.append(
                Alternative(
                    "dropout without the 1/(1-p) rescale",
                    frozenset({"out_factor"}),
                    _extra(out_factor=1 - p),
                )
            )
        inverted = ~np.asarray(options["dropout_mask"], dtype=bool)
        found.append(
            Alternative(
                "dropout_mask polarity inverted (True = dropped)",
                frozenset({"dropout_mask"}),
                _set(dropout_mask=inverted),
            )
        )
    return found


def _scale_and_ignored_alternatives(options, *, D, E) -> list[Alternative]:
    """Another default scale or none; bias, ALiBi or sinks ignored."""
    found = []
    scale = options.get("scale")
    if scale is None and D != E:
        found.append(
            Alternative(
                "scale 1/sqrt(E) instead of 1/sqrt(D)",
                frozenset({"scale"}),
                _set(scale=1 / math.sqrt(E)),
            )
        )
    if scale is None or scale != 1:
        found.append(Alternative("no scale (scale=1)", frozenset({"scale"}), _set(scale=1.0)))
    if options.get("bias") is not None:
        found.append(Alternative("bias ignored", frozenset({"bias"}), _set(bias=None)))
    if options.get("alibi_slopes") is not None:
        found.append(
            Alternative("ALiBi ignored", frozenset({"alibi_slopes"}), _set(alibi_slopes=None))
        )
    if options.get("sinks") is not None:
        found.append(Alternative("sinks ignored", frozenset({"sinks"}), _set(sinks=None)))
    return found


def _padding_reading(S):
    """kv_lengths read as a plain key-padding mask (keys j >= S_b excluded, alignment to S)."""

    def apply(options, extras):
        lengths = np.asarray(options["kv_lengths"])
        padding = (np.arange(S)[None, :] < lengths.reshape(-1, 1)).reshape(
            lengths.shape + (1, 1, S)
        )
        mask = options.get("mask")
        mask = padding if mask is None else np.asarray(mask, dtype=bool) & padding
        return {**options, "kv_lengths": None, "mask": mask}, extras

    return apply


#: Tile sizes of real kernels (queries x keys blocks) the tile-bug alternatives try.
TILE_SIZES = (64, 128)
#: Keys per split of the split-KV alternatives.
SPLIT_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


def _drop_keys(rule):
    def apply(options, extras):
        return options, {**extras, "drop_keys": rule}

    return apply


def _reweight(rule):
    def apply(options, extras):
        return options, {**extras, "reweight": rule}

    return apply


def _zero_rows(first):
    def apply(options, extras):
        return options, {**extras, "zero_rows": first}

    return apply


def kernel_alternatives(L, S, *, tiles=TILE_SIZES, splits=SPLIT_SIZES) -> list[Alternative]:
    """Alternatives that name the bugs of tiled kernels (blocks of ``tiles`` keys/queries,
    split-KV chunks of ``splits`` keys), for a case with L queries and S keys."""
    found = tile_alternatives(L, S, tiles=tiles)
    for size in tiles:
        if S >= size:
            found.append(
                Alternative(
                    f"tile boundary: the last key of every full tile of {size} keys is skipped "
                    f"(keys j = {size - 1} mod {size})",
                    frozenset({"kernel"}),
                    _drop_keys(
                        lambda j, size=size, S=S: (j % size == size - 1) & (j < S // size * size)
                    ),
                )
            )
        if S > size and S % size:
            found.append(
                Alternative(
                    f"partial key tile skipped: keys from {S // size * size} on (after the last "
                    f"full tile of {size}) ignored",
                    frozenset({"kernel"}),
                    _drop_keys(lambda j, size=size, S=S: j >= S // size * size),
                )
            )
        if L > size and L % size:
            found.append(
                Alternative(
                    f"partial query tile not written: rows from {L // size * size} on (after the "
                    f"last full tile of {size} queries) are zero",
                    frozenset({"kernel"}),
                    _zero_rows(L // size * size),
                )
            )
        if S > size:
            found.append(
                Alternative(
                    f"late rescale missing: the output accumulator is not rescaled when the "
                    f"running max moves (online softmax over tiles of {size} keys)",
                    frozenset({"kernel"}),
                    _reweight(no_rescale_weights(size)),
                )
            )
    for size in splits:
        if S > size:
            found.append(
                Alternative(
                    f"split-KV combine: partial outputs of {size}-key splits weighted by their "
                    f"normalisers without the exp(m_s - m) max correction",
                    frozenset({"kernel"}),
                    _reweight(split_combine_weights(size)),
                )
            )
    return found


def _alternative_out(q, k, v, options, extras, prepared=None):
    """Output and scale (float64) of a reading; ``prepared`` the case's
    :class:`~oracle.reading.baseline.PreparedKV`."""
    if "reweight" in extras or "zero_rows" in extras or "drop_keys" in extras:
        return _kernel_out(q, k, v, options, extras, prepared=prepared)
    result = textbook_attention(
        q,
        k,
        v,
        dtype="float64",
        softcap_order=extras.get("softcap_order", "before_bias"),
        prepared=prepared,
        **options,
    )
    factor = extras.get("out_factor", 1.0)
    dropped = result.weights
    if options.get("dropout_mask") is not None:
        keep = np.asarray(options["dropout_mask"], dtype=bool)
        dropped = np.where(keep, result.weights, 0) / (1 - (options.get("dropout_p") or 0.0))
    out = result.out * factor
    scale = tol.output_scale(dropped * factor, v, gqa=options.get("gqa"), prepared=prepared)
    if extras.get("empty_uniform"):
        empty = ~np.broadcast_to(result.allowed, result.weights.shape).any(axis=-1)
        uniform = np.full(result.weights.shape, 1.0 / result.weights.shape[-1])
        gqa = options.get("gqa")
        flat = textbook_attention(q, k, v, dtype="float64", gqa=gqa, scale=0.0, prepared=prepared)
        out = np.where(empty[..., None], flat.out, out)
        scale = np.where(
            empty[..., None], tol.output_scale(uniform, v, gqa=gqa, prepared=prepared), scale
        )
    return out, scale


def _kernel_out(q, k, v, options, extras, parts=None, prepared=None):
    """Output and scale (float64) of a tiled-kernel alternative; ``parts`` are
    :func:`exact_parts` of ``options`` when already computed; ``prepared`` the case's
    :class:`~oracle.reading.baseline.PreparedKV`."""
    base, w3, v_h = parts or exact_parts(q, k, v, options, prepared=prepared)
    single = np.ndim(q) == 2
    if "drop_keys" in extras:
        S = w3.shape[-1]
        allowed = np.broadcast_to(base.allowed, base.weights.shape) & ~extras["drop_keys"](
            np.arange(S)
        )
        _, w3, v_h = exact_parts(q, k, v, options, allowed=allowed, prepared=prepared)
    if "reweight" in extras:
        w3 = extras["reweight"](w3)
    out = np.matmul(w3, v_h)
    if prepared is not None and prepared.applies(k, v):  # |v_h| of the case, kept
        abs_v = prepared.abs_values(v_h.shape[-3], options.get("gqa") or "interleave")
    else:
        abs_v = np.abs(v_h)
    scale = np.matmul(np.abs(w3), abs_v)
    if "zero_rows" in extras:
        out[..., extras["zero_rows"] :, :] = 0.0
    return (out[0], scale[0]) if single else (out, scale)


def _fits(out, truth, scale, limit, dtype) -> bool:
    if out.shape != truth.shape:
        return False
    err = tol.normalised_error(out, truth, scale, dtype)
    return bool(np.all(err <= limit))


#: multiply-adds the single alternatives of one failing case may cost (the named ones come
#: first, the kernel models after): the long rows (S up to 128k) get the first few
ALTERNATIVES_WORK_CAP = 2**34
#: largest evaluation (multiply-adds) for which pairs of alternatives are tried (kernel-scale
#: rows of a few hundred keys are; long rows are not)
PAIRS_WORK_CAP = 2**27
#: a reading is named only if its largest error is at most this share of the pinned
#: convention's (when :func:`diagnose` is given the pinned errors): a reading that merely
#: fits as loosely as the pinned convention does (a near-uniform softmax, where scale**2 or a
#: late rescale hardly moves the output) explains nothing a precision loss does not
FIT_MARGIN = 0.5


def _materially_better(error, pinned) -> bool:
    """True when the reading's ``error`` is at most :data:`FIT_MARGIN` times the pinned
    convention's largest finite error (``pinned`` None: no such requirement)."""
    if pinned is None:
        return True
    finite = np.asarray(pinned)[np.isfinite(pinned)]
    if finite.size == 0:
        return True
    with np.errstate(invalid="ignore"):
        return bool(np.max(error) <= FIT_MARGIN * float(np.max(finite)))


def diagnose(view, out, *, limit, max_pairs=True, pinned=None, costly=True) -> list[str]:
    """Labels of the alternatives whose float64 truth ``out`` fits within ``limit``.

    ``view`` is the case (:class:`oracle.reading.case.CaseView`).

    ``limit`` is the case's output threshold (scalar or per row, (T2)); the float64 floor of the
    textbook that evaluates the alternatives is added to it. Returns "matches <label>" strings
    (a pair as "matches <a> + <b>"); an empty list when nothing fits. ``pinned``, when given,
    is the normalised error of ``out`` against the pinned truth (out's shape): a reading is
    then named only if it also fits materially better than the pinned convention
    (:data:`FIT_MARGIN`), so that a precision loss is not named as a reading that hardly
    changes this case's output.

    The readings are evaluated in order (the named conventions, the likeliest, first; then the
    kernel models; pairs last, only when no single reading fits) within the case's diagnosis
    budget (:mod:`oracle.diagnose.budget`): a reading that is not cheap is started only when
    the time left covers it at the rate the case's evaluations have shown, and the case's
    budget record says what was tried. The first costly reading that explains the whole case
    ends the search (first match: the costly readings after it are not evaluated; cheap ones
    all are, so a small case reports every reading it matches); ``costly=False`` searches the
    cheap readings only (and those already evaluated for the case), the failure being
    explained already (a narrower working precision, :mod:`oracle.judging.judge`). The
    case's set-up and each reading's errors are kept for the case: the judge's later calls at
    other limits reuse them.
    """
    q, k, v, options, dtype = view.q, view.k, view.v, view.options, view.dtype
    out_arg, out = out, np.asarray(out, dtype=np.float64)
    spent = budget.current()
    case = (id(q), id(k), id(v), id(options), id(out_arg))
    if case not in spent.memo:
        # the memo keys on identities: keeping the objects alive keeps the identities unique
        spent.memo[case] = (_CaseSetup(view), (q, k, v, options, out_arg))
    setup = spent.memo[case][0]
    limit = np.asarray(limit) + setup.floor64
    if np.ndim(q) == 2 and np.ndim(limit) >= 3:
        limit = limit[..., 0, :, :]
    reading = _Reading(q, k, v, options, out, setup, dtype)
    start = time.perf_counter()
    sample = setup.sampled(reading, limit)  # its first call evaluates the pinned reading
    spent.measured(setup.work, time.perf_counter() - start)
    spent.rows = (setup.sample_rows, setup.rows)
    on_sample = sample.output(limit) if sample else limit
    if pinned is not None and np.shape(pinned) != out.shape:
        pinned = None  # not out's errors: no margin asked
    pinned_sample = None if pinned is None or not sample else sample.output(pinned)

    # a costly reading explained the whole case (or the caller had it explained): the costly
    # ones stop there
    decided = [] if costly else ["explained"]

    def evaluate(key, opts, extras, view, work):
        start = time.perf_counter()
        error = spent.memo[key] = reading.error(opts, extras, view)
        spent.measured(work, time.perf_counter() - start)
        return error

    def explains(label, index, total, opts, extras):
        """True/False; "sample" when only the sample was affordable; None when the budget
        (or a decisive earlier match) stops before this reading."""
        error = spent.memo.get((case, label))
        if error is None:
            dear = setup.sample_work > budget.CHEAP_WORK
            if (dear and decided) or not spent.allows(setup.sample_work):
                return None
            spent.reading(index, total)
            error = evaluate((case, label), opts, extras, sample, setup.sample_work)
        if error is False or not np.all(error <= on_sample) or sample is None:
            fits = error is not False and bool(np.all(error <= on_sample))
            fits = fits and _materially_better(error, pinned)
            decided.extend([label] if fits and setup.sample_work > budget.CHEAP_WORK else [])
            return fits
        if not _materially_better(error, pinned_sample):
            return False
        whole = spent.memo.get((case, label, "whole"))
        if whole is None:  # confirmed on the whole case only when that is cheap
            if setup.work > budget.CHEAP_WORK and spent.left() < reading.whole_seconds:
                return "sample"
            whole = evaluate((case, label, "whole"), opts, extras, None, setup.work)
        fits = whole is not False and bool(np.all(whole <= limit))
        fits = fits and _materially_better(whole, pinned)
        decided.extend([label] if fits and setup.work > budget.CHEAP_WORK else [])
        return fits

    def named(label, fits):
        shown = f"matches {label}"
        if fits == "sample":
            shown += f" (on a sample of {sample.rows.size} of {sample.L} query rows)"
        return shown

    found = []
    with np.errstate(all="ignore"):
        _, applied, order = setup.applied(options)
        matched = {}
        for count, i in enumerate(order, 1):
            alt, opts, extras = applied[i]
            fits = explains(alt.label, count, len(order), opts, extras)
            if fits is None and not decided:
                return [matched[i] for i in sorted(matched)]
            if fits:
                matched[i] = named(alt.label, fits)
        found = [matched[i] for i in sorted(matched)]
        if found or not (max_pairs and setup.pairs):
            return found
        pairs = [
            (a, b) for a, b in itertools.combinations(setup.candidates, 2) if not a.keys & b.keys
        ]
        total = len(setup.candidates) + len(pairs)
        firsts = {}  # each first reading applied once: its options dict is shared
        for index, (first, second) in enumerate(pairs, len(setup.candidates) + 1):
            label = f"{first.label} + {second.label}"
            if first.label not in firsts:
                firsts[first.label] = first.apply(dict(options), {})
            fits = explains(label, index, total, *second.apply(*firsts[first.label]))
            if fits is None:
                break
            if fits:
                found.append(named(label, fits))
    return found


def _cost(own, opts, extras) -> int:
    """0: a kernel model reweighting the case's own weights (no new evaluation); 1: one
    textbook evaluation (another reading of the options); 2: a kernel model dropping keys."""
    if "drop_keys" in extras:
        return 2
    kernel = "reweight" in extras or "zero_rows" in extras
    return 0 if kernel and opts is own else 1


class _CaseSetup:
    """What every diagnosis of a case needs once: its readings, their cost, the float64
    floor, where the truth is finite, whether the inputs carry poison, and the sample of
    query rows the readings are evaluated on (:mod:`oracle.diagnose.sample`)."""

    def __init__(self, view):
        q, k, v, options = view.q, view.k, view.v, view.options
        q3 = q if np.ndim(q) > 2 else np.asarray(q)[None]
        H, L, D = np.shape(q3)[-3:]
        K, S, E = np.shape(k)[-3] if np.ndim(k) > 2 else 1, np.shape(k)[-2], np.shape(v)[-1]
        with np.errstate(all="ignore"):
            base = view.exact64
            allowed = np.broadcast_to(base.allowed, base.weights.shape)
            candidates = alternatives(
                options,
                H=H,
                K=K,
                L=L,
                S=S,
                D=D,
                E=E,
                has_empty=bool((~allowed.any(axis=-1)).any()),
                has_excluded=bool((~allowed).any()),
            ) + kernel_alternatives(L, S)
            # each alternative is a textbook evaluation of ~rows * S * (D + E) multiply-adds:
            # long rows get the single alternatives within a budget, pairs only on small cases
            self.rows = int(np.prod(np.shape(q3)[:-1]))
            self.work = self.rows * S * (D + E)
            if self.work * len(candidates) > ALTERNATIVES_WORK_CAP:
                candidates = candidates[: max(ALTERNATIVES_WORK_CAP // max(self.work, 1), 0)]
            self.candidates, self.pairs = candidates, self.work <= PAIRS_WORK_CAP
            magnitude = view.magnitude
            f64 = tol.forward_floors(
                "float64",
                D=D,
                S=S,
                L=L,
                E=E,
                G=max(H // K, 1),
                magnitude=magnitude,
                allowed=allowed,
            )["out"]
            self.floor64 = float(np.max(f64))
            self.finite = np.isfinite(base.out)
            bias = options.get("bias")
            self.poisoned = not all(
                np.isfinite(np.asarray(a, np.float64)).all() for a in (q, k, v)
            ) or (
                bias is not None
                and np.isnan(np.asarray(bias, np.float64)).any()
                or bias is not None
                and np.isposinf(np.asarray(bias, np.float64)).any()
            )
        self.L, self.S = L, S
        self.sample_rows, self.sample_work = self.rows, self.work
        self._view = self._unsampled = object()
        self._applied = None

    def applied(self, options):
        """(own, [(alternative, its options, its extras)], the order to evaluate them in),
        built once for the case (some readings build masks or biases the size of the case):
        ``own`` is the one dict of the case's options every reading is applied to, the order
        the cheapest first (the list's order, the likeliest first, within a cost)."""
        if self._applied is None:
            own = dict(options)  # apply() never changes its argument: one dict, one exact_parts
            applied = [(alt, *alt.apply(own, {})) for alt in self.candidates]
            order = sorted(range(len(applied)), key=lambda i: (_cost(own, *applied[i][1:]), i))
            self._applied = own, applied, order
        return self._applied

    def sampled(self, reading, limit):
        """The :class:`~oracle.diagnose.sample.RowView` of the failing pattern against the
        first ``limit`` asked (chosen once), or None when the case is evaluated whole."""
        if self._view is not self._unsampled:
            return self._view
        self._view = None
        if (
            self.L <= sample.SAMPLE_ROWS
            or self.work <= budget.CHEAP_WORK
            or not sample.can_sample(reading.q, reading.k, reading.v, reading.options)
        ):
            return None
        with np.errstate(all="ignore"):
            error = reading.error(dict(reading.options), {})
            if error is False:
                return None
            failing = error > np.broadcast_to(limit, error.shape)
        if not failing.any():
            return None
        rows = sample.choose_rows(failing.any(axis=-1), error.max(axis=-1))
        self._view = sample.RowView(rows, self.L, self.S)
        self.sample_rows = self.rows // self.L * rows.size
        self.sample_work = self.work // self.L * rows.size
        return self._view


class _Reading:
    """Evaluates one alternative reading of a case: its normalised error against ``out``, on
    the whole case or on a sample of its query rows."""

    def __init__(self, q, k, v, options, out, setup, dtype):
        self.q, self.k, self.v, self.options, self.out = q, k, v, options, out
        self.setup, self.dtype = setup, dtype
        self.whole_seconds = 0.0  # the last sampled evaluation's time, scaled to the whole
        self._parts = {}
        # k and v as every reading converts them, made on first use, kept for the case
        self.prepared = budget.current().prepared(k, v)

    def _parts_of(self, q, opts):
        """:func:`exact_parts` of ``opts`` computed once per options dict (the kernel models
        only reweight them; a pair's first reading gives every second one the same dict)."""
        kept = self._parts.get(id(opts))
        if kept is None:  # the dict is kept with its parts: its identity stays unique
            parts = exact_parts(q, self.k, self.v, opts, prepared=self.prepared)
            kept = self._parts[id(opts)] = (opts, parts)
        return kept[1]

    def error(self, opts, extras, view=None):
        """Normalised errors (out's shape, or the sample's), or False when the reading cannot
        explain ``out``."""
        q, out, finite = self.q, self.out, self.setup.finite
        start = time.perf_counter()
        if view is not None:
            opts, extras = view.reading(opts, extras)
            q, out, finite = view.q(q), view.output(out), view.output(finite)
        if "reweight" in extras or "zero_rows" in extras or "drop_keys" in extras:
            parts = self._parts_of(q, opts)
            alt_out, scale = _kernel_out(q, self.k, self.v, opts, extras, parts, self.prepared)
        else:
            alt_out, scale = _alternative_out(q, self.k, self.v, opts, extras, self.prepared)
        if view is not None:
            self.whole_seconds = (time.perf_counter() - start) * view.L / view.rows.size
        # with poisoned inputs, an alternative that is NaN where the truth is finite only
        # "explains" leaked poison by admitting a poisoned (excluded) position: that is
        # not a convention
        if (
            self.setup.poisoned
            and alt_out.shape == finite.shape
            and (~np.isfinite(alt_out) & finite).any()
        ):
            return False
        if out.shape != alt_out.shape:
            return False
        return tol.normalised_error(out, alt_out, scale, self.dtype)


def diagnose_lse(view, lse, *, limit) -> list[str]:
    """Labels explaining a failing lse: log2 units, the row max left out (log of the shifted
    normaliser), or one of the named alternatives (scale, bias, ALiBi, masks...) evaluated
    for lse. ``view`` is the case (:class:`oracle.reading.case.CaseView`), ``limit`` the lse
    threshold (normalised by the lse scale, (T2))."""
    q, k, v, options, dtype = view.q, view.k, view.v, view.options, view.dtype
    lse = np.asarray(lse, dtype=np.float64)
    base = view.exact64
    truth = np.asarray(base.lse, dtype=np.float64)
    if lse.shape != truth.shape:
        return []
    magnitude = view.magnitude
    scale = tol.lse_scale(truth, base.weights, magnitude[0] if np.ndim(q) == 2 else magnitude)
    limit = np.asarray(limit) + tol.unit_roundoff("float64") * 64
    found = []
    with np.errstate(all="ignore"):
        top = np.where(
            np.broadcast_to(base.allowed, base.weights.shape), np.log(base.weights), -np.inf
        ).max(axis=-1)
        row_max = truth + top  # top = max_j log p_j = max_j t_j - lse
        candidates = [
            (
                "lse in log2 units (an exp2 kernel not converting back: lse / ln 2)",
                truth / math.log(2),
            ),
            ("lse without the row max (log of the max-shifted normaliser)", truth - row_max),
            ("lse is the row max only (the normaliser's log missing)", row_max),
        ] + sparse_lse_models(truth)
        for label, model in candidates:
            if _fits(lse, model, scale, limit, dtype):
                found.append(f"lse matches {label}")
        if found:
            return found
        H, L, D = (np.shape(q) if np.ndim(q) > 2 else (1,) + np.shape(q))[-3:]
        K = np.shape(k)[-3] if np.ndim(k) > 2 else 1
        allowed = np.broadcast_to(base.allowed, base.weights.shape)
        spent = budget.current()
        work = int(np.prod(base.weights.shape[:-1])) * np.shape(k)[-2] * (D + np.shape(v)[-1])
        prepared = spent.prepared(k, v)  # the readings' conversions of k and v, made once
        for alt in alternatives(
            options,
            H=H,
            K=K,
            L=L,
            S=np.shape(k)[-2],
            D=D,
            E=np.shape(v)[-1],
            has_empty=bool((~allowed.any(-1)).any()),
            has_excluded=bool((~allowed).any()),
        ):
            opts, extras = alt.apply(dict(options), {})
            if extras:
                continue
            if not spent.allows(work):  # the case's diagnosis budget (oracle.diagnose.budget)
                spent.steps.setdefault("lse readings", False)
                break
            start = time.perf_counter()
            model = textbook_attention(q, k, v, dtype="float64", prepared=prepared, **opts).lse
            spent.measured(work, time.perf_counter() - start)
            if _fits(lse, np.asarray(model, dtype=np.float64), scale, limit, dtype):
                found.append(f"lse matches {alt.label}")
    return found


#: Share of the failing rows that must fall in one pattern for :func:`concentration` to name it.
CONCENTRATION = 0.9


def concentration(view, errors, limit, *, tiles=TILE_SIZES) -> list[str]:
    """Where the failing rows of an output concentrate, when no modelled alternative fits.

    Two patterns of tiled kernels are named, each only when at least :data:`CONCENTRATION` of
    the failing query rows follow it and it is rarer among the other rows:

    * the last, partial query tile: every failing row has an index ``i >= T floor(L / T)``
      for a tile of ``T`` queries (``L > T``, ``L`` not a multiple of ``T``);
    * rows whose max moves late: the row's largest allowed score (the float64 textbook's)
      lies past the first tile of ``T`` keys, where an online softmax rescales its running
      sums (a missing or wrong rescale shows on exactly those rows).

    ``view`` is the case (:class:`oracle.reading.case.CaseView`); ``errors`` and ``limit``
    have the output's shape (..., H, L, E). Returns notes (possibly none).
    """
    bad = np.asarray(errors > limit)
    if bad.ndim < 2 or not bad.any():
        return []
    rows = bad.any(axis=-1)  # (..., H, L)
    L = rows.shape[-1]
    notes = []
    index = np.broadcast_to(np.arange(L), rows.shape)
    for size in tiles:
        start = size * (L // size)
        if L > size and start < L and (index[rows] >= start).all() and (~rows[..., :start]).any():
            notes.append(
                f"the failing rows are all in the last, partial query tile of "
                f"{size} (rows {start}..{L - 1}): a partial query tile mishandled?"
            )
            break
    with np.errstate(all="ignore"):
        base = view.exact64
        allowed = np.broadcast_to(base.allowed, base.weights.shape)
        logw = np.where(allowed, np.log(base.weights), -np.inf)
    if logw.shape[:-1] != rows.shape:
        return notes
    has_key = allowed.any(axis=-1)
    top = np.argmax(logw, axis=-1)
    failing = rows & has_key
    for size in tiles:
        if logw.shape[-1] <= size or not failing.any():
            continue
        late = top >= size
        share = float(late[failing].mean())
        others = late[has_key & ~rows]
        rest = float(others.mean()) if others.size else 0.0
        if share >= CONCENTRATION and rest < share:
            notes.append(
                f"{share:.0%} of the failing rows have their max past the first tile "
                f"of {size} keys ({rest:.0%} of the passing rows): the rescale of "
                f"an online softmax when the running max moves?"
            )
            break
    return notes


def describe_failure(value, truth, errors, limit, *, inputs_poisoned=False) -> list[str]:
    """Plain observations on a failure when no alternative fits (NaN leaks, where errors sit)."""
    value = np.asarray(value, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    notes = []
    leaked = ~np.isfinite(value) & np.isfinite(truth)
    if leaked.any():
        where = "; poison at excluded positions reached the output" if inputs_poisoned else ""
        notes.append(f"NaN/Inf in {int(leaked.sum())} elements where the truth is finite{where}")
    missing = np.isnan(truth) & ~np.isnan(value)
    if missing.any():
        notes.append(f"finite values in {int(missing.sum())} elements where the truth is NaN")
    bad = np.asarray(errors > limit)
    if bad.any() and not leaked.any() and bad.ndim >= 2:
        rows = bad.any(axis=-1)
        notes.append(
            f"{int(bad.sum())} of {bad.size} elements over the threshold, "
            f"in {int(rows.sum())} of {rows.size} rows"
        )
    return notes
