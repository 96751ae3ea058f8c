"""Shared command-line plumbing of tools/convert_*.py: size parsing, errors, the final summary."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Callable

from megatron_rl.convert.output import Summary

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '512MiB' -> 2^29 (HF's max_shard_size spelling); for argparse."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not found or found.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB)")
    size = int(float(found.group(1)) * _UNITS[found.group(2)])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return size


def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose --help shows the tool's docstring (its examples) verbatim."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out-dir if it exists and is not empty (default: refuse)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(tool: str, convert: Callable[[], Summary]) -> int:
    """Run a conversion; print its summary (stdout) or a one-line error (stderr, exit code 2)."""
    try:
        summary = convert()
    except ValueError as err:
        print(f"{tool}: error: {err}", file=sys.stderr)
        return 2
    print(summary.format())
    return 0
