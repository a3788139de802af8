"""Scale-out on GPUs: KDA context parallel and expert parallel against one GPU (NCCL, one process per GPU).

    torchrun --nproc-per-node 2 bench/parallel.py [--out bench/parallel.json] [--tokens 131072 262144]
    torchrun --nproc-per-node 2 bench/parallel.py --smoke    # CPU (gloo) at tiny sizes: checks the script runs

KCP: one k3-debug KDA layer (hidden 1024, 8 heads x 128, conv 4; fp32 weights under bf16 autocast, as
`openk3 train` runs on a GPU), forward + backward over one document of T tokens: on GPU 0 alone (the plain layer:
Triton KDA kernels), then split over all GPUs (KCP, T / world tokens each). tokens/s = T / step time (KCP: the
slowest rank's); peak = torch.cuda.max_memory_allocated per GPU (weights, input and activations of the step).
EP: one k3-debug LatentMoE layer (32 experts top-4, latent 512, expert hidden 512), forward + backward of S tokens
per GPU: EP=1 (every GPU holds all experts and routes its own tokens: data parallel, no communication) against
EP=world (32 / world experts per GPU, all_to_all dispatch and combine) with the balanced (MoonEP) and the static
planner, under the random router's natural routing and with one hot expert that every token picks (half of all
token-expert rows). tokens/s per GPU = S / step time (the slowest rank's); rows = the most token-expert rows one
GPU computed.
Timing: CUDA events, median of --iters steps after --warmup (the first compiles the Triton kernels). Prints a
Markdown table and writes the JSON to --out. About 2 minutes on 2 H200s (budget: < 8 minutes).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from openk3.config import get_preset
from openk3.model.kda import KimiDeltaAttention
from openk3.model.moe import MoE
from openk3.parallel.ep import ExpertParallel, shard_experts
from openk3.parallel.kcp import kda_layer_forward
from openk3.parallel.layout import SequenceSplit


def timed(step, iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds of step() over iters runs after warmup runs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def slowest(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def train_step(module, forward, x, amp: bool, device: torch.device):
    def step():
        module.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = forward(x)
        out.float().square().mean().backward()
    return step


def bench_kcp(cfg, tokens: int, args, rank: int, world: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, 0).to(device)
    amp = device.type == "cuda"
    single_s, single_peak = 0.0, 0
    if rank == 0:  # one GPU: the plain layer over the whole document
        x = torch.randn(1, tokens, cfg.hidden_size, device=device, requires_grad=True)
        reset_peak(device)
        single_s = timed(train_step(layer, layer, x, amp, device), args.iters, args.warmup, device)
        single_peak = peak_bytes(device)
        del x
    dist.barrier()
    split = SequenceSplit.even((0, tokens), world)
    lo, hi = split.bounds[rank], split.bounds[rank + 1]
    x = torch.randn(1, hi - lo, cfg.hidden_size, device=device, requires_grad=True)
    reset_peak(device)
    forward = lambda inp: kda_layer_forward(layer, inp, split, rank, dist.group.WORLD)
    kcp_s = slowest(timed(train_step(layer, forward, x, amp, device), args.iters, args.warmup, device), device)
    kcp_peak = int(slowest(peak_bytes(device), device))
    single = torch.tensor([single_s, single_peak], dtype=torch.float64, device=device)
    dist.broadcast(single, 0)
    single_s, single_peak = float(single[0]), int(single[1])
    return {"tokens": tokens, "gpus": world, "single_s": single_s, "kcp_s": kcp_s,
            "single_tokens_per_s": tokens / single_s, "kcp_tokens_per_s": tokens / kcp_s,
            "speedup": single_s / kcp_s, "single_peak_gib": single_peak / 2**30, "kcp_peak_gib": kcp_peak / 2**30,
            "memory_ratio": kcp_peak / single_peak if single_peak else None}


def bench_ep(cfg, tokens: int, routing: str, args, rank: int, world: int, device: torch.device) -> list[dict]:
    torch.manual_seed(0)
    moe = MoE(cfg).to(device)
    if routing == "hot expert":
        with torch.no_grad():
            moe.gate.e_score_correction_bias[0] = 10.0
    x = torch.randn(tokens, cfg.hidden_size, device=device, requires_grad=True)
    amp = device.type == "cuda"
    rows = []
    base = slowest(timed(train_step(moe, moe, x, amp, device), args.iters, args.warmup, device), device)
    rows.append({"routing": routing, "ep": 1, "planner": "-", "tokens_per_gpu": tokens, "step_s": base,
                 "tokens_per_s_per_gpu": tokens / base, "max_rows": None})
    for planner in ("balanced", "static"):
        local = copy.deepcopy(moe)
        shard_experts(local.experts, ExpertParallel(dist.group.WORLD, rank, world, planner, average_gradients=True))
        step_s = slowest(timed(train_step(local, local, x, amp, device), args.iters, args.warmup, device), device)
        computed = slowest(local.experts.rows_computed, device)
        rows.append({"routing": routing, "ep": world, "planner": planner, "tokens_per_gpu": tokens, "step_s": step_s,
                     "tokens_per_s_per_gpu": tokens / step_s, "max_rows": int(computed)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "parallel.json"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 262144], help="KCP document lengths")
    parser.add_argument("--ep-tokens", type=int, default=16384, help="EP: tokens per GPU")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, k3-tiny sizes: checks the script runs")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("bench/parallel.py needs CUDA GPUs: run it under torchrun --nproc-per-node 2 on a GPU machine "
              "(--smoke checks it on the CPU)", file=sys.stderr)
        raise SystemExit(2)
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) < 2:
        print("bench/parallel.py compares 1 GPU with several: run it under torchrun --nproc-per-node 2",
              file=sys.stderr)
        raise SystemExit(2)
    dist.init_process_group("gloo" if args.smoke else "nccl", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        cfg = get_preset("k3-tiny")
        args.tokens, args.ep_tokens, args.iters, args.warmup = [512], 256, 2, 1
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        cfg = get_preset("k3-debug")
    started = time.perf_counter()
    kcp = [bench_kcp(cfg, t, args, rank, world, device) for t in args.tokens]
    ep = [row for routing in ("natural", "hot expert")
          for row in bench_ep(cfg, args.ep_tokens, routing, args, rank, world, device)]
    if rank == 0:
        print(f"\nKCP: one {cfg.name} KDA layer ({cfg.kda.num_heads} heads x {cfg.kda_head_dim}), fwd+bwd, one "
              f"document, 1 GPU vs {world}\n")
        print("| tokens | 1 GPU tok/s | KCP tok/s | speedup | 1 GPU peak GiB | KCP peak GiB per GPU | memory ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in kcp:
            ratio = f"{r['memory_ratio']:.2f}" if r["memory_ratio"] else "-"
            print(f"| {r['tokens']} | {r['single_tokens_per_s']:,.0f} | {r['kcp_tokens_per_s']:,.0f} | "
                  f"{r['speedup']:.2f}x | {r['single_peak_gib']:.2f} | {r['kcp_peak_gib']:.2f} | {ratio} |")
        print(f"\nEP: one {cfg.name} MoE layer ({cfg.moe.num_experts} experts, top-{cfg.moe.top_k}), fwd+bwd, "
              f"{args.ep_tokens} tokens per GPU\n")
        print("| routing | EP | planner | tok/s per GPU | most rows on one GPU |\n|---|---|---|---|---|")
        for r in ep:
            print(f"| {r['routing']} | {r['ep']} | {r['planner']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                  f"{r['max_rows'] if r['max_rows'] is not None else '-'} |")
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
        result = {"device": device_name, "gpus": world, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                  "kcp": kcp, "ep": ep, "seconds": time.perf_counter() - started}
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")
    dist.barrier()  # rank 0 wrote the JSON; no rank leaves while a peer may still read from it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
