"""A real-size model served on one GPU: kimi-linear-48b in bf16 and with its routed experts kept MXFP4 (issue 42).

    python bench/serve_48b.py [--formats bf16 mxfp4] [--json bench/serve_48b.json] [--smoke]

For each format, `openk3 serve --preset kimi-linear-48b --device cuda` (random weights built on the GPU; `mxfp4`
adds `--quantization mxfp4`) starts as a real process; its start-up time (to /health) and the server's own model
line (phases, weight bytes) are kept, and /metrics gives the GPU memory by part (weights, latent pages, KDA
states, CUDA graphs). Then bench/serve_load.py drives it over HTTP:
1. decode: 1 / 16 / 64 / 256 closed-loop clients, short text prompts (60-200 tokens), 256-token replies;
2. the vLLM-style workload (vLLM PR 43833's, on one GB200: 35,776 tok/s total): 8k-token prompts, 1k-token replies,
   256 requests all at once (128 in bf16, where the caches for 256 may not fit: `--vllm-clients`): total and output
   throughput, TTFT and TPOT p50 / p99.
Prints a table and writes JSON: rows {format, concurrency, prompt_tokens, reply_tokens, total_tok_per_s,
output_tok_per_s, ttft_p50_s, tpot_p50_s, ...}, and per format startup_s, weights_gib and the memory split.
`--smoke` runs the same on the CPU with k3-tiny at toy sizes, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import httpx
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from serve_gpu import Server, default_json  # noqa: E402  (bench/serve_gpu.py: `openk3 serve` as a child process)
from serve_load import run_load  # noqa: E402

GiB = 1 << 30
FLAGS = {"bf16": [], "mxfp4": ["--quantization", "mxfp4"]}


def memory_split(url: str) -> dict[str, float]:
    """GiB of device memory by part, from the server's openk3_memory_bytes gauges."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("openk3_memory_bytes{"):
            part = line.split('part="')[1].split('"')[0]
            out[part] = float(line.split()[-1]) / GiB
    return out


def row(fmt: str, clients: int, prompt, reply: int, report: dict) -> dict:
    if report["failed"]:
        raise RuntimeError(f"{fmt}, {clients} clients: {report['failed']} requests failed: "
                           f"{report['failure_examples']}")
    return {"format": fmt, "concurrency": clients, "prompt_tokens": prompt, "reply_tokens": reply,
            "total_tok_per_s": report["total_tok_per_s"], "output_tok_per_s": report["output_tok_per_s"],
            "ttft_p50_s": report["ttft_s"]["p50"], "ttft_p99_s": report["ttft_s"]["p99"],
            "tpot_p50_s": report["tpot_s"]["p50"], "tpot_p99_s": report["tpot_s"]["p99"],
            "completed": report["completed"], "duration_s": report["duration_s"]}


