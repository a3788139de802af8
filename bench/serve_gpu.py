"""`openk3 serve` on one GPU against HF transformers' generate(), in one run (issue 12; SPEC §14).

    python bench/serve_gpu.py [--preset k3-debug] [--only server|peer] [--json bench/serve_gpu.json]

1. Starts `openk3 serve --preset k3-debug --device cuda` as a real process (bf16, CUDA graphs, up to 64 running
   sequences), waits for /health and reads the CUDA-graph capture time from its log.
2. Decode: C = 1, 8, 32, 64 concurrent clients, each one /v1/completions of 128 new tokens (`ignore_eos`, greedy)
   from its own 16-token prompt; wall-clock tokens per second over all clients (after a short warm-up round at
   the same C), and the engine's side of each run from /metrics (its steps and their mean wall time, its prefill
   forwards, the slowest step so far).
3. TTFT of a 12k-token prompt: a streamed completion, time to the first chunk (median of three fresh prompts).
4. GPU memory in use with the server loaded (nvidia-smi, the whole card, minus what was used before it started).
5. In this process, on the same GPU engine: the decode step teacher-forced against the model's forward (logits
   difference, argmax agreement), in fp32 (graphs, eager) and in the serving dtype with decisive routing
   (`openk3.model.moe.decisive_routing`; compiled + graphs, graphs, eager); then the multi-turn agent trace of
   bench/serve.py (its code) with the K3 prefix cache and with the block-aligned baseline: reused tokens against
   the ideal, and TTFT (`--skip-trace` keeps the --json file's figures for this step).
6. The peer: transformers' KimiLinearForCausalLM with k3-debug's dimensions (Kimi Linear's softplus gate, low-rank
   output gate, plain residuals, full-width MoE), bf16, fla's kernels when fla is importable, generate() of 128
   new tokens at batch = the same client counts, no HTTP.
Prints a table last and writes JSON (one row per concurrency: concurrency, tok_per_s, peer_tok_per_s; plus
ttft_12k_s and the rest). Without CUDA it stops with a one-line error; `--smoke` runs the same steps on the CPU at
toy sizes (k3-tiny, short generations) to check the script itself.

Imports: torch, httpx, transformers (the peer), and this repository's openk3 and bench/serve.py; the server
process needs fastapi, uvicorn and pydantic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import serve as trace_bench  # noqa: E402  (bench/serve.py: the agent trace and its policies)
from openk3.config import get_preset  # noqa: E402
from openk3.model import K3ForCausalLM  # noqa: E402
from openk3.model.moe import decisive_routing  # noqa: E402
from openk3.serve.engine import GPU_PREFILL_TOKENS, Engine, EngineConfig, default_block_sizes  # noqa: E402
from openk3.serve.scheduler import SchedulerConfig  # noqa: E402
from openk3.tokenizer import ByteTokenizer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_memory_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return float(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class Server:
    """`openk3 serve` as a child process; its log goes to a file."""

    def __init__(self, args: argparse.Namespace, device: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keep_log = args.server_log is not None
        self.log = open(args.server_log, "w+") if self.keep_log else \
            tempfile.NamedTemporaryFile("w+", prefix="openk3-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "openk3", "serve", "--preset", args.preset, "--device", device,
               "--port", str(self.port), "--max-running", str(max(args.concurrency)),
               "--cache-mb", str(args.cache_mb), "--log-level", "info" if self.keep_log else "warning",
               "--dtype", "float32" if args.smoke else args.dtype] + (["--threads", "1"] if args.smoke else []) + \
            (["--compile-prefill"] if args.compile_prefill else []) + \
            (["--short-prefill", str(args.short_prefill)] if args.short_prefill is not None else [])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy after {timeout:.0f} s:\n{self.text()[-3000:]}")

    def text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def graphs(self) -> tuple[float | None, str]:
        """(CUDA-graph capture seconds or None, the server's line about its graphs)."""
        line = next((x for x in self.text().splitlines() if "CUDA graphs" in x), "no CUDA graphs line in the log")
        found = re.search(r"captured in ([0-9.]+) s", line)
        return (float(found.group(1)) if found else None), line

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not self.keep_log:
            os.unlink(self.log.name)


async def complete(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                   temperature: float) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True}
    reply = await client.post("/v1/completions", json=body)
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


