"""Decode and time to first token by context length, in one process on one GPU: where long contexts cost.

    python bench/decode_context.py [--preset k3-debug] [--contexts 256 8192 32768 61440] [--steps 32]
                                   [--splits 16 64 128] [--profile-ttft] [--json F]

For each context length L: one request of L random tokens (greedy, ignore_eos) through `Engine.step` with the
engine's GPU defaults: TTFT (submit to first token, synced), then over `--steps` steady decode steps step_ms (a
whole `Engine.step`) and forward_ms (`ModelRunner.decode` alone, the CUDA-graph replay); host_ms is their
difference; and the caching allocator's retries, cudaMalloc / cudaFree calls and device-wide syncs during the
prefill. The same with the prefix cache off at the longest L (`--profile-ttft`: one more prefill of that length
profiled, either way). Then the paged MLA decode kernel alone on one layer's latents of L positions at each
`--splits` count (batch 1 and 64), and a torch.profiler table of a few engine steps at the longest L. Prints tables
and writes JSON. It explains bench/serve_gpu.py's long-context rows; it has no peer of its own.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.ops.paged_mla import paged_mla_decode
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import ByteTokenizer


def sync() -> None:
    torch.cuda.synchronize()


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts() -> dict:
    """The caching allocator's counters that cost device time: retries after a failed cudaMalloc (each frees the
    cache and synchronizes), cudaMalloc / cudaFree calls, whole-device synchronizations."""
    stats = torch.cuda.memory_stats()
    return {name: stats.get(name, 0) for name in ALLOCATOR_COUNTS}


def profile_tables(prof, rows: int = 12) -> str:
    """The profiler's top device kernels and top host ops."""
    averages = prof.key_averages()
    return (averages.table(sort_by="self_cuda_time_total", row_limit=rows) + "\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=rows))


def context_run(engine: Engine, length: int, steps: int, vocab: int, profile_ttft: bool = False,
                seed: int | None = None) -> dict:
    """One request of `length` random tokens (seeded by `seed`, else by `length`): TTFT, the allocator's counts
    during the prefill, then the steady decode step. With `profile_ttft` the prefill runs under torch.profiler (its
    tables are printed; that TTFT includes the profiler's overhead)."""
    gen = torch.Generator().manual_seed(length if seed is None else seed)
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    sync()
    before = allocator_counts()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if profile_ttft else nullcontext() as prof:
        start = time.perf_counter()
        r = engine.add_request(torch.randint(0, vocab, (length,), generator=gen).tolist(), params)
        while not r.output:
            engine.step()
        sync()
        ttft = time.perf_counter() - start
    if profile_ttft:
        print(f"the prefill of {length} tokens under the profiler ({ttft:.3f} s):\n{profile_tables(prof)}", flush=True)
    allocator = {name: count - before[name] for name, count in allocator_counts().items()}
    for _ in range(3):
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    start = time.perf_counter()
    for _ in range(steps):
        engine.runner.decode([r.output[-1]], [r.slot], [r.fed])
    sync()
    forward_ms = (time.perf_counter() - start) * 1e3 / steps
    engine.cancel(r.rid)
    engine.step()
    return {"context": length, "ttft_s": ttft, "step_ms": step_ms, "forward_ms": forward_ms,
            "host_ms": step_ms - forward_ms, "tok_per_s": 1e3 / step_ms, "ttft_allocator": allocator,
            "ttft_profiled": profile_ttft}


def kernel_times(model, length: int, splits: list[int], batch: int) -> dict:
    mc = model.config
    P, R, r, H = 768, mc.mla.kv_lora_rank, mc.mla.qk_rope_head_dim, mc.mla.num_heads
    pages = -(-length // P)
    pool = torch.randn(batch * pages + 1, P, R + r, device="cuda", dtype=torch.bfloat16)
    tables = (1 + torch.arange(batch * pages, device="cuda", dtype=torch.int32)).view(batch, pages)
    q = torch.randn(batch, H, R + r, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(batch, device="cuda")
    lengths = torch.full((batch,), length, device="cuda")
    out = {}
    from triton.testing import do_bench
    for s in splits:
        out[s] = do_bench(lambda s=s: paged_mla_decode(q, pool, tables, rows, lengths, R, 0.1, s), return_mode="median")
    read = batch * length * (R + r) * 2
    return {"context": length, "batch": batch, "ms_by_splits": out, "floor_ms": read / 4.3e12 * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-debug")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 8192, 32768, 61440])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--splits", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--profile-ttft", action="store_true",
                    help="also profile one more prefill at the longest context, prefix cache on and off")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_context.py: needs a CUDA GPU")
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(args.preset)).to("cuda", torch.bfloat16)
    vocab = model.config.vocab_size
    tok = ByteTokenizer()
    result: dict = {"preset": args.preset, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for cache in (True, False):
        started = time.perf_counter()
        engine = Engine(model, tok, EngineConfig(prefix_cache=cache, max_model_len=max(args.contexts) + args.steps + 64,
                                                 scheduler=SchedulerConfig(max_running=64)))
        print(f"engine (prefix cache {cache}) built in {time.perf_counter() - started:.1f} s", flush=True)
        rows = []
        for length in (args.contexts if cache else args.contexts[-1:]):
            row = context_run(engine, length, args.steps, vocab)
            rows.append(row)
            print(f"cache {cache} L={length}: ttft {row['ttft_s']:.3f} s, step {row['step_ms']:.2f} ms, "
                  f"forward {row['forward_ms']:.2f} ms, host {row['host_ms']:.2f} ms; during the prefill "
                  f"{row['ttft_allocator']}", flush=True)
        result["cache_on" if cache else "cache_off"] = rows
        if args.profile_ttft:  # a prompt of its own: no prefix-cache hit
            rows.append(context_run(engine, args.contexts[-1], 4, vocab, profile_ttft=True, seed=2))
        if cache:
            gen = torch.Generator().manual_seed(1)
            r = engine.add_request(torch.randint(0, vocab, (args.contexts[-1],), generator=gen).tolist(),
                                   SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
            while not r.output:
                engine.step()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    engine.step()
                sync()
            engine.cancel(r.rid)
            engine.step()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
            print(table, flush=True)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), flush=True)
        del engine
        torch.cuda.empty_cache()
    result["kernel"] = [kernel_times(model, L, args.splits, b) for L in args.contexts for b in (1, 64)
                        if b * L <= 64 * 16384]
    print(f"{'L':>7} {'B':>3} " + " ".join(f"S={s:<6}" for s in args.splits) + " floor", flush=True)
    for k in result["kernel"]:
        print(f"{k['context']:>7} {k['batch']:>3} " + " ".join(f"{v:8.4f}" for v in k["ms_by_splits"].values())
              + f" {k['floor_ms']:.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
