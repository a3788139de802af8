"""The KDA short conv + SiLU on one GPU: the Triton Function (`ops.triton_conv`) beside `ops.conv._ConvSiLU`
(PyTorch's depthwise conv, recomputed in backward), forward and forward + backward.

    python bench/conv_bwd.py [--json PATH] [--sweep]

x [8, 4096, 3072] and [1, 12288, 3072] bf16 (the k3-debug KDA layer: 3 x 8 heads x 128 channels), the kernel
[3072, 4] fp32 with the conv in bf16 (as the layer runs it under autocast), no state and a bf16 state [B, C, 3]
(KCP's halo, serving's conv state). Times with CUDA events, the median of 20 calls after 3 warm-up calls; bwd is
fwd+bwd minus fwd. Checks the Triton output and gradients (x, kernel, state) against `_ConvSiLU`'s (norm-wise
relative error, at most 2^-6 as tests/test_triton_conv.py allows bf16) and the Triton backward's bytes moved
(pass 1 reads x and dy and writes g in bf16 and per-program dw partials; pass 2 reads g and writes dx) per bwd
second. Prints a Markdown table and writes bench/conv_bwd.json; exits non-zero on a mismatch. --sweep instead
times the Triton forward and backward at the first shape (with and without a state) for several tiles and warps,
checking that each gives the default tile's y, dx and dstate bit for bit and its dw to rounding (how
ops.triton_conv's tiles were chosen).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton

from openk3.ops import triton_conv
from openk3.ops.conv import _ConvSiLU

HERE = Path(__file__).parent
SHAPES = [(8, 4096, 3072), (1, 12288, 3072)]  # B, T, C
W = 4
DTYPE = torch.bfloat16
WARMUP, ITERS = 3, 20
TOL = 2 ** -6


def cuda_ms(fn) -> float:
    """Median milliseconds of fn over ITERS calls after WARMUP, by CUDA events."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paths(with_state: bool):
    """name -> fn(x, w, state): the two autograd Functions as `ops.conv.causal_conv1d` calls them."""
    def triton_fn(x, w, state):
        return triton_conv.conv_silu_triton(x, w, state, DTYPE)

    def torch_fn(x, w, state):
        past = state if with_state else x.new_zeros(x.shape[0], x.shape[-1], W - 1)
        return _ConvSiLU.apply(x, w, past, DTYPE)

    return {"triton": triton_fn, "torch": torch_fn}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bwd_bytes(B: int, T: int, C: int) -> int:
    """What the Triton backward reads and writes in DRAM (once each; the W shifted reads hit cache)."""
    tiles = B * triton.cdiv(T, triton_conv.BWD_G_ROWS)
    act = B * T * C * DTYPE.itemsize
    return 3 * act + 2 * act + 2 * tiles * C * W * 4  # x, dy, g | g, dx | dw partials written and summed


def run(B: int, T: int, C: int, with_state: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, C, device="cuda", dtype=DTYPE, generator=g)
    w = torch.randn(C, W, device="cuda", generator=g) / W ** 0.5
    state = torch.randn(B, C, W - 1, device="cuda", dtype=DTYPE, generator=g) if with_state else None
    dy = torch.randn(B, T, C, device="cuda", dtype=DTYPE, generator=g)
    leaves = [t.requires_grad_() for t in (x, w, state) if t is not None]
    row = {"shape": [B, T, C], "W": W, "state": with_state}
    outs = {}
    for name, fn in paths(with_state).items():
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = cuda_ms(lambda fn=fn: fn(x, w, state))
        row[f"{name}_fwd_bwd_ms"] = cuda_ms(lambda fn=fn: torch.autograd.grad(fn(x, w, state), leaves, dy))
        row[f"{name}_bwd_ms"] = row[f"{name}_fwd_bwd_ms"] - row[f"{name}_fwd_ms"]
        y = fn(x, w, state)
        outs[name] = [y.detach(), *torch.autograd.grad(y, leaves, dy)]
    names = ["y", "dx", "dw"] + (["dstate"] if with_state else [])
    row["rel_err_vs_torch"] = {n: rel(a, b) for n, a, b in zip(names, outs["triton"], outs["torch"])}
    row["ok"] = all(e <= TOL for e in row["rel_err_vs_torch"].values())
    row["fwd_bwd_speedup"] = row["torch_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"]
    row["triton_bwd_bytes"] = bwd_bytes(B, T, C)
    row["triton_bwd_tb_per_s"] = row["triton_bwd_bytes"] / (row["triton_bwd_ms"] * 1e-3) / 1e12
    return row


# (block_t, block_c, warps) of the forward that --sweep times; the first is ops.triton_conv's default
SWEEP_FWD_TILES = [(triton_conv.BLOCK_T, triton_conv.BLOCK_C, triton_conv.FWD_WARPS), (64, 128, 4), (64, 64, 4),
                   (32, 128, 4), (32, 64, 4), (64, 128, 8), (16, 128, 4), (16, 256, 8), (8, 512, 4)]
# (block_t, block_c, warps) of the backward's second pass (dx) that --sweep times; the first is ops.triton_conv's
# default
SWEEP_TILES = [(triton_conv.BWD_BLOCK_T, triton_conv.BWD_BLOCK_C, triton_conv.BWD_WARPS), (32, 64, 4), (16, 128, 4),
               (32, 128, 4), (16, 256, 4), (128, 32, 4)]
