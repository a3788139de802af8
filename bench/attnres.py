"""Block AttnRes's phase 1 and merge + pre-norm on a GPU in training: the Triton kernels against torch.compile.

  python bench/attnres.py [--batch-size 8 --seq-len 4096 --dim 1024 --blocks 3 --queries 8] [--sweep]

CUDA only. At k3-debug's training shapes by default (phase 1 of its last epoch: the fp32 embedding and two bf16
block sums, 8 queries; the merge: a bf16 partial sum and sublayer output, fp32 phase 1, the normalised input in
bf16), forward + backward with random output gradients: the Triton kernels (`ops.triton_attnres.blocks_triton`
and `merge_norm_triton`, what `compile_blocks` runs on CUDA) against the PyTorch forms under
torch.compile (what it ran before, the peer), with their relative difference, the bytes the op must move at least
and the bandwidth that makes. --sweep also times the backwards' launch shapes (programs, warps). Prints a table
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


def flat(mixed) -> tuple[torch.Tensor, ...]:
    """Phase 1's (mixes, lse rows) as one tuple."""
    return (*mixed[0], *mixed[1])


def bench_blocks(args) -> dict:
    """Phase 1 at the last epoch's shapes: args.blocks block sums (the fp32 embedding, then bf16 partial sums) and
    args.queries fp32 queries."""
    B, T, D, N, Q = args.batch_size, args.seq_len, args.dim, args.blocks, args.queries
    blocks = [torch.randn(B, T, D, device="cuda", dtype=torch.float32 if n == 0 else torch.bfloat16)
              for n in range(N)]
    queries = torch.randn(Q, D, device="cuda") / D**0.5
    grads = [torch.randn(B, T, D, device="cuda") for _ in range(Q)] + [torch.randn(B, T, device="cuda")
                                                                         for _ in range(Q)]
    kernel = lambda q, *b: flat(triton_attnres.blocks_triton(list(b), q, 1e-5))  # noqa: E731
    compiled_ref = torch.compile(lambda q, *b: flat(attnres.attn_res_blocks_reference(list(b), q, 1e-5)))
    inputs = [queries, *blocks]
    with torch.no_grad():
        got, want = kernel(*inputs), compiled_ref(*inputs)
    row = {"max_rel_diff": max(rel(a, b) for a, b in zip(got, want))}
    for name, fn in (("triton", kernel), ("compiled", compiled_ref)):
        row[f"{name}_ms"] = ms(fwd_bwd(fn, inputs, grads))
    block_bytes = 4 + 2 * (N - 1)  # per element of one row: the block sums, each read once a way, grads written
    row["min_bytes"] = B * T * D * (block_bytes + 4 * Q + block_bytes + 4 * Q + block_bytes)
    if args.sweep:
        row["sweep"] = []
        for programs in (32, 64, 128, 256):
            for warps in (4, 8):
                triton_attnres.DQ_ROW_PROGRAMS, triton_attnres.BLOCKS_BWD_WARPS = programs, warps
                row["sweep"].append({"dq_row_programs": programs, "warps": warps,
                                     "fwd_bwd_ms": ms(fwd_bwd(kernel, inputs, grads))})
                print(row["sweep"][-1], flush=True)
        triton_attnres.DQ_ROW_PROGRAMS, triton_attnres.BLOCKS_BWD_WARPS = 64, None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=3, help="phase 1's block sums (k3-debug's last epoch: 3)")
    parser.add_argument("--queries", type=int, default=8, help="phase 1's queries (k3-debug's epochs: 8)")
    parser.add_argument("--sweep", action="store_true", help="also time the backwards' launch shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attnres.py needs a CUDA device")
    rows = {"phase 1 (blocks)": bench_blocks(args), "merge + norm": bench_merge(args)}
    print(f"\n{torch.cuda.get_device_name()}, B {args.batch_size} x T {args.seq_len} x D {args.dim}, "
          f"{args.blocks} block sums, {args.queries} queries; forward + backward\n")
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
