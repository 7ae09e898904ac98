"""Compare two collections of the same requests (say, one collected on the CPU, one on a GPU).

    python scripts/compare_traces.py cpu/ cuda/ [--tolerance 1e-3]

Prints, over the requests both hold: how many round counts and output token counts differ (with the
first few that do), and the largest and median absolute difference of the pooled first-round states.
Different devices sum in different orders, so a near-tie between two candidate tokens can flip and
change a request's decode from there on: the counts of differing requests are the figure, not a
failure. Exit 1 only when the two hold different requests or the first-round states of a request
whose rounds agree differ by more than ``--tolerance`` (the first round sees the same tokens on both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dwise_predict.traces import load_traces  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest first-round difference accepted")
    args = parser.parse_args(argv)
    a, b = load_traces(args.first), load_traces(args.second)
    ids_a, ids_b = a.requests["request_id"].tolist(), b.requests["request_id"].tolist()
    if sorted(ids_a) != sorted(ids_b):
        print(f"the two collections hold different requests ({len(ids_a)} and {len(ids_b)})")
        return 1
    order = {rid: i for i, rid in enumerate(ids_b)}
    take = np.array([order[rid] for rid in ids_a])
    rounds_a, rounds_b = a.requests["total_rounds"].to_numpy(), b.requests["total_rounds"].to_numpy()[take]
    tokens_a, tokens_b = a.requests["output_tokens"].to_numpy(), b.requests["output_tokens"].to_numpy()[take]
    first_diff = np.abs(a.first_round.astype(np.float64) - b.first_round[take].astype(np.float64)).max(axis=1)
    rounds_differ = np.flatnonzero(rounds_a != rounds_b)
    print(f"{len(ids_a)} requests: rounds differ in {len(rounds_differ)}, output tokens in "
          f"{int((tokens_a != tokens_b).sum())}; first-round states |diff| max {first_diff.max():.2e}, "
          f"median {np.median(first_diff):.2e}")
    for i in rounds_differ[:5]:
        print(f"  {ids_a[i]}: rounds {rounds_a[i]} vs {rounds_b[i]}, tokens {tokens_a[i]} vs {tokens_b[i]}")
    agreeing = np.setdiff1d(np.arange(len(ids_a)), rounds_differ)
    worst = float(first_diff[agreeing].max()) if len(agreeing) else 0.0
    if worst > args.tolerance:
        print(f"first-round states differ by {worst:.2e} (> {args.tolerance:g}) where the rounds agree")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