# (block_t, block_c, rows, warps) of the backward's first pass (g and dw); the first is ops.triton_conv's default
SWEEP_G_TILES = [(triton_conv.BWD_G_BLOCK_T, triton_conv.BWD_G_BLOCK_C, triton_conv.BWD_G_ROWS,
                  triton_conv.BWD_G_WARPS), (8, 128, 256, 1), (4, 128, 256, 1), (4, 64, 256, 1), (8, 64, 128, 1),
                 (8, 64, 512, 1), (16, 64, 256, 1), (8, 256, 256, 2)]


def sweep(B: int, T: int, C: int, with_state: bool) -> list[dict]:
    """The Triton forward and backward (both passes and the dw sum) alone at each of SWEEP_FWD_TILES, and
    SWEEP_G_TILES x SWEEP_TILES (each pass-1 tile with the default pass 2, the default pass 1 with each pass-2
    tile): y, dx and dstate compared bitwise against the default tile's, dw (summed over other groupings of
    tokens) by its relative error."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, C, device="cuda", dtype=DTYPE, generator=g)
    w = (torch.randn(C, W, device="cuda", generator=g) / W ** 0.5).to(DTYPE)
    state = torch.randn(B, C, W - 1, device="cuda", dtype=DTYPE, generator=g) if with_state else None
    dy = torch.randn(B, T, C, device="cuda", dtype=DTYPE, generator=g)
    label = f"| {'x'.join(map(str, (B, T, C)))} | {'bf16' if with_state else 'none'} |"
    rows = []
    y_ref = triton_conv._forward(x, w, state, DTYPE)[0]
    for tile in SWEEP_FWD_TILES:
        ms = cuda_ms(lambda tile=tile: triton_conv._forward(x, w, state, DTYPE, tile))
        same = torch.equal(triton_conv._forward(x, w, state, DTYPE, tile)[0], y_ref)
        rows.append({"shape": [B, T, C], "state": with_state, "pass": "fwd", "tile": list(tile), "ms": ms,
                     "same_bits": same})
        print(f"{label} fwd | [{tile[0]}, {tile[1]}] | {tile[2]} | {ms:.3f} | {same} | |")
    reference = triton_conv._backward(x, w, state, [dy])
    for g_tile in SWEEP_G_TILES:
        for tile in SWEEP_TILES if g_tile == SWEEP_G_TILES[0] else SWEEP_TILES[:1]:
            ms = cuda_ms(lambda tile=tile, g_tile=g_tile: triton_conv._backward(x, w, state, [dy], tile, g_tile))
            dx, dw, dstate = triton_conv._backward(x, w, state, [dy], tile, g_tile)
            same = torch.equal(dx, reference[0]) and (dstate is None or torch.equal(dstate, reference[2]))
            rows.append({"shape": [B, T, C], "state": with_state, "pass": "bwd", "tile": list(tile),
                         "g_tile": list(g_tile), "ms": ms, "same_bits": same, "dw_rel_err": rel(dw, reference[1])})
            print(f"{label} bwd | {list(g_tile)} + [{tile[0]}, {tile[1]}] | {g_tile[3]} + {tile[2]} | {ms:.3f} | "
                  f"{same} | {rows[-1]['dw_rel_err']:.1e} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=HERE / "conv_bwd.json")
    ap.add_argument("--sweep", action="store_true",
                    help="instead: time the Triton forward and backward at each tile of SWEEP_FWD_TILES, "
                         "SWEEP_G_TILES and SWEEP_TILES (JSON: sweep rows)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/conv_bwd.py needs a CUDA device (it times the Triton kernels on a GPU)")
    if args.sweep:
        print("| shape | state | pass | tile | warps | ms | y / dx, dstate: the default's bits | dw rel. err |\n"
              "|---|---|---|---|---|---|---|---|")
        rows = [r for with_state in (False, True) for r in sweep(*SHAPES[0], with_state)]
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                                         "sweep": rows}, indent=1) + "\n")
        return

    start = time.time()
    rows = [run(*shape, with_state) for shape in SHAPES for with_state in (False, True)]
    print("| shape | state | triton fwd ms | torch fwd ms | triton fwd+bwd ms | torch fwd+bwd ms | torch / triton "
          "| triton bwd ms (TB/s) | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        worst = max(r["rel_err_vs_torch"].values())
        print(f"| {'x'.join(map(str, r['shape']))} | {'bf16' if r['state'] else 'none'} | {r['triton_fwd_ms']:.3f} "
              f"| {r['torch_fwd_ms']:.3f} | {r['triton_fwd_bwd_ms']:.3f} | {r['torch_fwd_bwd_ms']:.3f} "
              f"| {r['fwd_bwd_speedup']:.2f} | {r['triton_bwd_ms']:.3f} ({r['triton_bwd_tb_per_s']:.2f}) "
              f"| {worst:.1e}{'' if r['ok'] else ' MISMATCH'} |")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "seconds": time.time() - start, "rows": rows}
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json} ({result['seconds']:.0f} s)")
    if not all(r["ok"] for r in rows):
        raise SystemExit(f"the Triton conv disagrees with _ConvSiLU by more than {TOL:.1e} (rel_err_vs_torch)")


if __name__ == "__main__":
    main()
