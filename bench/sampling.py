"""Sampling a batch of logits rows on a GPU: top-p / top-k by radix selection (the Triton kernel) against the sort
(the PyTorch path it replaces), with temperature-only sampling beside them.

    python bench/sampling.py [--vocab 32768 163840] [--batches 1 4 16 64 256] [--json bench/sampling.json]

For each vocabulary (k3-debug's 32,768; Kimi Linear's and K3's 163,840) and batch, rows of random logits (std 3)
are sampled through `openk3.sampling.sample_tokens` as the engine calls it (temperature 0.8, the cuts below, a
seeded random source per row), 20 calls between CUDA events after 3 warm-up calls, host launch included:
  temperature   temperature alone (one launch of `sample_rows_triton`)
  top_p sort    top_p 0.95 through the sort (`sampling.cut_kernel_takes` answering no)
  top_p kernel  top_p 0.95 through `sample_rows_cut_triton` (`cut_kernel_takes` answering yes)
  top_k kernel  top_k 50 and top_p 0.95 through the kernel (its count selection first)
and whether the sort and the kernel drew the same tokens (they agree up to fp32 rounding at a nucleus boundary).
Prints a table and writes JSON rows {vocab, batch, case, us_per_call}, with the same-token counts; the batch from
which the kernel beats the sort, by vocabulary, is what `CUT_KERNEL_MIN_ROWS` and `CUT_KERNEL_MAX_VOCAB` should
be. `--device cpu --tiny` runs a small case under TRITON_INTERPRET=1 (a smoke test: no timings worth reading).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path

import torch

from common import require_interpreter  # bench/common.py (the script's folder is on sys.path)
from openk3 import sampling
from openk3.sampling import SamplingParams, sample_tokens

HERE = Path(__file__).parent
CASES = {"temperature": (SamplingParams(temperature=0.8), None), "top_p sort": (SamplingParams(temperature=0.8,
         top_p=0.95), False), "top_p kernel": (SamplingParams(temperature=0.8, top_p=0.95), True),
         "top_k kernel": (SamplingParams(temperature=0.8, top_p=0.95, top_k=50), True)}


def time_calls(fn, device: torch.device, reps: int) -> float:
    """Microseconds per call over `reps` calls after 3 warm-up calls (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 163840])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="vocabulary 300, batches 1 and 3 (CPU smoke test)")
    parser.add_argument("--json", default=str(HERE / "sampling.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    require_interpreter(parser, args.device, "sampling.py")
    vocabs, batches, reps = ([300], [1, 3], 1) if args.tiny else (args.vocab, args.batches, 20)
    if device.type == "cpu" and not args.tiny:
        parser.error("the kernels need a CUDA device (or --device cpu --tiny under TRITON_INTERPRET=1)")
    use_triton = sampling.use_triton
    sampling.use_triton = lambda t, compiled=False: True  # the kernels on the CPU too (the interpreter, --tiny)
    default_rule = sampling.cut_kernel_takes
    rows = []
    print(f"| vocab | batch | {' | '.join(f'{c} (us)' for c in CASES)} | same tokens, sort / kernel |")
    print(f"|---|---|{'---|' * len(CASES)}---|")
    for vocab in vocabs:
        for batch in batches:
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)).mul(3).to(device)
            times, tokens = {}, {}
            for case, (params, kernel) in CASES.items():
                sampling.cut_kernel_takes = default_rule if kernel is None else lambda rows, vocab, on=kernel: on
                draw = functools.partial(sample_tokens, logits, [params] * batch,
                                         [random.Random(i) for i in range(batch)])
                tokens[case] = draw().tolist()
                times[case] = time_calls(draw, device, reps)
                rows.append({"vocab": vocab, "batch": batch, "case": case, "us_per_call": times[case]})
            same = sum(a == b for a, b in zip(tokens["top_p sort"], tokens["top_p kernel"]))
            rows[-1]["same_tokens_sort_kernel"] = same
            print(f"| {vocab:,} | {batch} | {' | '.join(f'{times[c]:,.1f}' for c in CASES)} | {same}/{batch} |",
                  flush=True)
    sampling.use_triton, sampling.cut_kernel_takes = use_triton, default_rule
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cut_kernel_min_rows": sampling.CUT_KERNEL_MIN_ROWS,
              "cut_kernel_max_vocab": sampling.CUT_KERNEL_MAX_VOCAB, "rows": rows}
    if not args.tiny:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
