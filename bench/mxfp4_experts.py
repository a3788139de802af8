"""One MoE layer's routed experts on a GPU, bf16 against MXFP4 kept packed, and the start-up of a 48B model.

    python bench/mxfp4_experts.py [--batches 1 16 64 256 4096] [--startup]

Experts of kimi-linear-48b by default (256 experts, top 8, hidden 2304, expert width 1024). For each batch of
tokens (random routing, bf16 activations), each replayed as a CUDA graph and timed with triton's do_bench (median):
  bf16         `ops.moe.experts_forward` on bf16 weights (what `Experts` runs: gathered / dense / grouped GEMM)
  mxfp4        `ops.moe.experts_forward_mxfp4` as `PackedExperts` runs it (method "auto": the kernel picked by the
               rows per expert, `ops.triton_mxfp4.pick_method`)
  mxfp4-rows   the row kernel at every batch
  mxfp4-tiles  the row tiles with the explicit dequantization at every batch (bf16 rows on Hopper: in Gluon,
               `ops.gluon_mxfp4`, up to 64 rows a tile)
  mxfp4-scaled the row tiles with tl.dot_scaled at every batch
  mxfp4-expand every expert expanded to bf16 in one pass, then the bf16 path (for prefill-sized batches)
  mxfp4-rows-triton, mxfp4-tiles-triton: the row kernel and the tiles with the codes decoded by their Triton twin
               (what the interpreter runs) instead of PTX: the same-run peer of the PTX decode
  mxfp4-tiles-no-gluon: the tiles in Triton (PTX decode, the weights staged through shared memory for the MMA):
               the same-run peer of the Gluon tiles
with the weight bytes the batch's experts hold (the floor a step must read) and the bandwidth that makes, and the
MXFP4 outputs' relative error against bf16 experts holding the dequantized values. --splits also times the two
MXFP4 GEMMs alone at each split-K count for the decode-sized batches. --startup also builds
kimi-linear-48b in bf16 and with MXFP4 experts (`openk3.build.build_model`, random init) and prints the phases.
Writes bench/mxfp4_experts.json. `--device cpu --tiny` runs a small case under TRITON_INTERPRET=1 (a smoke test:
no timings worth reading).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path
from unittest.mock import patch

import torch

from common import require_interpreter  # bench/common.py (the script's folder is on sys.path)
from openk3.config import get_preset
from openk3.ops import gluon_mxfp4, triton_experts_common
from openk3.ops.activations import glu_activation
from openk3.ops.moe import experts_forward, experts_forward_mxfp4
from openk3.quant.mx import unpack_mxfp4
from openk3.quant.packed_experts import pack_mxfp4_chunked

HERE = Path(__file__).parent
SPLITS = (1, 2, 4, 8, 0)  # --splits: the split-K counts timed (0: the kernel's own choice)


def timed(fn, device: torch.device) -> float:
    """Milliseconds per call: a CUDA graph's replay (median of triton's do_bench); one eager call on CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median")


def patched(module, flag: str, fn):
    """fn with module.flag off: `triton_experts_common.PTX_DECODE` (the MXFP4 kernels decode their codes in
    Triton, not PTX) or `gluon_mxfp4.GLUON_TILES` (the tiles in Triton on Hopper too)."""
    def run():
        with patch.object(module, flag, False):
            return fn()
    return run


def formats(x, indices, weights, dense, packed, act) -> dict:
    """format -> the call that runs the batch's experts in it."""
    return {"bf16": lambda: experts_forward(x, indices, weights, *dense, act),
            "mxfp4": lambda: experts_forward_mxfp4(x, indices, weights, *packed, act, "auto"),
            "mxfp4-rows": lambda: experts_forward_mxfp4(x, indices, weights, *packed, act, "rows"),
            "mxfp4-tiles": lambda: experts_forward_mxfp4(x, indices, weights, *packed, act, "dequant"),
            "mxfp4-scaled": lambda: experts_forward_mxfp4(x, indices, weights, *packed, act, "dot_scaled"),
            "mxfp4-expand": lambda: experts_forward_mxfp4(x, indices, weights, *packed, act, "expand"),
            "mxfp4-rows-triton": patched(triton_experts_common, "PTX_DECODE", lambda: experts_forward_mxfp4(
                x, indices, weights, *packed, act, "rows")),
            "mxfp4-tiles-triton": patched(triton_experts_common, "PTX_DECODE", lambda: experts_forward_mxfp4(
                x, indices, weights, *packed, act, "dequant")),
            "mxfp4-tiles-no-gluon": patched(gluon_mxfp4, "GLUON_TILES", lambda: experts_forward_mxfp4(
                x, indices, weights, *packed, act, "dequant"))}