def run_format(args: argparse.Namespace, fmt: str, device: str, save) -> None:
    """One format's server and loads; `save()` is called after each row, so a run cut short keeps what it measured."""
    flags = [*FLAGS[fmt], "--max-num-seqs", str(max(args.clients)), *args.server_flags]
    log = args.server_log and f"{args.server_log}.{fmt}"
    with Server(args.preset, device, flags, log) as server:
        startup, ready = server.wait_ready(1800)
        model_line = next((x for x in server.text().splitlines() if "openk3 serve: model on" in x), "")
        out = {"format": fmt, "startup_s": startup, "ready": ready, "model_line": model_line,
               "memory_gib": memory_split(server.url), "rows": []}
        out["weights_gib"] = out["memory_gib"].get("weights")
        print(f"{fmt}: ready in {startup:.0f} s; {model_line.strip()}; GiB by part {out['memory_gib']}", flush=True)
        save(out)
        text = dict(prompt_len=args.short_prompt, temperature=0.8, top_p=0.95, tokenizer="bytes")
        run_load(server.url, max_concurrency=4, num_requests=4, output_len=8, seed=99, **text)  # warm-up
        for c in args.clients:
            report = run_load(server.url, max_concurrency=c, num_requests=max(2, c), output_len=args.reply, seed=c,
                              **text)
            out["rows"].append(row(fmt, c, args.short_prompt, args.reply, report))
            print(f"{fmt}, {c} clients: {report['output_tok_per_s']:.1f} tok/s decode", flush=True)
            save(out)
        clients = args.vllm_clients[fmt]
        report = run_load(server.url, num_requests=clients, prompt_len=args.vllm[0], output_len=args.vllm[1],
                          temperature=0.8, tokenizer="bytes", seed=7)
        out["rows"].append(row(fmt, clients, args.vllm[0], args.vllm[1], report))
        save(out)
        last = out["rows"][-1]
        print(f"{fmt}, {args.vllm[0]} / {args.vllm[1]} x {clients}: {last['total_tok_per_s']:.0f} tok/s total, "
              f"TTFT p50 {last['ttft_p50_s']:.2f} s, TPOT p50 {last['tpot_p50_s'] * 1e3:.1f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", choices=sorted(FLAGS), default=["bf16", "mxfp4"])
    ap.add_argument("--vllm-clients", type=int, nargs=2, default=None, metavar=("BF16", "MXFP4"),
                    help="concurrent requests of the 8k / 1k workload per format (default 128 256)")
    ap.add_argument("--smoke", action="store_true", help="on the CPU with k3-tiny at toy sizes")
    ap.add_argument("--server-log", default=None, help="keep each server's log at PATH.FORMAT")
    ap.add_argument("--json", default=None,
                    help="the results (default $OUT/serve_48b.json, else bench/serve_48b.json; under --smoke the "
                         "temp directory's)")
    args = ap.parse_args()
    args.json = args.json or default_json("serve_48b.json", args.smoke)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` stops the servers too
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/serve_48b.py: error: needs a CUDA GPU (torch sees none); --smoke runs it on the CPU")
    device = "cpu" if args.smoke else "cuda"
    sizes = dict(preset="k3-tiny", clients=[1, 4], short_prompt="20:60", reply=8, vllm=(300, 16),
                 server_flags=["--threads", "1"], vllm_default=(4, 4)) if args.smoke else \
        dict(preset="kimi-linear-48b", clients=[1, 16, 64, 256], short_prompt="60:200", reply=256, vllm=(8192, 1024),
             server_flags=[], vllm_default=(128, 256))
    for key, value in sizes.items():
        setattr(args, key, value)
    args.vllm_clients = dict(zip(("bf16", "mxfp4"), args.vllm_clients or args.vllm_default))
    t0 = time.perf_counter()
    done: dict[str, dict] = {}
    result = {"info": {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda"
                       else platform.machine(), "torch": torch.__version__, "preset": args.preset,
                       "smoke": args.smoke}}

    def save(out: dict) -> None:
        done[out["format"]] = out
        result["rows"] = [r for f in done.values() for r in f["rows"]]
        result["formats"] = {name: {k: v for k, v in f.items() if k != "rows"} for name, f in done.items()}
        result["info"]["bench_wall_s"] = time.perf_counter() - t0
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)

    for fmt in args.formats:
        run_format(args, fmt, device, save)
    print(f"\n{args.preset} on {result['info']['device']}")
    for fmt, f in result["formats"].items():
        mem = ", ".join(f"{k} {v:.2f}" for k, v in f["memory_gib"].items())
        print(f"{fmt}: start-up {f['startup_s']:.0f} s; GiB: {mem}")
    print(f"{'format':>6} {'clients':>7} {'prompt':>8} {'reply':>6} {'total tok/s':>12} {'output tok/s':>13} "
          f"{'TTFT p50':>9} {'TPOT p50':>9}")
    for r in result["rows"]:
        print(f"{r['format']:>6} {r['concurrency']:>7} {str(r['prompt_tokens']):>8} {r['reply_tokens']:>6} "
              f"{r['total_tok_per_s']:>12.1f} {r['output_tok_per_s']:>13.1f} {r['ttft_p50_s']:>8.3f}s "
              f"{r['tpot_p50_s'] * 1e3:>7.2f}ms")
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
