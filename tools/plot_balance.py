"""Draw a balancer trace as a PNG: per-rank step time, plan and estimated speed over the run.

Usage::

    python tools/plot_balance.py runs/balance.jsonl                 # -> runs/balance.png
    python tools/plot_balance.py runs/balance.jsonl --out plan.png --dp 1
    python tools/plot_balance.py runs/balance_dp.jsonl              # data-parallel shares (hetero.dp_shares)
    python tools/plot_balance.py runs/balance_pp.jsonl              # pipeline stages (hetero.pp_split)

The trace is what `--balance.trace FILE` writes (a PNG is also drawn beside it when the run ends); with
uneven data-parallel shares FILE_dp.jsonl holds each replica's speed and share per step, with planned
pipeline stages FILE_pp.jsonl each stage's speed per layer and its layers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahet.runtime.trace_plot import plot_dp_trace, plot_pp_trace, plot_trace, read_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a --balance.trace JSONL file")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: the trace's, .png)")
    parser.add_argument("--dp", type=int, default=0, help="which DP replica's TP group to draw")
    args = parser.parse_args(argv)
    try:
        out = args.out or args.trace.with_suffix(".png")
        first = read_trace(args.trace)[0]
        if "shares" in first:
            png = plot_dp_trace(args.trace, out)
        elif "split" in first:
            png = plot_pp_trace(args.trace, out)
        else:
            png = plot_trace(args.trace, out, dp=args.dp)
    except (FileNotFoundError, ValueError, IndexError) as err:
        message = err if not isinstance(err, IndexError) else f"the trace has no DP replica {args.dp}"
        print(f"plot_balance: error: {message}", file=sys.stderr)
        return 2
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
