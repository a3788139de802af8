"""Scale-out on GPUs: KDA context parallel and expert parallel against one GPU (NCCL, one process per GPU).

    torchrun --nproc-per-node 2 bench/parallel.py [--out bench/parallel.json] [--tokens 131072 262144]
                                                  [--experts 32] [--top-k 4]
    torchrun --nproc-per-node 2 bench/parallel.py --smoke    # CPU (gloo) at tiny sizes: checks the script runs
    torchrun --nproc-per-node 2 bench/parallel.py --shared-gpu   # one GPU: the checks alone, every rank on GPU 0
    python bench/parallel.py --exchange [--tokens 65536 131072]   # one GPU: what KCP adds to a rank's step

KCP: one k3-debug KDA layer (hidden 1024, 8 heads x 128, conv 4; fp32 weights under bf16 autocast, as
`openk3 train` runs on a GPU), forward + backward over one document of T tokens: on GPU 0 alone (the plain layer:
Triton KDA kernels), then split over all GPUs (KCP, T / world tokens each). tokens/s = T / step time (KCP: the
slowest rank's); peak = torch.cuda.max_memory_allocated per GPU (weights, input and activations of the step).
EP: one k3-debug LatentMoE layer (32 experts top-4 unless --experts / --top-k say otherwise, latent 512, expert
hidden 512), forward + backward of S tokens per GPU: EP=1 (every GPU holds all experts and routes its own tokens:
data parallel, no communication) against EP=world (experts / world per GPU, all_to_all dispatch and combine) with
the balanced (MoonEP) and the static planner, under the random router's natural routing and with one hot expert
that every token picks (1 / top-k of all token-expert rows, all on that expert's home rank without replicas).
tokens/s per GPU = S / step time (the slowest rank's); rows = the most token-expert rows one GPU computed.
Checks first (issue 14's equalities on NCCL with the Triton backend, bf16 autocast): the KDA and MLA layers under
CP against the plain layer run on each document alone, on a packed stream of --check-tokens tokens in three
layouts (a document across the rank boundary at an odd position, a document boundary exactly on a rank boundary,
rank 0 holding 2 < W-1 tokens); the MoE layer under EP (both planners, one hot expert, distinct router biases so
that bf16 rounding cannot flip a choice) against one process on all ranks' tokens. Relative RMS error of the
output, the input gradient and the worst parameter gradient, each against --check-tol.
Timing: CUDA events, median of --iters steps after --warmup (the first compiles the Triton kernels). Prints
Markdown tables and writes the JSON to --out. About 3 minutes on 2 H200s (budget: < 8 minutes).
--exchange (one GPU, no torchrun; --tokens are tokens per rank here): KCP's own work on a rank of T tokens of one
document, the forward transition (`kda_transition`, no grad) and the backward's initial-state gradient
(`kda_initial_state_grad`), each as one chain, cut into pieces, and in pieces from the layer's own chunk terms
(what KCP runs on Triton, `kda_triton_exchange`), beside the plain layer's fwd+bwd at T and 2T tokens; GPU time
with the host queued ahead (a sleep kernel first), so host overhead is not counted. The 2-GPU step is at least
the layer at T plus both (rank 0's transition precedes rank 1's forward, rank 1's initial-state gradient rank 0's
backward): predicted speedup = layer(2T) / (layer(T) + transition + gradient),
communication aside. Writes bench/kcp_exchange.json (about 1 minute).
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

from common import default_json  # bench/common.py (the script's folder is on sys.path)
from openk3.config import get_preset
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.model.moe import MoE, decisive_routing
from openk3.ops.kda.transition import kda_initial_state_grad, kda_transition, piece_tokens
from openk3.parallel.ep import ExpertParallel, local_experts, shard_experts
from openk3.parallel.kcp import kda_layer_forward
from openk3.parallel.layout import SequenceSplit
from openk3.parallel.mla import mla_layer_forward


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


def queued_ms(fn, iters: int) -> float:
    """Milliseconds of GPU time per fn() call: a sleep kernel first, so the host has queued every call before the
    GPU reaches them (a host-bound call is timed by its kernels, not its launches)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(400_000_000)  # ~0.2 s
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_exchange(cfg, tokens: int, args) -> dict:
    """--exchange (module docstring): one GPU, `tokens` per rank."""
    from openk3.ops.kda.triton.chunk_fwd import chunk_kda_fwd, gate_spec, prepare
    from openk3.ops.kda.triton.exchange import first_sequence_state_grad, last_sequence_map
    from openk3.ops.kda.triton.layout import chunk_layout

    torch.manual_seed(0)
    device = torch.device("cuda")
    layer = KimiDeltaAttention(cfg, 0).to(device)
    row = {"tokens_per_rank": tokens, "heads": layer.num_heads}
    for n, key in ((tokens, "layer_ms"), (2 * tokens, "layer_2x_ms")):
        x = torch.randn(1, n, cfg.hidden_size, device=device, requires_grad=True)
        row[key] = 1e3 * timed(train_step(layer, layer, x, True, device), args.iters, args.warmup, device)
        del x
    H, K = layer.num_heads, layer.head_dim
    raw = [torch.randn(1, tokens, H, K, device=device, dtype=torch.bfloat16) for _ in range(4)]
    with torch.no_grad():
        q, k, g, beta = layer.activate_logits(raw[0], raw[1], raw[2], raw[3][..., 0].float(), "triton")
        v, do = raw[3], torch.randn_like(raw[3])
        gate = dict(backend="triton", gate_min=layer.gate_min())
        for piece, name in ((tokens, "one chain"), (None, "pieces")):
            row[f"transition {name} ms"] = queued_ms(
                lambda p=piece: kda_transition(k, v, g, beta, piece=p, **gate), args.iters)
            row[f"state grad {name} ms"] = queued_ms(
                lambda p=piece: kda_initial_state_grad(q, k, v, g, beta, do, piece=p, **gate), args.iters)
        # what KCP runs on Triton: the same from the layer's own chunk terms (kda_triton_exchange)
        flat = [x[0].contiguous() for x in (q, k, v, g, beta, do)]
        lay, spec, scale = chunk_layout(1, tokens, None, device), gate_spec(layer.gate_min()), K**-0.5
        terms = prepare(*flat[:5], scale, lay, spec)
        saved = chunk_kda_fwd(*flat[:5], scale, None, False, lay, True, spec)[2]
        row["transition in the kernels ms"] = queued_ms(
            lambda: last_sequence_map(terms, flat[2], [0, tokens], q.dtype, None), args.iters)
        row["state grad in the kernels ms"] = queued_ms(
            lambda: first_sequence_state_grad(saved, flat[5], [0, tokens], q.dtype, None), args.iters)
    row["piece_tokens"] = piece_tokens([tokens], H)
    for name in ("one chain", "pieces", "in the kernels"):
        rank_ms = row["layer_ms"] + row[f"transition {name} ms"] + row[f"state grad {name} ms"]
        row[f"predicted speedup {name}"] = row["layer_2x_ms"] / rank_ms
    return row


