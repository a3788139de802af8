"""The serving engine under mixed traffic, in one process (no HTTP): where a step's time goes when long prompts
arrive while others decode.

    python bench/engine_mixed.py [--preset k3-debug] [--rate 12] [--requests 96] [--prompt 1000:11000]
                                 [--reply 32:256] [--top-p 1] [--engine KEY=VALUE ...] [--runs RUN[:KEY=VALUE,...] ...]
                                 [--forward-costs] [--profile] [--label L] [--json F] [--smoke]

Builds the engine `openk3 serve` builds by default on a GPU (bf16, compiled decode in CUDA graphs, the prefix
cache on; `--engine` overrides EngineConfig or SchedulerConfig fields, e.g. `--engine prefill_tokens_per_step=8192`)
and feeds it bench/serve_gpu.py's mixed stream as token ids: Poisson arrivals at `--rate` a second, prompts and
replies uniform in the given ranges (random ids, temperature 0.8), each request added when its arrival time has
passed and the loop calls `Engine.step` in between, as the engine process does. Reports
  - output tokens a second over the run;
  - TTFT p50 / p99 (arrival to the first token, as the engine stamps it) and the inter-token latency a decoding
    sequence sees (the steps it decodes in: p50 / p99 of their wall time, weighted by the sequences decoding);
  - the steps by kind (decode only, decode + prefill, prefill only): count, wall ms p50 / p99, prefill tokens and
    forwards per step, and the prefill throughput (prompt tokens over the prefill steps' time);
  - with `--profile`, cProfile's top functions over the whole run (host time by function: the engine's own Python,
    the model's eager prefill launches, waits on the device).
This explains bench/serve_gpu.py's mixed-stream row (its peer comparison is there); it prints a table and writes
JSON (`--json`, one entry per `--label`). `--smoke` runs it on the CPU at toy sizes (k3-tiny).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import random
import statistics
import time
from collections.abc import Callable

import torch

from common import default_json  # bench/common.py (the script's folder is on sys.path)
from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import ByteTokenizer


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def overrides(pairs: list[str]) -> tuple[dict, dict]:
    """KEY=VALUE pairs -> (EngineConfig fields, SchedulerConfig fields), values parsed as Python literals."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    engine, sched = {}, {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        parsed = eval(value, {}) if value else None  # noqa: S307 (a bench's own command line)
        if key in engine_fields:
            engine[key] = parsed
        elif key in sched_fields:
            sched[key] = parsed
        else:
            raise SystemExit(f"--engine: no EngineConfig or SchedulerConfig field {key!r}")
    return engine, sched


SLOWEST = 8  # the slowest steps of a run, listed


def fed_prompt(requests: list) -> int:
    """Prompt tokens prefilled so far over all the requests (a preempted request's recompute is not counted:
    `prefill_len` grows with every decoded token)."""
    return sum(min(r.fed, len(r.prompt)) for _, r in requests)


def allocator_events(device: torch.device) -> tuple[int, int]:
    """(retries, device mallocs + frees) of the caching allocator so far: a retry frees every cached block (a device
    sync) to fit an allocation, and a cudaMalloc / cudaFree synchronises too; a step that did either shows why it
    was slow. (0, 0) off CUDA."""
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)


WORKLOAD = ("rate", "requests", "prompt", "reply", "top_p")  # a run's own stream (--runs)


def apply_settings(engine: Engine, args: argparse.Namespace, pairs: str) -> argparse.Namespace:
    """'KEY=VALUE,...': scheduler fields (prefill_tokens_per_step) and engine attributes (checkpoint_every,
    chunk_blocks, idle_prefill, overlap) set on a built engine, for a run; the stream's options (WORKLOAD) for this
    run alone. Returns the run's options."""
    sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    args = argparse.Namespace(**vars(args))
    for pair in filter(None, pairs.split(",")):
        key, _, value = pair.partition("=")
        if key in WORKLOAD:
            setattr(args, key, value if key in ("prompt", "reply") else float(value))
            continue
        target = engine.scheduler.config if key in sched_fields else engine
        if not hasattr(target, key):
            raise SystemExit(f"--runs: no scheduler field or engine attribute {key!r}")
        setattr(target, key, int(value))
    args.requests = int(args.requests)
    return args


