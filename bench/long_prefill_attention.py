"""MLA attention of one long-context prefill chunk, by SDPA kernel: where a long prompt's TTFT goes.

    python bench/long_prefill_attention.py [--chunk 16384] [--contexts 16384 65536 262144] [--json F]

A chunk of T new queries at the end of a context of L positions (the past L - T plus the chunk itself) attends
bottom-right causally, k3-debug's MLA shape (8 heads, q / k head dim 192, v 128, bf16; `--heads`, `--dims`
change it). Variants, each timed over a few calls after a warm-up (CUDA events) and compared with the first:
  - `flash lower-right`: what `ops.attention.causal_sdpa` ran before 2026-12-05 (v zero-padded to 192, one SDPA
    call with torch's bottom-right causal mask);
  - `efficient lower-right`: torch's memory-efficient kernel with the same mask (no padding);
  - `cudnn split`: the past (no mask) and the chunk's own T x T block (causal) as two cuDNN calls, merged by their
    log-sum-exps (no padding; cuDNN builds a plan per new shape: its first call is timed apart);
  - `flash split (causal_sdpa)`: the same two parts through flash (padded v): `causal_sdpa` now
    (`ops.attention.past_and_own_attention`).
Each row also gives the attention FLOPs rate (4 x H x (dk + dv) / 2 x T x (L - T / 2), padding not counted).
Prints a table and writes JSON; it has no peer of its own (the variants are each other's).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from openk3.ops.attention import NO_CUDNN, causal_sdpa, merge_attention


def cudnn_part(q, k, v, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=scale)
    return out, lse.reshape(q.shape[:3]).float()


def split(part):
    def attend(q, k, v, scale):
        T, L = q.shape[-2], k.shape[-2]
        if L == T:
            return part(q, k, v, True, scale)[0]
        past = part(q, k[:, :, :L - T], v[:, :, :L - T], False, scale)
        own = part(q, k[:, :, L - T:], v[:, :, L - T:], True, scale)
        return merge_attention(*past, *own)
    return attend


def efficient(q, k, v, scale):
    T, L = q.shape[-2], k.shape[-2]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if L == T else causal_lower_right(T, L),
                                              is_causal=L == T, scale=scale)


def flash_lower_right(q, k, v, scale):
    """The bottom-right-masked SDPA call `causal_sdpa` made before it split (v padded for the flash kernel)."""
    T, L, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    with sdpa_kernel(NO_CUDNN):
        return F.scaled_dot_product_attention(q, k, F.pad(v, (0, q.shape[-1] - dv)), scale=scale,
                                              attn_mask=None if L == T else causal_lower_right(T, L),
                                              is_causal=L == T)[..., :dv]


VARIANTS = {
    "flash lower-right": flash_lower_right,
    "efficient lower-right": efficient,
    "cudnn split": split(cudnn_part),
    "flash split (causal_sdpa)": lambda q, k, v, scale: causal_sdpa(q, k, v, scale, backends=NO_CUDNN),
}


def timed(fn, repeats: int) -> tuple[float, float, torch.Tensor]:
    """(first call ms, mean ms of `repeats` later calls, the output)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return first, start.elapsed_time(end) / repeats, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=16384, help="new tokens T (default 16384: the idle prefill chunk)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536, 262144], help="L, each >= T")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dims", type=int, nargs=2, default=[192, 128], metavar=("DK", "DV"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", os.path.dirname(os.path.abspath(__file__))),
                                                   "long_prefill_attention.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/long_prefill_attention.py: error: needs a CUDA GPU")
    T, H, (dk, dv) = args.chunk, args.heads, args.dims
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"T {T}, {H} heads, dk {dk}, dv {dv}, bf16")
    print("| context L | variant | first call ms | ms | TFLOP/s | max abs diff vs first |\n|---|---|---|---|---|---|")
    for L in args.contexts:
        # [B,L,H,d] in memory, as mla_expand_kv lays them out
        q = torch.randn(1, T, H, dk, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        k = torch.randn(1, L, H, dk, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        v = torch.randn(1, L, H, dv, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        flops = 4 * H * (dk + dv) / 2 * T * (L - T / 2)
        reference = None
        for name, fn in VARIANTS.items():
            try:
                first, ms, out = timed(functools.partial(fn, q, k, v, dk ** -0.5), args.repeats)
            except Exception as err:  # a kernel that refuses this shape: say so, go on
                print(f"| {L} | {name} | - | - | - | {type(err).__name__}: {str(err).splitlines()[0][:80]} |")
                continue
            reference = out if reference is None else reference
            diff = (out.float() - reference.float()).abs().max().item()
            rows.append({"context": L, "chunk": T, "variant": name, "first_ms": first, "ms": ms,
                         "tflops": flops / ms / 1e9, "max_abs_diff": diff})
            print(f"| {L} | {name} | {first:.1f} | {ms:.2f} | {flops / ms / 1e9:.0f} | {diff:.2e} |", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d"), "heads": H, "dk": dk, "dv": dv, "rows": rows}, fh, indent=1)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
