"""Where the serving engine's time goes on one GPU: the decode step's parts and a long prefill, in one process.

    python bench/decode_profile.py [--preset k3-debug] [--quantization mxfp4] [--batches 1 8 32 64]
                                   [--prefill-tokens 12288] [--prefill-chunks 4096 8192 16384]
                                   [--compile both|on|off] [--compile-prefill] [--json F]

The model is built on the device in bf16 (`openk3.build.build_model`, as `openk3 serve` builds it: a 48B model
fits; `--quantization mxfp4` keeps its routed experts packed). For the decode step as the engine runs it by default
on a GPU (torch.compile'd, then captured as CUDA graphs) and, with `--compile both`, captured without compiling (the
comparison), and for each batch size B: B requests (16-token prompts, greedy, ignore_eos) run through `Engine.step`
until all decode; then, averaged over `--steps` steady decode steps:
  - step_ms: one whole `Engine.step` (scheduling, the decode forward, sampling, bookkeeping, events);
  - forward_ms: `ModelRunner.decode` alone at the same batch (the CUDA-graph replay and its input copy), synced;
  - host_ms = step_ms - forward_ms: what the engine adds around the forward.
Then the top operators of a torch.profiler trace of a few steps at the smallest and the largest batch (CPU self time
and device time), and the time of one prefill of `--prefill-tokens` tokens through `ModelRunner.prefill` with the
engine's KDA checkpoints, in chunks of each `--prefill-chunks` size (what bounds time to first token; the engine's
chunk is 16384 on a GPU), that one with its top operators (host and device); and short prefills (1, 8 and 32
prompts of 16 tokens, one of 779: what a new request costs the step it joins, bound by the host's eager operations;
`--compile-prefill` compiles the units they run). Prints tables and writes JSON. The peer for these numbers is
bench/serve_gpu.py (HF transformers' generate); this script explains them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from openk3.build import build_model
from openk3.config import get_preset
from openk3.model.moe import decisive_routing
from openk3.sampling import SamplingParams
from openk3.serve.engine import GPU_PREFILL_CHUNK_TOKENS, Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import ByteTokenizer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steady_decode(engine: Engine, batch: int, steps: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(torch.randint(0, vocab, (16,), generator=gen).tolist(), params)
                for _ in range(batch)]
    while any(r.prefilling or r.slot is None for r in requests):
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    device = engine.runner.device
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    ids, slots, lengths = [r.output[-1] for r in requests], [r.slot for r in requests], [r.fed for r in requests]
    start = time.perf_counter()
    for _ in range(steps):  # the same position each time: the state advances, which does not change the work
        engine.runner.decode(ids, slots, lengths)
    sync(device)
    forward_ms = (time.perf_counter() - start) * 1e3 / steps
    for r in requests:
        engine.cancel(r.rid)
    engine.step()
    return {"batch": batch, "step_ms": step_ms, "forward_ms": forward_ms, "host_ms": step_ms - forward_ms,
            "tok_per_s": batch / step_ms * 1e3}


def decode_logits_after_prompts(engine: Engine, batch: int, vocab: int, tokens: int = 64) -> torch.Tensor:
    """The decode logits [batch, vocab] of one step after `batch` random prompts prefilled (the same prompts for
    every engine), each in its own slot; the slots and pages are given back."""
    gen = torch.Generator().manual_seed(batch + 100)
    prompts = torch.randint(0, vocab, (batch, tokens + 1), generator=gen).tolist()
    slots = [engine.states.alloc() for _ in range(batch)]
    pages = []
    for slot in slots:
        pages.append([engine.pages.alloc() for _ in range(-(-(tokens + 1) // engine.page_size))])
        engine.tables.set(slot, pages[-1])
        engine.states.reset(slot)
    engine.runner.prefill([p[:tokens] for p in prompts], slots, [0] * batch)
    logits = engine.runner.decode([p[tokens] for p in prompts], slots, [tokens] * batch).float().cpu()
    for slot, held in zip(slots, pages):
        engine.tables.set(slot, [])
        for page in held:
            engine.pages.release(page)
        engine.states.free(slot)
    return logits


def compare_engines(engines: dict, model, routing: str, batches: list[int], record: dict) -> None:
    """The compiled step's decode logits against the captured eager step's, from the same prefilled states."""
    for b in batches:
        want, got = (decode_logits_after_prompts(e, b, model.config.vocab_size) for e in engines.values())
        err = ((got - want).norm() / want.norm()).item()
        same = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        print(f"batch {b}, {routing}: compiled vs eager decode logits (bf16), relative error {err:.2e}, "
              f"same argmax {same:.0%}", flush=True)
        record.setdefault("vs_eager", {})[f"{routing}, batch {b}"] = {"rel_err": err, "same_argmax": same}


def profiled_steps(engine: Engine, batch: int, vocab: int, steps: int = 5, rows: int = 20) -> dict:
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(torch.randint(0, vocab, (16,), generator=gen).tolist(), params)
                for _ in range(batch)]
    while any(r.prefilling or r.slot is None for r in requests):
        engine.step()
    with profiled(engine.runner.device) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.runner.device)
    for r in requests:
        engine.cancel(r.rid)
    engine.step()
    return top_operators(prof, steps, rows)


def profiled(device: torch.device):
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))


def top_operators(prof, steps: int, rows: int) -> dict:
    events = prof.key_averages()
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    dev = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:rows]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return {"cpu": [{"op": e.key, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls": e.count}
                    for e in cpu],
            "device": [{"op": e.key, "device_ms_per_step": getattr(e, "self_device_time_total", 0) / 1e3 / steps,
                        "calls": e.count} for e in dev],
            # all of the step's kernels: their summed time (the step's time less this is the GPU's idle time)
            "device_busy_ms_per_step": sum(e.self_device_time_total for e in kernels) / 1e3 / steps,
            "kernels_per_step": sum(e.count for e in kernels) / steps}


SHORT_PREFILLS = [(1, 16), (8, 16), (32, 16), (1, 779)]  # (prompts, tokens each): serve_gpu's clients, a chat turn


def prefill_time(engine: Engine, tokens: int, vocab: int, chunk: int, batch: int = 1, reps: int = 3,
                 profile_it: bool = False) -> dict:
    """`batch` prompts of `tokens` each through `ModelRunner.prefill` together, in chunks of `chunk` tokens, with
    the KDA checkpoints the engine would take (`Engine._checkpoint_offsets`): the best of `reps` timed runs after a
    warm one, and with `profile_it` the top operators of one more run (host and device)."""
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, vocab, (batch, tokens), generator=gen).tolist()
    slots = [engine.states.alloc() for _ in range(batch)]
    pages = {slot: [engine.pages.alloc() for _ in range(-(-tokens // engine.page_size))] for slot in slots}
    for slot in slots:
        engine.tables.set(slot, pages[slot])

    def run():
        for slot in slots:
            engine.states.reset(slot)
        for at in range(0, tokens, chunk):
            end = min(at + chunk, tokens)
            engine.runner.prefill([p[at:end] for p in prompts], slots, [at] * batch,
                                  engine._checkpoint_offsets(at, end))
        sync(engine.runner.device)

    times = []
    for _ in range(reps + 1):
        sync(engine.runner.device)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    result = {"batch": batch, "tokens": tokens, "chunk": chunk, "ms": min(times[1:]) * 1e3}
    if profile_it:
        with profiled(engine.runner.device) as prof:
            run()
        result["profile"] = top_operators(prof, 1, 16)
        result["device_busy_ms"] = result["profile"]["device_busy_ms_per_step"]
    for slot in slots:
        engine.tables.set(slot, [])
        for page in pages[slot]:
            engine.pages.release(page)
        engine.states.free(slot)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-debug")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefill-tokens", type=int, default=12288)
    ap.add_argument("--prefill-chunks", type=int, nargs="+", default=[4096, 8192, 16384],
                    help="tokens per prefill forward to time (the engine's GPU default, or else the first, is "
                         "also profiled)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quantization", choices=["none", "mxfp4"], default="none",
                    help="mxfp4: the routed experts kept MXFP4 (as `openk3 serve --quantization mxfp4`)")
    ap.add_argument("--compile", choices=["both", "on", "off"], default="both",
                    help="decode step compiled before capture, not, or both (the comparison)")
    ap.add_argument("--compile-prefill", action="store_true",
                    help="the engines compile the prefill's FFN / norm / AttnRes units (EngineConfig.compile_prefill)")
    ap.add_argument("--json", default="bench/decode_profile.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = get_preset(args.preset)
    torch.manual_seed(0)
    model, report = build_model(cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                quantization=args.quantization)
    print(report.line(), flush=True)
    variants = {"both": [False, True], "on": [True], "off": [False]}[args.compile]
    decode, engines = {}, {}
    for compiled in variants:
        name = "compiled + CUDA graphs" if compiled else "CUDA graphs"
        started = time.perf_counter()
        engine = Engine(model, ByteTokenizer(), EngineConfig(
            prefix_cache=False, compile_decode=compiled, compile_prefill=args.compile_prefill,
            scheduler=SchedulerConfig(max_running=max(args.batches))))
        startup = time.perf_counter() - started
        print(f"\n{name}: engine ready in {startup:.1f} s ({device}, {args.preset}; "
              f"graphs {engine.runner.captured() or engine.runner.graph_error})", flush=True)
        rows = [steady_decode(engine, b, args.steps, cfg.vocab_size) for b in args.batches]
        print("| batch | engine step ms | decode forward ms | host ms | tok/s |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['host_ms']:.2f} | "
                  f"{r['tok_per_s']:,.0f} |", flush=True)
        decode[name] = {"startup_s": startup, "rows": rows}
        engines[name] = engine
    if len(engines) == 2:  # the compiled step against the captured eager one, from the same prefilled states
        for routing in ("random routers", "decisive routing"):
            with decisive_routing(model) if routing == "decisive routing" else contextlib.nullcontext():
                compare_engines(engines, model, routing, sorted({1, min(8, max(args.batches))}), decode[name])
    prof = {}
    for b in sorted({min(args.batches), max(args.batches)}):
        prof[b] = profiled_steps(engine, b, cfg.vocab_size)
        print(f"\n{name}, batch {b}: top operators by CPU self time per step:")
        for e in prof[b]["cpu"]:
            print(f"  {e['self_cpu_ms_per_step']:8.3f} ms  {e['calls']:6d}x  {e['op'][:90]}")
        print(f"top operators by device time per step (all kernels: {prof[b]['device_busy_ms_per_step']:.3f} ms, "
              f"{prof[b]['kernels_per_step']:.0f} launches):")
        for e in prof[b]["device"]:
            print(f"  {e['device_ms_per_step']:8.3f} ms  {e['calls']:6d}x  {e['op'][:90]}")
    profiled_chunk = GPU_PREFILL_CHUNK_TOKENS if GPU_PREFILL_CHUNK_TOKENS in args.prefill_chunks else \
        args.prefill_chunks[0]
    pre = [prefill_time(engine, args.prefill_tokens, cfg.vocab_size, chunk, profile_it=chunk == profiled_chunk)
           for chunk in args.prefill_chunks]
    short = [prefill_time(engine, tokens, cfg.vocab_size, tokens, batch) for batch, tokens in SHORT_PREFILLS
             if batch <= max(args.batches)]
    print("\nshort prefills (what a new request costs the step it joins):\n| prompts | tokens each | ms |\n"
          "|---|---|---|")
    for p in short:
        print(f"| {p['batch']} | {p['tokens']} | {p['ms']:.1f} |", flush=True)
    for p in pre:
        print(f"\nprefill of {p['tokens']} tokens in chunks of {p['chunk']}: {p['ms']:.1f} ms", flush=True)
        if "profile" in p:
            print(f"profiled: device busy {p['device_busy_ms']:.1f} ms; top operators by CPU self time, then device:")
            for e in p["profile"]["cpu"]:
                print(f"  {e['self_cpu_ms_per_step']:8.3f} ms  {e['calls']:6d}x  {e['op'][:90]}")
            for e in p["profile"]["device"]:
                print(f"  {e['device_ms_per_step']:8.3f} ms  {e['calls']:6d}x  {e['op'][:90]}", flush=True)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "preset": args.preset,
              "quantization": args.quantization,
              "compile_prefill": args.compile_prefill, "decode": decode, "profile": prof, "prefill": pre,
              "short_prefills": short}
    with open(args.json, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
