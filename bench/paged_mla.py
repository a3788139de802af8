"""The paged MLA decode kernel at the serving engine's shapes, against the forms it replaced, in one run (one GPU).

    python bench/paged_mla.py [--preset k3-debug] [--json F]
    python bench/paged_mla.py --device cpu --tiny   # toy sizes under TRITON_INTERPRET=1: checks the script

Rows, each timed as a CUDA-graph replay (`triton.testing.do_bench_cudagraph`, median) with the merge of the splits:
- decode (1 query a sequence) at batch 1 over 64k / 256k positions: the split count the op picks now against the
  earlier cap of 64 splits (`--old-max-splits`);
- T queries a sequence (a verification of K + 1 = 4, a short prefill of 256 padded tokens holding 64 real ones)
  after a long past: one kernel row per sequence (its past read once) against one row per query (the earlier form:
  each query re-reads the past; padding queries too).
Both forms are checked against each other first. Prints a table and writes JSON ({rows: [{case, ms, peer_ms,
speedup, read_floor_ms}]}); read_floor_ms is the latents' bytes at 4.8 TB/s. On a CPU (--tiny) the forms are
checked and timed by the wall clock, which says nothing of a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from common import require_interpreter  # bench/common.py (the script's folder is on sys.path)
from openk3.config import get_preset
from openk3.ops.paged_mla import paged_mla_decode

H200_BYTES_PER_S = 4.8e12


@dataclass(frozen=True)
class Sizes:
    page: int
    decode_pasts: tuple[int, ...]
    verify: tuple[tuple[int, int], ...]  # (batch, past) of the T = 4 rows
    short: tuple[int, int, int, int]  # rows, past, token slots, real tokens of the short-prefill row


GPU = Sizes(768, (65536, 262144), ((1, 65536), (8, 16384), (64, 16384)), (32, 16384, 256, 64))
TINY = Sizes(16, (300,), ((2, 70),), (3, 90, 16, 5))


def setup(batch: int, past: int, T: int, heads: int, R: int, r: int, page: int, gen: torch.Generator, device: str):
    pages = -(-(past + T) // page)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pool = torch.randn(batch * pages + 1, page, R + r, generator=gen).to(device, dtype)
    tables = (1 + torch.randperm(batch * pages, generator=gen)).to(device, torch.int32).view(batch, pages)
    q = torch.randn(batch, T, heads, R + r, generator=gen).to(device, dtype)
    return q, pool, tables


def time_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=200, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def several(case: str, batch: int, past: int, T: int, real: int, mc, page: int, gen, device: str) -> dict:
    """T queries a sequence (real of them real, the rest padding): the sequence-row form vs one row per query."""
    H, R, r = mc.num_heads, mc.kv_lora_rank, mc.qk_rope_head_dim
    q, pool, tables = setup(batch, past, T, H, R, r, page, gen, device)
    slots = torch.arange(batch, device=device)
    first = torch.full((batch,), past + 1, device=device)
    num_tokens = torch.full((batch,), real, device=device) if real < T else None
    flat_q = q.reshape(batch * T, H, R + r)
    flat_rows = slots.repeat_interleave(T)
    flat_lengths = (first.view(batch, 1) + torch.arange(T, device=device)).reshape(-1)
    new = lambda: paged_mla_decode(q, pool, tables, slots, first, R, 0.1, num_tokens=num_tokens)
    old = lambda: paged_mla_decode(flat_q, pool, tables, flat_rows, flat_lengths, R, 0.1)
    got, want = new()[:, :real], old().view(batch, T, H, R)[:, :real]
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    ms, peer = time_ms(new, device), time_ms(old, device)
    read = batch * (past + T) * (R + r) * 2
    return {"case": case, "ms": ms, "peer": "one kernel row per query", "peer_ms": peer, "speedup": peer / ms,
            "read_floor_ms": read / H200_BYTES_PER_S * 1e3}


def decode(case: str, past: int, old_max_splits: int, mc, page: int, gen, device: str) -> dict:
    H, R, r = mc.num_heads, mc.kv_lora_rank, mc.qk_rope_head_dim
    q, pool, tables = setup(1, past, 1, H, R, r, page, gen, device)
    q, slots, lengths = q[:, 0], torch.zeros(1, dtype=torch.long, device=device), torch.tensor([past], device=device)
    new = lambda: paged_mla_decode(q, pool, tables, slots, lengths, R, 0.1)
    old = lambda: paged_mla_decode(q, pool, tables, slots, lengths, R, 0.1, num_splits=old_max_splits)
    torch.testing.assert_close(new(), old(), rtol=2e-3, atol=2e-3)
    ms, peer = time_ms(new, device), time_ms(old, device)
    read = past * (R + r) * 2
    return {"case": case, "ms": ms, "peer": f"{old_max_splits} splits", "peer_ms": peer, "speedup": peer / ms,
            "read_floor_ms": read / H200_BYTES_PER_S * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None,
                    help="the MLA shape (heads, latent width) of this preset (default k3-debug; k3-tiny with --tiny)")
    ap.add_argument("--old-max-splits", type=int, default=64, help="the decode peer's split count")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the kernels under TRITON_INTERPRET=1 (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (k3-tiny's MLA shape unless --preset)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/paged_mla.py: needs a CUDA GPU (--device cpu --tiny runs it under the interpreter)")
    require_interpreter(ap, args.device, "paged_mla.py")
    sizes, device = (TINY if args.tiny else GPU), args.device
    args.preset = args.preset or ("k3-tiny" if args.tiny else "k3-debug")
    mc, gen = get_preset(args.preset).mla, torch.Generator().manual_seed(0)
    rows = [decode(f"decode, batch 1, {past} past", past, args.old_max_splits, mc, sizes.page, gen, device)
            for past in sizes.decode_pasts]
    rows += [several(f"verify T=4, batch {b}, {past} past", b, past, 4, 4, mc, sizes.page, gen, device)
             for b, past in sizes.verify]
    n, past, T, real = sizes.short
    rows.append(several(f"short prefill T={T} ({real} real), {n} rows, {past} past", n, past, T, real, mc,
                        sizes.page, gen, device))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"{args.preset}: {mc.num_heads} heads, latent {mc.kv_lora_rank} + {mc.qk_rope_head_dim}, "
          f"{name}, torch {torch.__version__}")
    print(f"{'case':<52} {'ms':>8} {'peer ms':>9} {'speedup':>8} {'floor':>7}  peer")
    for row in rows:
        print(f"{row['case']:<52} {row['ms']:8.4f} {row['peer_ms']:9.4f} {row['speedup']:7.2f}x "
              f"{row['read_floor_ms']:7.4f}  {row['peer']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "device": name, "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