async def decode_rate(url: str, model: str, clients: int, new_tokens: int, vocab: int, seed: int,
                      temperature: float) -> float:
    """Tokens per second over `clients` concurrent requests of `new_tokens` each (distinct 16-token prompts)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(16)] for _ in range(clients)]
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(complete(client, model, p, new_tokens, temperature) for p in prompts))
        wall = time.perf_counter() - start
    return sum(done) / wall


def engine_counters(url: str) -> dict[str, float]:
    """The engine's step counters from /metrics (steps, step seconds, prefill forwards, the slowest step so far)."""
    names = {"openk3_engine_steps_total": "steps", "openk3_engine_step_seconds_total": "step_s",
             "openk3_engine_prefill_forwards_total": "prefill_forwards",
             "openk3_engine_slowest_step_seconds": "slowest_step_s"}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {names[line.split()[0]]: float(line.split()[1]) for line in text.splitlines()
            if line.split() and line.split()[0] in names}


async def ttft(url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            reply.raise_for_status()
            first = None
            async for line in reply.aiter_lines():  # read to the end: the request finishes normally
                if first is None and line.startswith("data: "):
                    first = time.perf_counter() - start
    return first


def decode_consistency(model, engines: dict[str, dict], batch: int = 3, prompt: int = 40, steps: int = 16) -> dict:
    """Teacher-forced decode through the engine's runner (3 rows: in CUDA graphs they run in the 4-row graph, one
    padding row) against the model's full forward in the model's dtype: max |logits difference| / max |logits| and
    the share of positions whose argmax agrees, for each named engine configuration (`EngineConfig` fields). The
    key says whether graphs were captured (a capture can fail and fall back to eager)."""
    gen = torch.Generator().manual_seed(5)
    seqs = torch.randint(0, model.config.vocab_size, (batch, prompt + steps), generator=gen)
    with torch.no_grad():
        want = model(seqs.to(next(model.parameters()).device)).logits[:, prompt - 1:-1].float()
    out = {}
    for name, fields in engines.items():
        engine = Engine(model, ByteTokenizer(), EngineConfig(prefix_cache=False,
                                                             scheduler=SchedulerConfig(max_running=4), **fields))
        slots = [engine.states.alloc() for _ in range(batch)]
        for slot in slots:
            engine.tables.set(slot, [engine.pages.alloc() for _ in range(-(-(prompt + steps) // engine.page_size))])
        with torch.no_grad():
            rows = [[engine.runner.prefill([seq[:prompt].tolist()], [slot], [0])[0][0]] for seq, slot in zip(seqs,
                                                                                                               slots)]
            for t in range(steps - 1):
                # a copy: with graphs, decode returns a view of the graph's output, which the next replay rewrites
                logits = engine.runner.decode(seqs[:, prompt + t].tolist(), slots, [prompt + t] * batch).clone()
                for b in range(batch):
                    rows[b].append(logits[b])
        got = torch.stack([torch.stack(r) for r in rows]).float()
        captured = "graphs captured" if engine.runner.graphs else "eager"
        out[f"{name} ({captured})"] = {"max_rel_diff": ((got - want).abs().max() / want.abs().max()).item(),
                                       "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}
    return out


def agent_trace(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """bench/serve.py's trace through the engine on this device: the K3 policy and the block-aligned baseline;
    first, the decode step checked against the model's forward."""
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(args.preset)).to(device=device, dtype=torch.float32).eval()
    # in fp32 the engine must equal the forward (not compiled: the fp32 experts loop reads its counts on the host,
    # so its graph capture falls back to eager); in `dtype` with decisive routing (a random router's near-ties would
    # flip experts between two orders of summation, bench/RESULTS.md) the serving configurations, within rounding
    plain = dict(compile_decode=False)
    checks = decode_consistency(model, {"fp32 graphs": dict(plain, cuda_graphs=True),
                                        "fp32 eager": dict(plain, cuda_graphs=False)})
    model = model.to(dtype)
    name = str(dtype).removeprefix("torch.")
    with decisive_routing(model):
        checks |= decode_consistency(model, {f"{name} compiled + graphs": {}, f"{name} graphs": dict(plain),
                                             f"{name} eager": dict(plain, cuda_graphs=False)})
    out = {"decode_vs_forward": checks}
    print(f"decode checks: {json.dumps(checks)}", flush=True)
    h, P = default_block_sizes(model.config.max_seq_len)
    # the trace measures reuse and prefill TTFT: its engines capture graphs but skip compiling the decode step
    targs = argparse.Namespace(hash_block=h, page_size=P, cache_mb=args.cache_mb, sparse_every=4,
                               prefill_tokens=args.prefill_tokens, max_tokens=args.trace_new_tokens,
                               turns=args.trace_turns, compile_decode=False)
    trace = trace_bench.build_trace(0, args.trace_sessions, args.trace_turns, args.trace_system_tokens,
                                    tuple(args.trace_tool_tokens))
    for policy in ("k3", "baseline"):
        res = trace_bench.run_policy(model, policy, trace, targs)
        print(f"agent trace, {policy}: {res['reused_tokens']} of {res['ideal_tokens']} reusable tokens reused, "
              f"TTFT mean {res['ttft_mean_s']:.3f} s", flush=True)
        out[policy] = {"reused_tokens": res["reused_tokens"], "ideal_tokens": res["ideal_tokens"],
                       "reuse_of_ideal": res["reused_tokens"] / max(1, res["ideal_tokens"]),
                       "ttft_mean_s": res["ttft_mean_s"], "ttft_p90_s": res["ttft_p90_s"],
                       "requests": res["requests"], "hash_block": res["hash_block"]}
    del model
    return out


def peer_config(preset: str):
    """transformers' KimiLinearConfig with the preset's dimensions (Kimi Linear's own gates and MoE)."""
    import transformers

    from openk3.interop.configs import config_to_hub

    k3 = get_preset(preset)
    kimi = get_preset("kimi-linear-48b").with_overrides({
        "vocab_size": k3.vocab_size, "hidden_size": k3.hidden_size, "num_layers": k3.num_layers,
        "mla_layers": list(k3.mla_layers), "dense_hidden": k3.dense_hidden, "max_seq_len": k3.max_seq_len,
        "kda": {"num_heads": k3.kda.num_heads, "head_dim": k3.kda_head_dim},
        "mla": {"num_heads": k3.mla.num_heads, "kv_lora_rank": k3.mla.kv_lora_rank,
                "qk_nope_head_dim": k3.mla.qk_nope_head_dim, "qk_rope_head_dim": k3.mla.qk_rope_head_dim,
                "v_head_dim": k3.mla.v_head_dim},
        "moe": {"num_experts": k3.moe.num_experts, "top_k": k3.moe.top_k, "expert_hidden": k3.moe.expert_hidden,
                "num_shared_experts": k3.moe.num_shared_experts},
    })
    fields = {k: v for k, v in config_to_hub(kimi).items() if k not in ("architectures", "model_type")}
    return transformers.KimiLinearConfig(**fields)


def peer_rates(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple[dict[int, float], dict]:
    """HF generate() tokens per second at each batch size (greedy, exactly `new_tokens` new tokens)."""
    import transformers

    try:
        import fla  # noqa: F401

        fla_version = getattr(fla, "__version__", "installed")
    except ImportError:
        fla_version = None
    torch.manual_seed(0)
    cfg = peer_config(args.preset)
    model = transformers.KimiLinearForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    rates = {}
    for batch in args.concurrency:
        ids = torch.randint(0, cfg.vocab_size, (batch, 16), generator=gen).to(device)
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
            sync(device)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kw)
            sync(device)
        rates[batch] = batch * (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
    del model
    return rates, {"transformers": transformers.__version__, "fla": fla_version, "parameters": params}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="model preset (default k3-debug; k3-tiny with --smoke)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="clients (default 1 8 32 64)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per completion (default 128)")
    ap.add_argument("--ttft-tokens", type=int, default=None, help="long-prompt length (default 12288)")
    ap.add_argument("--cache-mb", type=int, default=4096, help="prefix cache device tier of the engines (MiB)")
    ap.add_argument("--prefill-tokens", type=int, default=GPU_PREFILL_TOKENS,
                    help="prefill budget per step of the trace engines (default: the server's on a GPU)")
    ap.add_argument("--trace-sessions", type=int, default=8)
    ap.add_argument("--trace-turns", type=int, default=6)
    ap.add_argument("--trace-system-tokens", type=int, default=1500)
    ap.add_argument("--trace-tool-tokens", type=int, nargs=2, default=(64, 256))
    ap.add_argument("--trace-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the server's and the peer's weights (the 2026-12-01 numbers: bfloat16)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.8, 0.0],
                    help="sampling temperatures of the decode runs, each a run of its own (default 0.8 0: the "
                         "issue's setting, then greedy); the table's figure is the first's (the peer is greedy)")
    ap.add_argument("--short-prefill", type=int, default=None, metavar="N",
                    help="start the server with --short-prefill N (default: the server's own)")
    ap.add_argument("--smoke", action="store_true", help="run every step on the CPU at toy sizes")
    ap.add_argument("--compile-prefill", action="store_true",
                    help="start the server with --compile-prefill (the prefill's FFN / norm / AttnRes units compiled)")
    ap.add_argument("--only", choices=["server", "peer"], default=None,
                    help="run one half and keep the other's figures from the --json file if it has them (the server "
                         "compiles its decode step for ~2 min at start and fla autotunes for minutes: on a device "
                         "with a 10-minute limit per command they go in two calls)")
    ap.add_argument("--skip-trace", action="store_true",
                    help="leave out step 5 (the in-process decode checks and agent trace) and keep the --json file's "
                         "figures for it")
    ap.add_argument("--server-log", default=None,
                    help="keep the server's log here, at log level info (its slow engine steps, each request)")
    out_dir = os.environ.get("OUT", str(BENCH))
    ap.add_argument("--json", default=os.path.join(out_dir, "serve_gpu.json"))
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/serve_gpu.py: error: needs a CUDA GPU (torch sees none); --smoke runs it on the CPU")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)  # toy matmuls: one thread each for the bench and the server is much faster
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    small = dict(preset="k3-tiny", concurrency=[1, 4], new_tokens=8, ttft_tokens=600, trace_sessions=3,
                 trace_turns=3, trace_system_tokens=100, trace_tool_tokens=(8, 24), trace_new_tokens=6, cache_mb=64,
                 prefill_tokens=256)
    full = dict(preset="k3-debug", concurrency=[1, 8, 32, 64], new_tokens=128, ttft_tokens=12288)
    for key, value in (small if args.smoke else full).items():
        if getattr(args, key) is None or args.smoke:
            setattr(args, key, value)
    t0 = time.perf_counter()
    kept = {}
    if args.only and os.path.exists(args.json):
        with open(args.json) as fh:
            kept = json.load(fh)
    if args.only == "peer":
        server_part = {k: kept[k] for k in SERVER_KEYS if k in kept}
        server_part["rates"] = {r["concurrency"]: r["tok_per_s"] for r in kept.get("rows", []) if r["tok_per_s"]}
        server_part["rates_by_temperature"] = {r["concurrency"]: r.get("tok_per_s_by_temperature", {})
                                               for r in kept.get("rows", [])}
    else:
        server_part = server_half(args, device, dtype, kept.get("agent_trace"))
    if args.only == "server":
        peer, peer_info = {r["concurrency"]: r["peer_tok_per_s"] for r in kept.get("rows", [])}, kept.get("peer")
    else:
        peer, peer_info = peer_rates(args, device, dtype)
    total = time.perf_counter() - t0
    rates, by_temperature = server_part.get("rates", {}), server_part.get("rates_by_temperature", {})
    rows = []
    for c in args.concurrency:
        ours, theirs = rates.get(c), peer.get(c)
        rows.append({"concurrency": c, "tok_per_s": ours, "peer_tok_per_s": theirs,
                     "speedup": ours / theirs if ours and theirs else None,
                     "tok_per_s_by_temperature": {str(t): r for t, r in by_temperature.get(c, {}).items()}})
    result = {
        "rows": rows, **{k: v for k, v in server_part.items() if k not in ("rates", "rates_by_temperature")},
        "peer": peer_info,
        "bench_wall_s": total,
        "info": {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda"
                 else platform.processor() or platform.machine(), "torch": torch.__version__,
                 "python": platform.python_version(), "preset": args.preset, "new_tokens": args.new_tokens,
                 "smoke": args.smoke, "only": args.only, "compile_prefill": args.compile_prefill,
                 "temperature": args.temperature[0], "short_prefill": args.short_prefill},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    report(args, result, total)


# the server half's entries of the JSON (kept from the file when only the peer runs)
SERVER_KEYS = ("ttft_12k_s", "ttft_long_prompt_tokens", "ttft_runs_s", "server_startup_s", "cuda_graph_capture_s",
               "cuda_graphs", "gpu_memory_mib", "agent_trace", "engine_steps")


def server_half(args: argparse.Namespace, device: str, dtype: torch.dtype, kept_trace: dict | None) -> dict:
    """Steps 1-5: the server's decode rates and TTFT, its memory, then the in-process checks and agent trace."""
    vocab = get_preset(args.preset).vocab_size
    before = gpu_memory_used_mib() if device == "cuda" else None
    server = Server(args, device)
    try:
        startup = server.wait_healthy(timeout=600)
        capture, graphs_line = server.graphs()
        rates, steps = {}, {}
        for c in args.concurrency:  # a short warm-up at each batch size compiles its prefill shapes
            asyncio.run(decode_rate(server.url, args.preset, c, 4, vocab, 1000 + c, args.temperature[0]))
            rates[c], steps[c] = {}, {}
            for t in args.temperature:
                start_counts = engine_counters(server.url)
                rates[c][t] = asyncio.run(decode_rate(server.url, args.preset, c, args.new_tokens, vocab, c, t))
                counts = engine_counters(server.url)
                # the engine's side of the run: its steps, their mean wall time, its prefill forwards, the slowest
                step = {key: counts[key] - start_counts[key] for key in ("steps", "step_s", "prefill_forwards")}
                step["slowest_step_s_so_far"] = counts["slowest_step_s"]
                steps[c][t] = step
                mean_ms = 1e3 * step["step_s"] / max(1, step["steps"])
                print(f"decode, {c} clients, temperature {t}: {rates[c][t]:.1f} tok/s ({step['steps']:.0f} engine "
                      f"steps, {mean_ms:.2f} ms mean, {step['prefill_forwards']:.0f} prefill forwards; slowest step "
                      f"so far {1e3 * counts['slowest_step_s']:.0f} ms)", flush=True)  # kept if a later step fails
        rng = random.Random(7)
        ttfts = [asyncio.run(ttft(server.url, args.preset, [rng.randrange(vocab) for _ in range(args.ttft_tokens)]))
                 for _ in range(3)]
        print(f"TTFT of a {args.ttft_tokens}-token prompt: {[round(t, 4) for t in ttfts]} s", flush=True)
        after = gpu_memory_used_mib() if device == "cuda" else None
    finally:
        server.stop()
    trace = kept_trace if args.skip_trace and kept_trace else agent_trace(args, device, dtype)
    print(f"agent trace: {json.dumps(trace)}", flush=True)
    return {"rates": {c: by_t[args.temperature[0]] for c, by_t in rates.items()}, "rates_by_temperature": rates,
            "engine_steps": steps, "ttft_12k_s": statistics.median(ttfts),
            "ttft_long_prompt_tokens": args.ttft_tokens, "ttft_runs_s": ttfts, "server_startup_s": startup,
            "cuda_graph_capture_s": capture,
            "cuda_graphs": graphs_line, "agent_trace": trace,
            "gpu_memory_mib": after - before if after is not None and before is not None else None}


def report(args: argparse.Namespace, result: dict, total: float) -> None:
    """The table and summary lines (a half not run and not on file shows as '-')."""
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    peer_info = result["peer"] or {}
    print(f"\nopenk3 serve ({args.preset}, {result['info']['device']}) vs HF KimiLinearForCausalLM.generate() "
          f"(fla {peer_info.get('fla', '-')}), {args.new_tokens} new tokens per client, temperature "
          f"{args.temperature[0]} (the peer greedy)")
    print(f"{'clients':>7} {'openk3 tok/s':>13} {'HF tok/s':>10} {'speedup':>8}  openk3 by temperature")
    for row in result["rows"]:
        others = ", ".join(f"{t}: {r:.1f}" for t, r in row.get("tok_per_s_by_temperature", {}).items())
        print(f"{row['concurrency']:>7} {fmt(row['tok_per_s'], '13.1f'):>13} {fmt(row['peer_tok_per_s'], '10.1f'):>10} "
              f"{fmt(row['speedup'], '7.1f') + 'x' if row['speedup'] else '-':>8}  {others}")
    if "agent_trace" not in result:
        print(f"bench {total:.0f} s; json: {args.json}")
        return
    capture, memory, trace = result["cuda_graph_capture_s"], result["gpu_memory_mib"], result["agent_trace"]
    graphs = f"{capture:.2f} s" if capture is not None else f"none ({result['cuda_graphs']})"
    mem = f"{memory / 1024:.2f} GiB" if memory is not None else "n/a"
    print(f"TTFT of a {args.ttft_tokens}-token prompt: {result['ttft_12k_s'] * 1000:.1f} ms (median of 3); "
          f"server start-up {result['server_startup_s']:.1f} s; CUDA-graph capture {graphs}; GPU memory {mem}")
    print(f"decode step vs the model's forward (teacher-forced, {args.preset}), max |diff| / max |logit|, argmax:")
    for mode, c in trace["decode_vs_forward"].items():
        print(f"  {mode}: {c['max_rel_diff']:.2e}, {c['argmax_agree']:.1%}")
    k3, base = trace["k3"], trace["baseline"]
    print(f"agent trace: K3 reuses {k3['reuse_of_ideal']:.1%} of ideal ({k3['reused_tokens']} tokens, TTFT mean "
          f"{k3['ttft_mean_s'] * 1000:.1f} ms); block-aligned baseline {base['reuse_of_ideal']:.1%} "
          f"(TTFT mean {base['ttft_mean_s'] * 1000:.1f} ms); bench {total:.0f} s; json: {args.json}")


if __name__ == "__main__":
    main()
