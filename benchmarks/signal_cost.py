"""What the serving hook's early signals cost per step: every row of the step's first forward
against only the rows in their first denoising forward (what the hook computes since it reads
``ForwardBatch.rids``). Target: the restricted cost scales with the first-round rows, not the batch:
a first-round row costs at most twice a row of the whole batch (the restricted call's fixed costs,
the row gather among them, weigh more when it holds few rows), and gives the same values.

The signals need a softmax over the vocabulary for every position of a row's block, so a step of B
rows costs B · block · V exponentials. Sizes default to LLaDA2.x's (vocabulary 157,184, block 32) at
a batch of 32 with 2 rows starting their first block; on a CPU this is slow but the ratio is what
matters (on a GPU run it with ``--device cuda``).

Usage: python benchmarks/signal_cost.py [--batch 32] [--first 2] [--vocab 157184] [--block 32] [--device cpu]
       python benchmarks/signal_cost.py --smoke     # batch 8, 1 first-round row, vocabulary 4,096, block 8
"""

from __future__ import annotations

import argparse
import time

from targets import Figure, add_options, report

TARGET_PER_ROW = 2.0  # a first-round row's cost over a row's in the whole-batch call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--first", type=int, default=2, help="rows in their first denoising forward")
    parser.add_argument("--vocab", type=int, default=157_184)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    add_options(parser, "batch 8, 1 first-round row, vocabulary 4,096, block 8: a quick check")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.first, args.vocab, args.block = 8, 1, 4096, 8

    import torch

    from dwise_predict.serving.sglang import row_signals

    torch.manual_seed(0)
    mask_id = 0
    logits = torch.randn(args.batch * args.block, args.vocab, device=args.device, dtype=torch.bfloat16)
    ids = torch.randint(1, 100, (args.batch * args.block,), device=args.device)
    ids[torch.rand(ids.shape, device=args.device) < 0.8] = mask_id
    stop_ids = torch.tensor([1], device=args.device)  # one end-of-sequence id, as most models
    rows = list(range(args.batch))[:: max(1, args.batch // max(1, args.first))][: args.first]
    first = torch.tensor(rows, device=args.device)

    def timed(picked) -> tuple[float, torch.Tensor]:
        best = float("inf")
        for _ in range(args.repeats):
            if args.device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = row_signals(logits, ids, picked, mask_id, args.block, 0.95, stop_ids)
            if args.device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best, out

    every, all_rows = timed(None)
    restricted, some = timed(first)
    differ = sum(not torch.allclose(a, b, atol=1e-5) for a, b in zip(all_rows[rows], some))
    print(f"batch {args.batch}, block {args.block}, vocab {args.vocab:,}, {len(rows)} first-round rows, {args.device}")
    print(f"every row:         {every * 1e3:9.1f} ms per step")
    print(f"first-round rows:  {restricted * 1e3:9.1f} ms per step   ({every / restricted:.1f}x less; "
          f"same values: {differ == 0})")
    per_row = (restricted / len(rows)) / (every / args.batch)
    report("signal_cost", [
        Figure("early signals, a first-round row's cost over a batch row's", per_row, "x", TARGET_PER_ROW,
               context=f"batch {args.batch}, {len(rows)} first-round rows, vocabulary {args.vocab:,}"),
        Figure("first-round rows whose signals differ from the whole batch's", differ, "rows", 0.0),
    ], args, batch=args.batch, first=len(rows), vocab=args.vocab, block=args.block, device=args.device,
        every_ms=every * 1e3, restricted_ms=restricted * 1e3)


if __name__ == "__main__":
    main()
