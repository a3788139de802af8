"""`openk3 serve` on one GPU under the workloads users run, against HF transformers' generate(), in one run.

    python bench/serve_gpu.py [--only server|peer] [--smoke] [--json bench/serve_gpu.json]

The server part starts `openk3 serve --preset k3-debug --device cuda` as a real process with its default flags
(bf16, CUDA graphs, the latent cache sized from memory) and drives it over HTTP with bench/serve_load.py:
1. decode: C = 1, 8, 32, 64 closed-loop clients, each request a text prompt of 60-200 tokens and a 256-token
   reply (temperature 0.8, top_p 0.95): output tokens a second, end to end;
2. 64 clients with 16k-token contexts: all prefilled together (one token each), then the same prompts again (the
   prefix cache hits them, as an agent's next turn) with 256-token replies decoding together: the aggregate decode
   rate, and whether the engine held them all at once (no preemption);
3. the mixed stream: Poisson arrivals at 12 requests a second, 96 requests, prompts uniform 1k-11k tokens,
   replies uniform 32-256 (temperature 0.8, top_p 0.95): TTFT and inter-token latency percentiles;
then a second server with `--max-model-len 1048576` (K3's context) for
4. long contexts: one client, a prompt of 64k / 256k / 1M tokens and a 256-token reply (128 at 1M): TTFT and the
   decode rate (1 / TPOT), beside the same server's rate at a short context.
The peer part runs transformers' KimiLinearForCausalLM with k3-debug's dimensions (Kimi Linear's gates, plain
residuals, full-width MoE; fla's kernels when importable), bf16, generate() of 128 new tokens from 16-token
prompts at batch = each client count, and at a 16k-token context at batch 1 and 16 (no HTTP: the loop alone).

Prints a table and writes JSON: rows {concurrency, tok_per_s, peer_tok_per_s}, long_context [{context, clients,
decode_tok_per_s, ttft_s}], many_long {...}, mixed {ttft_p50_s, itl_p99_s, ...}, peer_long_context, the servers'
ready lines and start-up times. `--only` runs some parts (server: 1-3, long: 4, peer) and keeps the others'
figures from the --json file (each server compiles for minutes at start and fla autotunes for minutes: on a
device with a 10-minute limit per command they go in separate calls). Without CUDA it stops with a one-line
error; `--smoke` runs on the CPU at toy sizes (k3-tiny) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from common import default_json  # noqa: E402  (bench/common.py)
from openk3.config import get_preset  # noqa: E402
from serve_load import run_load  # noqa: E402  (bench/serve_load.py)

TEXT = dict(prompt_len="60:200", temperature=0.8, top_p=0.95, tokenizer="bytes")
ENGINE_ITL = "openk3_inter_token_latency_seconds"  # the server's histogram of the engine's inter-token times
CACHE_EVICTIONS = ("evicted_pages", "dropped_checkpoints")  # the prefix cache's /metrics counters many_long reads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`openk3 serve` as a child process with the given extra flags; its log goes to a file."""

    def __init__(self, preset: str, device: str, flags: list[str], log_path: str | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+") if log_path else \
            tempfile.NamedTemporaryFile("w+", prefix="openk3-serve-", suffix=".log", delete=False)
        self.keep_log = log_path is not None
        cmd = [sys.executable, "-m", "openk3", "serve", "--preset", preset, "--device", device,
               "--port", str(self.port), "--log-level", "info", *flags]
        print("$ " + " ".join(cmd[1:]), flush=True)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not self.keep_log:
            os.unlink(self.log.name)

    def wait_ready(self, timeout: float) -> tuple[float, str]:
        """(start-up seconds, the server's ready line) once /health answers."""
        while time.perf_counter() - self.started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    ready = next((x for x in self.text().splitlines() if "ready at" in x), "")
                    print(ready, flush=True)
                    return time.perf_counter() - self.started, ready
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n{self.text()[-3000:]}")

    def text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def buckets(self, name: str) -> dict[float, float]:
        """One histogram of the server's /metrics: {upper bound: cumulative count}."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            match = re.match(rf'{name}_bucket{{le="([^"]+)"}} (\S+)', line)
            if match:
                out[float(match[1])] = float(match[2])
        return out

    def counter(self, name: str) -> float:
        """One counter of the server's /metrics (0 if absent)."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


def check(report: dict, what: str) -> dict:
    if report["failed"]:
        raise RuntimeError(f"{what}: {report['failed']} requests failed: {report['failure_examples']}")
    return report


def decode_rate(report: dict) -> float:
    """Output tokens a second of one decoding stream: 1 / its mean TPOT."""
    return 1.0 / report["tpot_s"]["mean"]


def summary(report: dict) -> dict:
    """A load report without its per-request records."""
    return {k: v for k, v in report.items() if k != "requests"}


def default_server(args: argparse.Namespace, device: str) -> dict:
    """Steps 1-3 on a server with the default flags."""
    out: dict = {}
    with Server(args.preset, device, args.server_flags, args.server_log) as server:
        startup, ready = server.wait_ready(900)
        out["server_default"] = {"flags": args.server_flags, "startup_s": startup, "ready": ready}
        url = server.url
        check(run_load(url, max_concurrency=8, num_requests=8, output_len=8, **TEXT), "warm-up")
        rates, reports = {}, {}
        for c in args.concurrency:
            report = check(run_load(url, max_concurrency=c, num_requests=max(4, 2 * c), output_len=args.reply,
                                    seed=c, **TEXT), f"decode at {c} clients")
            rates[c], reports[c] = report["output_tok_per_s"], summary(report)
            print(f"decode, {c} clients: {rates[c]:.1f} tok/s (TTFT p50 {report['ttft_s']['p50'] * 1e3:.0f} ms, "
                  f"TPOT p50 {report['tpot_s']['p50'] * 1e3:.2f} ms)", flush=True)
        out["rates"], out["decode_reports"] = rates, reports
        out["many_long"] = many_long(args, server)
        itl_before = server.buckets(ENGINE_ITL)
        report = check(run_load(url, request_rate=args.mixed_rate, num_requests=args.mixed_requests,
                                prompt_len=args.mixed_prompt, output_len=args.mixed_reply, seed=7, **{
                                    k: v for k, v in TEXT.items() if k != "prompt_len"}), "mixed stream")
        out["mixed"] = {"ttft_p50_s": report["ttft_s"]["p50"], "ttft_p99_s": report["ttft_s"]["p99"],
                        "itl_p50_s": report["itl_s"]["p50"], "itl_p99_s": report["itl_s"]["p99"],
                        "tpot_p50_s": report["tpot_s"]["p50"], "output_tok_per_s": report["output_tok_per_s"],
                        "report": summary(report)}
        # where the long gaps arise: the engine's own inter-token times (its histogram, over this part) against the
        # client's; a gap seen only by the client was spent in the API process or on the way
        engine = {le: n - itl_before.get(le, 0.0) for le, n in server.buckets(ENGINE_ITL).items()}
        out["mixed"]["itl_over_50ms"] = {
            "client": report["itl_over_s"]["0.05"],
            "engine": 1 - engine.get(0.05, 0.0) / max(engine.get(float("inf"), 0.0), 1.0)}
        print(f"mixed stream: TTFT p50 {out['mixed']['ttft_p50_s']:.3f} s, p99 {out['mixed']['ttft_p99_s']:.3f} s; "
              f"ITL p50 {out['mixed']['itl_p50_s'] * 1e3:.1f} ms, p99 {out['mixed']['itl_p99_s'] * 1e3:.1f} ms; "
              f"gaps over 50 ms: {out['mixed']['itl_over_50ms']['client']:.2%} seen by the clients, "
              f"{out['mixed']['itl_over_50ms']['engine']:.2%} in the engine", flush=True)
    return out


def many_long(args: argparse.Namespace, server: Server) -> dict:
    """Step 2: the clients' contexts prefilled together (first pass, one token each), then the same prompts again
    (prefix-cache hits, as an agent's next turn) decoding together: the aggregate decode rate of the second pass."""
    clients, context = args.many
    common = dict(max_concurrency=clients, num_requests=clients, prompt_len=context, temperature=0.8,
                  tokenizer="bytes", seed=5)
    preempted = server.counter("openk3_engine_preemptions_total")
    evictions = {name: server.counter(f"openk3_prefix_cache_{name}_total") for name in CACHE_EVICTIONS}
    first = check(run_load(server.url, output_len=1, **common), "many long contexts, first pass")
    report = check(run_load(server.url, output_len=args.reply, **common), "many long contexts")
    tpots = [r["tpot"] for r in report["requests"] if r.get("tpot")]
    out = {"clients": clients, "context": context, "aggregate_decode_tok_per_s": report["output_tok_per_s"],
           # the clients' decode rates while they decode together (sum of 1 / TPOT): the rate above also counts the
           # second pass's prefill after its cache hits, before any client decodes
           "decode_rate_sum_tok_per_s": sum(1 / t for t in tpots),
           "cached_tokens": report["cached_tokens"], "first_pass_s": first["duration_s"],
           "first_pass_ttft_p50_s": first["ttft_s"]["p50"], "ttft_p50_s": report["ttft_s"]["p50"],
           "tpot_p50_s": report["tpot_s"]["p50"],
           "preemptions": server.counter("openk3_engine_preemptions_total") - preempted,
           # what the prefix cache gave up over both passes (a second pass that misses re-prefills whole contexts)
           "prefix_cache": {name: server.counter(f"openk3_prefix_cache_{name}_total") - before
                            for name, before in evictions.items()},
           "report": summary(report)}
    print(f"{clients} clients x {context} tokens: prefilled in {first['duration_s']:.1f} s, then "
          f"{out['aggregate_decode_tok_per_s']:.0f} tok/s aggregate decode, {out['decode_rate_sum_tok_per_s']:.0f} "
          f"while decoding together (TPOT p50 {out['tpot_p50_s'] * 1e3:.1f} "
          f"ms, {report['cached_tokens']} cached prompt tokens), {out['preemptions']:.0f} preemptions; prefix cache "
          f"{out['prefix_cache']}", flush=True)
    return out


def many_server(args: argparse.Namespace, device: str) -> dict:
    """Step 2 alone on a server with the default flags."""
    with Server(args.preset, device, args.server_flags, args.server_log) as server:
        server.wait_ready(900)
        return {"many_long": many_long(args, server)}


def long_server(args: argparse.Namespace, device: str) -> dict:
    """Step 4 on a server with `--max-model-len` 1M."""
    out: dict = {}
    long_flags = [*args.server_flags, "--max-model-len", str(args.long_model_len)]
    with Server(args.preset, device, long_flags, args.server_log and args.server_log + ".long") as server:
        startup, ready = server.wait_ready(900)
        out["server_long"] = {"flags": long_flags, "startup_s": startup, "ready": ready}
        rows = []
        for context in (args.short_context, *args.contexts):
            reply = args.reply if context < args.long_model_len // 2 else args.reply // 2
            context = min(context, args.long_model_len - reply)  # the reply fits the sequence
            report = check(run_load(server.url, max_concurrency=1, num_requests=1, prompt_len=context,
                                    output_len=reply, temperature=0.8, tokenizer="bytes", seed=context,
                                    timeout=1800), f"context {context}")
            rows.append({"context": context, "clients": 1, "decode_tok_per_s": decode_rate(report),
                         "ttft_s": report["ttft_s"]["p50"], "reply_tokens": report["output_tokens"]})
            print(f"context {context}: TTFT {rows[-1]['ttft_s']:.3f} s, decode {rows[-1]['decode_tok_per_s']:.1f} "
                  f"tok/s", flush=True)
        out["long_context"] = rows
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


def peer_half(args: argparse.Namespace, device: str) -> dict:
    """HF generate() tokens per second: short prompts at each client count, and a long context at a few batches
    (greedy, exactly `peer_tokens` new tokens; the prefill is not timed in the long rows)."""
    import transformers

    try:
        import fla  # noqa: F401

        fla_version = getattr(fla, "__version__", "installed")
    except ImportError:
        fla_version = None
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    cfg = peer_config(args.preset)
    model = transformers.KimiLinearForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(1)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(ids: torch.Tensor, new: int) -> tuple[float, int]:
        """(seconds, new tokens) of one generate() call."""
        with torch.no_grad():
            sync(device)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            sync(device)
        return time.perf_counter() - start, out.shape[1] - ids.shape[1]

    rates = {}
    for batch in args.concurrency:
        ids = torch.randint(0, cfg.vocab_size, (batch, 16), generator=gen).to(device)
        timed(ids, 4)  # warm-up
        seconds, new = timed(ids, args.peer_tokens)
        rates[batch] = batch * new / seconds
        print(f"peer, batch {batch}: {rates[batch]:.1f} tok/s", flush=True)
    long_rows = []
    for batch in args.peer_long_batches:
        ids = torch.randint(0, cfg.vocab_size, (batch, args.many[1]), generator=gen).to(device)
        prefill, _ = timed(ids, 1)  # the prefill and one token
        seconds, new = timed(ids, args.peer_tokens)
        rate = batch * (new - 1) / (seconds - prefill)
        long_rows.append({"context": args.many[1], "batch": batch, "decode_tok_per_s": rate, "ttft_s": prefill})
        print(f"peer, batch {batch} at {args.many[1]} tokens: {rate:.1f} tok/s decode", flush=True)
    info = {"transformers": transformers.__version__, "fla": fla_version,
            "parameters": sum(p.numel() for p in model.parameters())}
    return {"peer_rates": rates, "peer_long_context": long_rows, "peer": info}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


PARTS = {"server": default_server, "many": many_server, "long": long_server, "peer": peer_half}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help="model preset (default k3-debug; k3-tiny with --smoke)")
    ap.add_argument("--only", choices=sorted(PARTS), nargs="+", default=None,
                    help="run these parts (server: steps 1-3, many: step 2 alone, long: step 4, peer) and keep the "
                         "others' figures from the --json file")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="step 4's contexts (default 64k 256k 1M)")
    ap.add_argument("--smoke", action="store_true", help="run on the CPU at toy sizes")
    ap.add_argument("--server-log", default=None, help="keep the servers' logs here (and PATH.long)")
    ap.add_argument("--server-flags", default="", metavar="FLAGS",
                    help="more `openk3 serve` flags for every server, one string (e.g. '--short-prefill 256'): "
                         "an A/B against the defaults")
    ap.add_argument("--json", default=None,
                    help="the results (default $OUT/serve_gpu.json, else bench/serve_gpu.json; under --smoke the "
                         "temp directory's)")
    args = ap.parse_args()
    args.json = args.json or default_json("serve_gpu.json", args.smoke)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` stops the servers too (Server.__exit__)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/serve_gpu.py: error: needs a CUDA GPU (torch sees none); --smoke runs it on the CPU")
    device = "cpu" if args.smoke else "cuda"
    sizes = dict(preset="k3-tiny", concurrency=[1, 4], reply=8, many=(4, 300), mixed_rate=8.0, mixed_requests=8,
                 mixed_prompt="100:600", mixed_reply="4:12", contexts=[1000, 2000], short_context=100,
                 long_model_len=4096, server_flags=["--threads", "1"], peer_tokens=8, peer_long_batches=[1]) \
        if args.smoke else \
        dict(preset="k3-debug", concurrency=[1, 8, 32, 64], reply=256, many=(64, 16384), mixed_rate=12.0,
             mixed_requests=96, mixed_prompt="1000:11000", mixed_reply="32:256", contexts=[65536, 262144, 1 << 20],
             short_context=128, long_model_len=1 << 20, server_flags=[], peer_tokens=128,
             peer_long_batches=[1, 16])
    extra = shlex.split(args.server_flags)
    del args.server_flags
    for key, value in sizes.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.server_flags = [*args.server_flags, *extra]
    kept = {}
    if args.only and os.path.exists(args.json):
        with open(args.json) as fh:
            kept = json.load(fh)
    t0 = time.perf_counter()
    result = {k: v for k, v in kept.items() if k not in ("rows", "info")}
    for name in args.only or sorted(PARTS):
        result.update(PARTS[name](args, device))
        write(result, args, device, time.perf_counter() - t0)  # after each part: a run cut later keeps it
    report(result, args.json)


def write(result: dict, args: argparse.Namespace, device: str, wall_s: float) -> None:
    """The rows from the rates measured so far, the run's info, and the JSON file."""
    rates = {int(c): r for c, r in result.get("rates", {}).items()}
    peer = {int(c): r for c, r in result.get("peer_rates", {}).items()}
    result["rows"] = [{"concurrency": c, "tok_per_s": rates.get(c), "peer_tok_per_s": peer.get(c),
                       "speedup": rates[c] / peer[c] if rates.get(c) and peer.get(c) else None}
                      for c in args.concurrency]
    result["info"] = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name()
                      if device == "cuda" else platform.processor() or platform.machine(),
                      "torch": torch.__version__, "python": platform.python_version(), "preset": args.preset,
                      "smoke": args.smoke, "only": args.only, "bench_wall_s": wall_s}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)


def report(result: dict, path: str) -> None:
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    fla = result.get("peer", {}).get("fla")
    flags = " ".join(result.get("server_default", {}).get("flags", [])) or "default flags"
    print(f"\nopenk3 serve ({result['info']['preset']}, {result['info']['device']}), {flags}, text prompts "
          f"60-200 tokens, 256-token replies, temperature 0.8; peer: HF generate() (fla {fla})")
    print(f"{'clients':>7} {'openk3 tok/s':>13} {'HF tok/s':>10} {'speedup':>8}")
    for row in result["rows"]:
        print(f"{row['concurrency']:>7} {fmt(row['tok_per_s'], '13.1f')} {fmt(row['peer_tok_per_s'], '10.1f')} "
              f"{fmt(row['speedup'], '7.1f')}x")
    for row in result.get("long_context", []):
        print(f"context {row['context']:>8}, 1 client: TTFT {row['ttft_s']:.3f} s, decode "
              f"{row['decode_tok_per_s']:.1f} tok/s")
    for row in result.get("peer_long_context", []):
        print(f"peer at {row['context']} tokens, batch {row['batch']}: decode {row['decode_tok_per_s']:.1f} tok/s")
    if "many_long" in result:
        m = result["many_long"]
        print(f"{m['clients']} clients x {m['context']} tokens: {m['aggregate_decode_tok_per_s']:.0f} tok/s aggregate "
              f"decode, {m['preemptions']:.0f} preemptions")
    if "mixed" in result:
        m = result["mixed"]
        print(f"mixed stream: TTFT p50 {m['ttft_p50_s']:.3f} s, ITL p99 {m['itl_p99_s'] * 1e3:.1f} ms")
    print(f"json: {path}")


if __name__ == "__main__":
    main()
