"""The serving engine's host work per decode step, without the model: what `Engine.step` costs around the forward.

    python bench/engine_host.py [--batches 1 8 64] [--lengths 128 2048] [--window 64] [--repeats 3] [--label NAME]
                                [--cache-mb 2048] [--profile] [--json bench/engine_host.json]

The model's decode (`engine.runner.decode`) is replaced by a stub that returns fixed logits, cycling through the
bytes of a short multilingual text (ASCII, 2-, 3- and 4-byte UTF-8 characters), so a step times only the engine's
own work: scheduling, page bookkeeping, the greedy pick, detokenizing, the stop-string check, prefix-cache
registration of completed hash blocks with their KDA checkpoints (the cache is on, with room for all of them:
a full cache stops registering, which would make long replies cheaper) and one event per request to a consumer.
For each batch B and output length L: B requests (16-token prompts, greedy, ignore_eos, a stop string that never
matches) decode until every output is L tokens long; host ms per step is the median CPU time of `Engine.step`
(the process's, one torch thread) over the `--window` steps before that, every request decoding, the best of
`--repeats` runs (CPU time, median and best, since other processes may share the cores; the wall-clock median is
in the table as well). The engine's host time should not depend on L. Prefill runs the real k3-tiny model on the
CPU and is not timed. `--profile` prints cProfile's top functions over the
window at the largest batch and length (cProfile slows Python down: compare those numbers only with each other).
Prints a table and writes JSON (`--json`): one entry per `--label`, the file's other labels kept (e.g. "before",
run on an older checkout by putting its src first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import os
import platform
import pstats
import statistics
import time

import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import ByteTokenizer

REPLY = "Héllo wörld, ∑ 日本語 🙂 ok. "  # the stub's reply, repeated: 1- to 4-byte characters
STOP = "\n\nUser:"  # never in REPLY: every token is checked against it
PROMPT_TOKENS = 16


def stub_decode(engine: Engine, max_batch: int):
    """A stand-in for `ModelRunner.decode`: logits [B, V] whose argmax walks through REPLY's bytes, one per step
    (the same for every row), from a table built once."""
    codes = list(REPLY.encode())
    table = torch.full((len(codes), max_batch, engine.model_config.vocab_size), -1.0)
    for i, b in enumerate(codes):
        table[i, :, b] = 1.0
    step = itertools.count()

    def decode(ids, slots, lengths, carried=None):  # (the overlapped decode's carried ids are not read)
        return table[next(step) % len(codes), : len(ids)]

    return decode


def run(engine: Engine, batch: int, length: int, window: int, profile: cProfile.Profile | None) -> dict:
    gen = torch.Generator().manual_seed(batch * 7919 + length)
    params = SamplingParams(max_tokens=length + 2 * batch, temperature=0.0, ignore_eos=True, stop=[STOP])
    events: list = []
    requests = [engine.add_request(torch.randint(0, 256, (PROMPT_TOKENS,), generator=gen).tolist(), params,
                                   on_event=events.append) for _ in range(batch)]
    while any(r.prefilling or r.slot is None for r in requests):
        engine.step()
    cpu, wall = [], []
    while min(len(r.output) for r in requests) < length:
        ended = [r.finish_reason for r in requests if r.finish_reason is not None]
        if ended:
            raise SystemExit(f"bench/engine_host.py: {len(ended)} requests ended ({ended[0]!r}) before the window")
        timed = min(len(r.output) for r in requests) >= length - window
        if timed and profile is not None:
            profile.enable()
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.step()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if timed:
            if profile is not None:
                profile.disable()
            cpu.append(elapsed_cpu)
            wall.append(elapsed)
        events.clear()
    for r in requests:
        engine.cancel(r.rid)
    engine.step()
    host = statistics.median(cpu)
    return {"batch": batch, "output_tokens": length, "steps": len(cpu), "host_ms_per_step": host * 1e3,
            "host_us_per_token": host / batch * 1e6, "wall_ms_per_step": statistics.median(wall) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per batch and length; the fastest is kept")
    ap.add_argument("--label", default="current")
    ap.add_argument("--cache-mb", type=int, default=2048,
                    help="the prefix cache's device tier: room for every block's KDA checkpoint at the defaults")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default="bench/engine_host.json")
    args = ap.parse_args()
    if args.window >= min(args.lengths):
        ap.error(f"--window ({args.window}) must be below the shortest --lengths ({min(args.lengths)})")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("k3-tiny")).eval()
    batch = max(args.batches)
    engine = Engine(model, ByteTokenizer(), EngineConfig(
        prefix_cache=True, cache_bytes=args.cache_mb << 20,
        scheduler=SchedulerConfig(max_running=batch)))
    engine.runner.decode = stub_decode(engine, batch)
    rows, profiled = [], None
    print("| run | batch | output tokens | host ms / step (CPU) | host us / token | wall ms / step |\n"
          "|---|---|---|---|---|---|")
    for length in args.lengths:
        for b in args.batches:
            profile = cProfile.Profile() if args.profile and (b, length) == (batch, max(args.lengths)) else None
            runs = [run(engine, b, length, args.window, profile if i == 0 else None) for i in range(args.repeats)]
            row = {"label": args.label, "repeats": args.repeats, **min(runs, key=lambda x: x["host_ms_per_step"])}
            rows.append(row)
            print(f"| {args.label} | {b} | {length} | {row['host_ms_per_step']:.3f} | "
                  f"{row['host_us_per_token']:.1f} | {row['wall_ms_per_step']:.3f} |", flush=True)
            profiled = profile or profiled
    if profiled is not None:
        print(f"\ncProfile over the window at batch {batch}, {max(args.lengths)} tokens (top 15 by own time):")
        pstats.Stats(profiled).sort_stats("tottime").print_stats(15)
    runs = {}
    if os.path.exists(args.json):  # keep the other labels' runs (e.g. "before", from an older checkout)
        with open(args.json) as f:
            runs = json.load(f)["runs"]
    runs[args.label] = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                        "python": platform.python_version(), "torch": torch.__version__, "preset": "k3-tiny",
                        "window": args.window, "cache_mb": args.cache_mb, "rows": rows}
    with open(args.json, "w") as f:
        f.write(json.dumps({"runs": runs}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
