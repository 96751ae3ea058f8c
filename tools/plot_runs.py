"""Compare runs: a Markdown table and PNG figures from their metrics.jsonl files.

examples:
  python tools/plot_runs.py runs/tiny_bf16 runs/tiny_fp8 runs/tiny_fp8_calibrated --out runs/report
  python tools/plot_runs.py runs/a runs/b --labels bf16 fp8 --title "sort, seed 1"
"""

from __future__ import annotations

import argparse
import sys

from megatron_rl.telemetry.report import load_runs, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders (each holds metrics.jsonl)")
    parser.add_argument("--out", required=True, help="output folder for report.md and the figures")
    parser.add_argument("--labels", nargs="*", help="one label per run (default: folder names)")
    parser.add_argument("--title", default="Run comparison")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels has {len(args.labels)} entries for {len(args.runs)} runs")
    try:
        md = write_report(load_runs(args.runs, args.labels), args.out, args.title)
    except ValueError as err:
        print(f"plot_runs: error: {err}", file=sys.stderr)
        return 2
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