def bench_experts(E: int, k: int, dim: int, inter: int, batches: list[int], device: torch.device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(E, 2 * inter, dim, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, dim, inter, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    packed = pack_mxfp4_chunked(gate_up), pack_mxfp4_chunked(down)
    del gate_up, down
    dense = unpack_mxfp4(*packed[0], torch.bfloat16), unpack_mxfp4(*packed[1], torch.bfloat16)  # the same values
    act = glu_activation("swiglu")
    rows = []
    for n in batches:
        x = torch.randn(n, dim, generator=g, device=device, dtype=torch.bfloat16)
        indices = torch.rand(n, E, generator=g, device=device).topk(k, dim=-1).indices
        weights = torch.rand(n, k, generator=g, device=device)
        touched = int(torch.unique(indices).numel())
        values = touched * 3 * dim * inter
        runs = formats(x, indices, weights, dense, packed, act)
        with torch.no_grad():
            want = runs["bf16"]().float()
            for name, fn in runs.items():
                err = float((fn().float() - want).norm() / want.norm())
                ms = timed(fn, device)
                read = values * (2 if name == "bf16" else 0.5 + 1 / 32)
                rows.append({"format": name, "tokens": n, "experts_touched": touched, "ms": ms,
                             "weight_gb": read / 1e9, "gb_per_s": read / ms / 1e6, "rel_err_vs_bf16": err})
                print(f"{name:18s} tokens {n:5d}  experts {touched:3d}  {ms * 1e3:9.1f} us  "
                      f"{read / 1e9:6.3f} GB  {read / ms / 1e6:7.0f} GB/s  rel err {err:.1e}", flush=True)
    return rows


def bench_splits(E: int, k: int, dim: int, inter: int, batches: list[int], device: torch.device) -> list[dict]:
    """The MXFP4 GEMMs alone (gate-up, then down, on rows grouped by expert) at each split-K count
    (`ops.triton_mxfp4`; 0: the count `k_splits` picks), for the decode-sized batches."""
    from openk3.ops.moe import group_by_expert
    from openk3.ops.triton_mxfp4 import mxfp4_grouped_matmul_triton

    g = torch.Generator(device=device).manual_seed(1)
    shapes = {"gate_up": (2 * inter, dim), "down": (dim, inter)}
    weights = {name: pack_mxfp4_chunked(torch.randn(E, n, kk, generator=g, device=device, dtype=torch.bfloat16))
               for name, (n, kk) in shapes.items()}
    rows = []
    for n in batches:
        _, counts = group_by_expert(torch.rand(n, E, generator=g, device=device).topk(k, dim=-1).indices, E)
        for name, (out, width) in shapes.items():
            x = torch.randn(n * k, width, generator=g, device=device, dtype=torch.bfloat16)
            read = int((counts > 0).sum()) * out * width * (0.5 + 1 / 32)
            for kernel, splits in itertools.product(("dequant", "rows"), SPLITS):
                ms = timed(functools.partial(mxfp4_grouped_matmul_triton, x, counts, *weights[name], kernel, splits),
                           device)
                rows.append({"gemm": name, "tokens": n, "kernel": kernel, "splits": splits, "ms": ms,
                             "gb_per_s": read / ms / 1e6})
                print(f"{name:8s} tokens {n:4d}  {kernel:5s}  splits {splits or 'auto':>4}  {ms * 1e3:8.1f} us  "
                      f"{read / ms / 1e6:7.0f} GB/s", flush=True)
    return rows


def bench_startup(device: torch.device) -> list[dict]:
    from openk3.build import build_model

    rows = []
    for quantization in (None, "mxfp4"):
        torch.manual_seed(0)
        model, report = build_model(get_preset("kimi-linear-48b"), device, torch.bfloat16, quantization)
        print(report.line(), flush=True)
        rows.append({"format": quantization or "bf16", "phases_s": report.phases,
                     "startup_s": sum(report.phases.values()), "weights_gib": report.weights_bytes / (1 << 30)})
        del model
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256, 4096])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="16 experts, top 4, width 64 (CPU smoke test)")
    parser.add_argument("--startup", action="store_true", help="also time building kimi-linear-48b (CUDA)")
    parser.add_argument("--splits", action="store_true",
                        help=f"also time the two MXFP4 GEMMs alone at split-K counts {SPLITS} (0: the kernel's "
                             "choice) for the batches of at most 64 tokens")
    args = parser.parse_args()
    device = torch.device(args.device)
    require_interpreter(parser, args.device, "mxfp4_experts.py")
    moe = get_preset("kimi-linear-48b").moe
    shape = (16, 4, 64, 32) if args.tiny else (moe.num_experts, moe.top_k, 2304, moe.expert_hidden)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "experts": dict(zip(("num", "top_k", "dim", "hidden"), shape)),
              "rows": bench_experts(*shape, args.batches, device)}
    if args.splits:
        result["splits"] = bench_splits(*shape, [n for n in args.batches if n <= 64], device)
    if args.startup:
        result["startup"] = bench_startup(device)
    if not args.tiny:
        (HERE / "mxfp4_experts.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