def run_exchange(cfg, args) -> None:
    rows = [bench_exchange(cfg, t, args) for t in args.tokens]
    print(f"\nKCP's exchange on one GPU ({torch.cuda.get_device_name()}): one {cfg.name} KDA layer "
          f"({cfg.kda.num_heads} heads), one document, T tokens per rank; ms\n")
    ways = ("one chain", "pieces", "in the kernels")
    print("| T per rank | layer at T | layer at 2T | transition | state grad | predicted 2-GPU speedup |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        cells = [" / ".join(f"{r[f'{what} {w} ms']:.2f}" for w in ways) for what in ("transition", "state grad")]
        speedups = " / ".join(f"{r[f'predicted speedup {w}']:.2f}x" for w in ways)
        print(f"| {r['tokens_per_rank']:,} | {r['layer_ms']:.2f} | {r['layer_2x_ms']:.2f} | {cells[0]} | {cells[1]} | "
              f"{speedups} |")
    print(f"\n(each: {' / '.join(ways)}; 'in the kernels': from the layer's own chunk terms, as KCP runs on Triton)")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "rows": rows}
    with open(args.out, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def check_layouts(tokens: int, world: int) -> dict[str, SequenceSplit]:
    """The traps of SPEC §10 at any world size: inner rank bounds off the even split by an odd amount, a document
    ending exactly on the first rank boundary, a first rank of 2 tokens (its successor's conv halo needs 3)."""
    even = SequenceSplit.even((0, tokens), world).bounds
    shifted = (0, *(b + 37 for b in even[1:-1]), tokens)
    rest = [2 + r * (tokens - 2) // (world - 1) for r in range(world)]
    return {"document across the boundary": SequenceSplit((0, tokens), shifted),
            "document boundary on the rank boundary": SequenceSplit((0, even[1] // 3, even[1], tokens), even),
            "rank 0 holds 2 tokens": SequenceSplit((0, 1, tokens // 2, tokens), (0, *rest))}


def weighted_backward(out: torch.Tensor, weight: torch.Tensor) -> None:
    (out.float() * weight).sum().backward()


def check_cp_layer(layer, forward, split: SequenceSplit, rank: int, device: torch.device) -> dict:
    """forward (the CP wrapper) on this rank's slice against the plain layer on each document alone."""
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, split.total, layer.o_proj.out_features, generator=gen, device=device)
    weight = torch.randn(x.shape, generator=gen, device=device)
    ref_x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    lengths = [b - a for a, b in zip(split.cu_seqlens, split.cu_seqlens[1:])]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        ref = torch.cat([layer(piece) for piece in ref_x.split(lengths, dim=1)], dim=1)
    weighted_backward(ref, weight)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    lo, hi = split.bounds[rank], split.bounds[rank + 1]
    local_x = x[:, lo:hi].clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = forward(layer, local_x, split, rank, dist.group.WORLD)
    weighted_backward(out, weight[:, lo:hi])
    param_err = 0.0
    for name, p in layer.named_parameters():
        dist.all_reduce(p.grad)
        param_err = max(param_err, relative_error(p.grad, grads[name]))
    return {"output": relative_error(out.detach(), ref[:, lo:hi].detach()),
            "input_grad": relative_error(local_x.grad, ref_x.grad[:, lo:hi]), "param_grad": param_err}


def check_ep(cfg, tokens: int, planner: str, rank: int, world: int, device: torch.device) -> dict:
    """The MoE layer with experts split over the ranks against one process on all ranks' tokens (hot expert)."""
    torch.manual_seed(0)
    moe = MoE(cfg).to(device)
    gen = torch.Generator(device).manual_seed(3)
    x = torch.randn(world, tokens, cfg.hidden_size, generator=gen, device=device)
    weight = torch.randn(x.shape, generator=gen, device=device)
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with decisive_routing(moe):
        with torch.no_grad():  # one expert above all others by a margin: every token picks it
            moe.gate.e_score_correction_bias[0] = moe.gate.e_score_correction_bias.max() + 10.0
        ref_x = x.clone().requires_grad_()
        with torch.autocast(**amp):
            ref = moe(ref_x.view(1, -1, cfg.hidden_size)).view_as(x)
        weighted_backward(ref, weight)
        grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
        local = copy.deepcopy(moe)
        local.zero_grad(set_to_none=True)
        ep = ExpertParallel(dist.group.WORLD, rank, world, planner)
        shard_experts(local.experts, ep)
        local_x = x[rank:rank + 1].clone().requires_grad_()
        with torch.autocast(**amp):
            out = local(local_x)
        weighted_backward(out, weight[rank:rank + 1])
    param_err = 0.0
    for name, p in local.named_parameters():
        if name.startswith("experts."):  # the home rank already holds every rank's contribution
            param_err = max(param_err, relative_error(p.grad, local_experts(grads[name], ep)))
        else:
            dist.all_reduce(p.grad)
            param_err = max(param_err, relative_error(p.grad, grads[name]))
    return {"output": relative_error(out.detach(), ref[rank:rank + 1].detach()),
            "input_grad": relative_error(local_x.grad, ref_x.grad[rank:rank + 1]), "param_grad": param_err,
            "max_rows": int(slowest(local.experts.rows_computed, device))}


def run_checks(cfg, args, rank: int, world: int, device: torch.device) -> list[dict]:
    """Every check's errors, the worst over the ranks, against the tolerance."""
    torch.manual_seed(0)
    layers = {"KDA": (KimiDeltaAttention(cfg, 0).to(device), kda_layer_forward),
              "MLA": (GatedMLA(cfg, cfg.mla_layers[0]).to(device), mla_layer_forward)}
    cases = [(f"{name} under CP: {where}", lambda l=layer, f=forward, s=split: check_cp_layer(l, f, s, rank, device))
             for name, (layer, forward) in layers.items()
             for where, split in check_layouts(args.check_tokens, world).items()]
    cases += [(f"MoE under EP, {planner} planner, hot expert",
               lambda p=planner: check_ep(cfg, args.check_tokens // world, p, rank, world, device))
              for planner in ("balanced", "static")]
    rows = []
    for what, check in cases:
        errors = {key: slowest(value, device) for key, value in check().items()}
        worst = max(errors[key] for key in ("output", "input_grad", "param_grad"))
        rows.append({"check": what, **errors, "tol": args.check_tol, "ok": worst <= args.check_tol})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path (default bench/parallel.json; bench/parallel_shared_gpu.json with "
                                      "--shared-gpu; under --smoke the temp directory's)")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help="KCP document lengths (default 131072 262144); with --exchange tokens per rank "
                             "(default 65536 131072)")
    parser.add_argument("--ep-tokens", type=int, default=16384, help="EP: tokens per GPU")
    parser.add_argument("--check-tokens", type=int, default=8192, help="tokens of the equality checks")
    parser.add_argument("--check-tol", type=float, default=2e-2,
                        help="relative RMS error allowed in the checks (bf16 autocast against the same in one process)")
    parser.add_argument("--checks-only", action="store_true", help="the equality checks without the timings")
    parser.add_argument("--experts", type=int, help="routed experts of the k3-debug variant (default 32)")
    parser.add_argument("--top-k", type=int, help="experts per token of the k3-debug variant (default 4)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, k3-tiny sizes: checks the script runs")
    parser.add_argument("--exchange", action="store_true",
                        help="one GPU, no torchrun: time KCP's exchange work beside the layer (module docstring)")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="every rank on GPU 0, collectives over gloo (a machine with one GPU): the checks only, "
                             "since timings need a GPU per rank")
    args = parser.parse_args()
    if args.out is None:
        name = "kcp_exchange.json" if args.exchange else "parallel_shared_gpu.json" if args.shared_gpu else \
            "parallel.json"
        args.out = default_json(name, args.smoke)
    if args.tokens is None:
        args.tokens = [65536, 131072] if args.exchange else [131072, 262144]
    if not args.smoke and not torch.cuda.is_available():
        print("bench/parallel.py needs CUDA GPUs: run it under torchrun --nproc-per-node 2 on a GPU machine "
              "(--smoke checks it on the CPU)", file=sys.stderr)
        raise SystemExit(2)
    if args.exchange:
        run_exchange(get_preset("k3-debug"), args)
        return
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) < 2:
        print("bench/parallel.py compares 1 GPU with several: run it under torchrun --nproc-per-node 2",
              file=sys.stderr)
        raise SystemExit(2)
    dist.init_process_group("gloo" if args.smoke or args.shared_gpu else "nccl", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        cfg = get_preset("k3-tiny")
        args.tokens, args.ep_tokens, args.iters, args.warmup, args.check_tokens = [512], 256, 2, 1, 96
    else:
        device = torch.device("cuda", 0 if args.shared_gpu else int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        cfg = get_preset("k3-debug")
        moe = {key: value for key, value in (("num_experts", args.experts), ("top_k", args.top_k)) if value}
        cfg = cfg.with_overrides({"moe": moe}) if moe else cfg
        if cfg.moe.num_experts % world:
            raise SystemExit(f"bench/parallel.py: {cfg.moe.num_experts} experts do not split over {world} ranks")
    started = time.perf_counter()
    checks = run_checks(cfg, args, rank, world, device)
    timings = not (args.checks_only or args.shared_gpu)
    kcp = [bench_kcp(cfg, t, args, rank, world, device) for t in args.tokens] if timings else []
    ep = [row for routing in ("natural", "hot expert")
          for row in bench_ep(cfg, args.ep_tokens, routing, args, rank, world, device)] if timings else []
    if rank == 0:
        print(f"\nChecks on {world} ranks against one process ({args.check_tokens} tokens, relative RMS errors, "
              f"worst rank)\n")
        print("| check | output | input grad | worst param grad | ok |\n|---|---|---|---|---|")
        for r in checks:
            print(f"| {r['check']} | {r['output']:.1e} | {r['input_grad']:.1e} | {r['param_grad']:.1e} | "
                  f"{'yes' if r['ok'] else 'NO'} |")
    if rank == 0 and timings:
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
    if rank == 0:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
        result = {"device": device_name, "gpus": 1 if args.shared_gpu else world, "ranks": world,
                  "backend": dist.get_backend(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                  "checks": checks, "kcp": kcp, "ep": ep, "seconds": time.perf_counter() - started}
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")
    dist.barrier()  # rank 0 wrote the JSON; no rank leaves while a peer may still read from it
    dist.destroy_process_group()
    failed = [r["check"] for r in checks if not r["ok"]]
    if failed:
        print(f"bench/parallel.py: {len(failed)} check(s) above the tolerance: {failed}", file=sys.stderr)
    # Leave without the interpreter's teardown: after a clean run and destroy_process_group, a rank's exit aborted
    # in it ("terminate called without an active exception", gloo on two CPU processes, torch 2.13: 1 run in 3-6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