def forward_costs(engine: Engine, shapes: list[tuple[int, int]], repeats: int = 5) -> list[dict]:
    """Wall ms of one prefill forward (`ModelRunner.prefill` on the padding slot, KDA checkpoints every 512 tokens)
    of B rows x T tokens, synced, and the host's share (the same calls without a sync: launch time)."""
    runner, pad, rows = engine.runner, engine.states.padding_slot, []
    for B, T in shapes:
        chunks, offsets = [[0] * T] * B, engine._checkpoint_offsets(0, T)
        runner.prefill(chunks, [pad] * B, [0] * B, offsets)  # warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            runner.prefill(chunks, [pad] * B, [0] * B, offsets)
        host = (time.perf_counter() - t0) / repeats
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / repeats
        rows.append({"batch": B, "tokens": T, "wall_ms": wall * 1e3, "launch_ms": host * 1e3})
    return rows


# where a step's host time goes (engine methods): admission, the decode step, reading its tokens, prefill forwards
# (`_prefill`, a split forward's first pieces included), a split forward's later pieces, prefix-cache bookkeeping
PHASES = ("_start", "_decode", "_drain", "_prefill", "_advance_split", "_register_blocks")


def _timed(method: Callable, phase: str, spent: dict[str, float]) -> Callable:
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - t0
    return timed


def timed_phases(engine: Engine) -> tuple[dict[str, float], Callable[[], None]]:
    """Wrap the engine's PHASES (instance attributes over the methods) to add their host seconds into the returned
    dict, which the caller clears per step; the second value undoes the wrapping. Device work a phase launches
    counts where the host waits for it. (Phases nest: `_prefill` holds its forward's first pieces and the
    bookkeeping after it.)"""
    spent = dict.fromkeys(PHASES, 0.0)
    for phase in PHASES:
        setattr(engine, phase, _timed(getattr(engine, phase), phase, spent))

    def undo() -> None:
        for phase in PHASES:
            delattr(engine, phase)  # the class's methods again
    return spent, undo


