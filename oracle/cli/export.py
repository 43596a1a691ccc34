"""``refattn-oracle export``: the subcommand, registered by :mod:`oracle.cli`.

A module of its own outside :mod:`oracle.export` so that building the parser imports nothing
heavy (the package imports NumPy and refattn).

``refattn-oracle export --format safetensors|onnx|flashinfer-trace --fixtures DIR --out DIR
[--case NAME ...] [--quiet]`` exits with 0 when written, 2 with one line for bad input (unknown
format, missing package, bad fixture directory, unusable destination).
"""

from __future__ import annotations

import json
import sys

from oracle.export import EXPORT_MANIFEST, export
from oracle.fixtures.golden import (
    FixtureError,  # ExportError's base: also a corrupt fixture file
)

__all__ = ["add_export_parser", "run_export_command"]

_FORMATS = ("safetensors", "onnx", "flashinfer-trace")


def add_export_parser(sub) -> None:
    """Add the ``export`` subcommand to ``oracle.cli``'s subparsers."""
    parser = sub.add_parser(
        "export", help="write fixtures as safetensors, ONNX backend tests or FlashInfer-Trace"
    )
    parser.add_argument("--format", required=True, choices=_FORMATS)
    parser.add_argument("--fixtures", required=True, help="directory written by `generate`")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--case", action="append", help="only this case (repeatable)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_export_command(args) -> int:
    """Handler of ``refattn-oracle export`` (returns the exit code)."""
    try:
        out = export(args.format, args.fixtures, args.out, names=args.case, progress=not args.quiet)
    except (FixtureError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) else exc
        print(f"refattn-oracle: error: {message}", file=sys.stderr)
        return 2
    counts = json.loads((out / EXPORT_MANIFEST).read_text())["counts"]
    print(
        f"{args.format}: {counts['exported']} exported, {counts['not_expressible']} not "
        f"expressible (reasons in {out / EXPORT_MANIFEST})"
    )
    return 0
