"""Block AttnRes's merge + pre-norm on a GPU in training: the Triton kernels against torch.compile.

  python bench/attnres.py [--batch-size 8 --seq-len 4096 --dim 1024] [--sweep]

CUDA only. At k3-debug's training shapes by default (a bf16 partial sum and sublayer output, fp32 phase 1, the
normalised input in bf16), forward + backward with random output gradients: the Triton kernels
(`ops.triton_attnres.merge_norm_triton`, what `compile_blocks` runs on CUDA) against the PyTorch form under
torch.compile (what it ran before, the peer), with their relative difference, the bytes the op must move at least
and the bandwidth that makes. --sweep also times the backward's launch shapes (programs, warps). Prints a table
and writes bench/attnres.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from openk3.ops import attnres, triton_attnres

HERE = Path(__file__).parent


def ms(fn, reps: int = 20) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=reps * 5, return_mode="median")


def fwd_bwd(fn, inputs, grads):
    """A closure running fn(*inputs) forward and backward with the output gradients `grads`."""
    leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]

    def run():
        outs = fn(*leaves)
        torch.autograd.backward(outs, grads)
        for t in leaves:
            t.grad = None
    return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bench_merge(args) -> dict:
    B, T, D = args.batch_size, args.seq_len, args.dim
    mix = torch.randn(B, T, D, device="cuda")
    lse = torch.randn(B, T, device="cuda")
    partial = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)
    addend = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(D, device="cuda") / D**0.5
    weight = 1 + 0.1 * torch.randn(D, device="cuda")
    grads = [torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16),
             torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)]
    kernel = lambda *a: triton_attnres.merge_norm_triton(a[0], a[1], a[2], a[3], a[4], 1e-5, a[5], 1e-5,  # noqa: E731
                                                         torch.bfloat16)

    compiled_ref = torch.compile(lambda m, lse_, p, a, q, w: attnres.attn_res_merge_norm_reference(
        m, lse_, p, a, q, 1e-5, torch.float32, w, 1e-5, torch.bfloat16))
    inputs = [mix, lse, partial, addend, query, weight]
    with torch.no_grad():
        got, want = kernel(*inputs), compiled_ref(*inputs)
    row = {"max_rel_diff": max(rel(a, b) for a, b in zip(got, want))}
    for name, fn in (("triton", kernel), ("compiled", compiled_ref)):
        row[f"{name}_ms"] = ms(fwd_bwd(fn, inputs, grads))
    row["min_bytes"] = B * T * D * ((2 + 2 + 4 + 2 + 2) + (2 + 2 + 2 + 4 + 4 + 2 + 2))
    if args.sweep:
        row["sweep"] = []
        for programs in (512, 1024, 2048, 4096, 8192):
            for warps in (4, 8):
                triton_attnres.MAX_BWD_PROGRAMS, triton_attnres.BWD_WARPS = programs, warps
                row["sweep"].append({"programs": programs, "warps": warps,
                                     "fwd_bwd_ms": ms(fwd_bwd(kernel, inputs, grads))})
                print(row["sweep"][-1], flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--sweep", action="store_true", help="also time the backward's launch shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attnres.py needs a CUDA device")
    rows = {"merge + norm": bench_merge(args)}
    print(f"\n{torch.cuda.get_device_name()}, B {args.batch_size} x T {args.seq_len} x D {args.dim}; forward + "
          "backward\n")
    print("| op | Triton (ms) | torch.compile (ms) | speed-up | Triton GB/s (min bytes) | max rel. diff |\n"
          "|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['triton_ms']:.3f} | {r['compiled_ms']:.3f} | {r['compiled_ms'] / r['triton_ms']:.2f}x | "
              f"{r['min_bytes'] / r['triton_ms'] / 1e6:,.0f} | {r['max_rel_diff']:.1e} |")
    (HERE / "attnres.json").write_text(json.dumps(
        {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **vars(args)}, "rows": rows},
        indent=1))


if __name__ == "__main__":
    main()