def run(engine: Engine, args: argparse.Namespace, vocab: int, seed: int = 0) -> dict:
    rng, ids = random.Random(7), random.Random(seed)  # the same arrivals and lengths each run, fresh token ids
    at, arrivals = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        prompt = [ids.randrange(vocab) for _ in range(rng.randint(*span(args.prompt)))]
        arrivals.append((at, prompt, rng.randint(*span(args.reply))))
    requests, steps = [], []
    device = engine.runner.device
    spent, untime = timed_phases(engine)
    start = time.perf_counter()
    pending = list(arrivals)
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            t, prompt, reply = pending.pop(0)
            params = SamplingParams(max_tokens=reply, temperature=0.8, top_p=args.top_p, ignore_eos=True)
            requests.append((start + t, engine.add_request(prompt, params)))
        if not engine.has_work():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        decoding = sum(1 for r in engine.scheduler.running if not r.prefilling)
        before, forwards = fed_prompt(requests), engine.metrics.prefill_forwards
        retries, mallocs = allocator_events(device)
        spent.update(dict.fromkeys(PHASES, 0.0))
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        prefill = max(0, fed_prompt(requests) - before)  # (a preempted sequence starts again from 0)
        retries_after, mallocs_after = allocator_events(device)
        steps.append({"wall_s": wall, "decoding": decoding, "prefill_tokens": prefill,
                      "prefill_forwards": engine.metrics.prefill_forwards - forwards,
                      "alloc_retries": retries_after - retries, "device_mallocs": mallocs_after - mallocs,
                      "phase_ms": {name.strip("_"): round(t * 1e3, 1) for name, t in spent.items()}})
    untime()
    duration = time.perf_counter() - start
    ttft = [r.first_token_at - t for t, r in requests if r.first_token_at is not None]
    itl = [s["wall_s"] for s in steps for _ in range(s["decoding"])]
    kinds = {"decode": [s for s in steps if s["decoding"] and not s["prefill_tokens"]],
             "decode+prefill": [s for s in steps if s["decoding"] and s["prefill_tokens"]],
             "prefill": [s for s in steps if not s["decoding"] and s["prefill_tokens"]]}
    table = {}
    for kind, rows in kinds.items():
        walls = [s["wall_s"] for s in rows]
        tokens = sum(s["prefill_tokens"] for s in rows)
        table[kind] = {"steps": len(rows), "wall_ms_p50": percentile(walls, 0.5) * 1e3,
                       "wall_ms_p99": percentile(walls, 0.99) * 1e3, "seconds": sum(walls),
                       "prefill_tokens_per_step": tokens / len(rows) if rows else 0.0,
                       "forwards_per_step": sum(s["prefill_forwards"] for s in rows) / len(rows) if rows else 0.0,
                       "prefill_tok_per_s": tokens / sum(walls) if tokens else 0.0}
    output = sum(len(r.output) for _, r in requests)
    return {"duration_s": duration, "prompt_tokens": sum(len(p) for _, p, _ in arrivals), "output_tokens": output,
            "output_tok_per_s": output / duration,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99), "steps": table,
            "alloc_retries": sum(s["alloc_retries"] for s in steps),
            "device_mallocs": sum(s["device_mallocs"] for s in steps),
            "slowest": sorted(steps, key=lambda s: s["wall_s"], reverse=True)[:SLOWEST],
            "mean_step_ms": statistics.fmean(s["wall_s"] for s in steps) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help="model preset (default k3-debug; k3-tiny with --smoke)")
    ap.add_argument("--rate", type=float, default=None, help="arrivals a second (default 12)")
    ap.add_argument("--requests", type=int, default=None, help="requests (default 96)")
    ap.add_argument("--prompt", default=None, help="prompt tokens LO:HI (default 1000:11000)")
    ap.add_argument("--reply", default=None, help="reply tokens LO:HI (default 32:256)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the replies' top_p (default 1: temperature alone)")
    ap.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                    help="EngineConfig / SchedulerConfig fields to override")
    ap.add_argument("--label", default="engine", help="this engine's entries in the JSON (LABEL/RUN)")
    ap.add_argument("--runs", nargs="+", default=["default"], metavar="RUN[:KEY=VALUE,...]",
                    help="runs of the stream on the one engine, each with these scheduler fields or engine "
                         "attributes set first (e.g. 'budget8k:prefill_tokens_per_step=8192', 'sync:overlap=0'; "
                         "they stay set) and its own stream options (rate, requests, prompt, reply, top_p: e.g. "
                         "'short:rate=1000,requests=64,prompt=60:200,reply=256')")
    ap.add_argument("--forward-costs", action="store_true",
                    help="first time prefill forwards of B x T tokens (GPU): wall and launch ms")
    ap.add_argument("--profile", action="store_true", help="cProfile the first run: top functions by own time")
    ap.add_argument("--smoke", action="store_true", help="on the CPU at toy sizes")
    ap.add_argument("--json", default=None,
                    help="where the runs are kept, by label (default bench/engine_mixed.json; under --smoke the "
                         "temp directory's)")
    args = ap.parse_args()
    args.json = args.json or default_json("engine_mixed.json", args.smoke)
    sizes = dict(preset="k3-tiny", rate=8.0, requests=8, prompt="100:600", reply="4:12") if args.smoke else \
        dict(preset="k3-debug", rate=12.0, requests=96, prompt="1000:11000", reply="32:256")
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/engine_mixed.py: error: needs a CUDA GPU; --smoke runs it on the CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    cfg = get_preset(args.preset)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device, torch.float32 if args.smoke else torch.bfloat16).eval()
    engine_fields, sched_fields = overrides(args.engine)
    started = time.perf_counter()
    engine = Engine(model, ByteTokenizer(), EngineConfig(**engine_fields, scheduler=SchedulerConfig(**sched_fields)))
    built = f"{args.preset} on {device}; {args.engine or 'defaults'}"
    print(f"engine ready in {time.perf_counter() - started:.1f} s ({built})", flush=True)
    kept = {}
    if os.path.exists(args.json):
        with open(args.json) as fh:
            kept = json.load(fh)
    if args.forward_costs and device.type == "cuda":
        shapes = [(1, 512), (1, 4096), (1, 8192), (2, 4096), (4, 4096), (8, 4096), (1, 16384)]
        costs = forward_costs(engine, shapes)
        print("| prefill forward B x T | wall ms | launch ms |\n|---|---|---|")
        for row in costs:
            print(f"| {row['batch']} x {row['tokens']} | {row['wall_ms']:.1f} | {row['launch_ms']:.1f} |", flush=True)
        kept[f"{args.label}/forward_costs"] = costs
    for index, spec in enumerate(args.runs):
        label, _, pairs = spec.partition(":")
        run_args = apply_settings(engine, args, pairs)
        profiler = cProfile.Profile() if args.profile and index == 0 else None
        if profiler:
            profiler.enable()
        result = run(engine, run_args, min(cfg.vocab_size, 256), seed=index)
        if profiler:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            result["profile"] = text.getvalue()
            print(result["profile"])
        print(f"\n{args.label}/{label}: {run_args.requests} requests at {run_args.rate}/s, prompts {run_args.prompt}, "
              f"replies {run_args.reply}, top_p {run_args.top_p}: {result['duration_s']:.1f} s, "
              f"{result['output_tok_per_s']:,.0f} output tok/s; TTFT p50 {result['ttft_p50_s']:.3f} s, p99 "
              f"{result['ttft_p99_s']:.3f} s; ITL p50 {result['itl_p50_s'] * 1e3:.1f} ms, p99 "
              f"{result['itl_p99_s'] * 1e3:.1f} ms")
        print("| steps | count | wall ms p50 | p99 | seconds | prefill tokens/step | forwards/step | prefill tok/s |")
        print("|---|---|---|---|---|---|---|---|")
        for kind, row in result["steps"].items():
            print(f"| {kind} | {row['steps']} | {row['wall_ms_p50']:.1f} | {row['wall_ms_p99']:.1f} | "
                  f"{row['seconds']:.2f} | {row['prefill_tokens_per_step']:.0f} | {row['forwards_per_step']:.2f} | "
                  f"{row['prefill_tok_per_s']:,.0f} |", flush=True)
        print(f"allocator: {result['alloc_retries']} retries, {result['device_mallocs']} device mallocs + frees")
        print("slowest steps (ms, decoding, prefill tokens, forwards, allocator retries, mallocs): " + "; ".join(
            f"{s['wall_s'] * 1e3:.0f}, {s['decoding']}, {s['prefill_tokens']}, {s['prefill_forwards']}, "
            f"{s['alloc_retries']}, {s['device_mallocs']}" for s in result["slowest"]), flush=True)
        for s in result["slowest"][:4]:
            print(f"  {s['wall_s'] * 1e3:.0f} ms: host ms by phase {s['phase_ms']}")
        name = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
        kept[f"{args.label}/{label}"] = {"engine": args.engine, "settings": pairs, "preset": args.preset,
                                         "stream": {key: getattr(run_args, key) for key in WORKLOAD},
                                         "device": name, "date": time.strftime("%Y-%m-%d"),
                                         "torch": torch.__version__, **result}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(kept, fh, indent=1)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
