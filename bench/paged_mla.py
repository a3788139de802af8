"""The paged MLA decode kernel at the serving engine's shapes, against the forms it replaced, in one run (one GPU).

    python bench/paged_mla.py [--preset k3-debug] [--json F]

Rows, each timed as a CUDA-graph replay (`triton.testing.do_bench_cudagraph`, median) with the merge of the splits:
- decode (1 query a sequence) at batch 1 over 64k / 256k positions: the split count the op picks now against the
  earlier cap of 64 splits (`--old-max-splits`);
- T queries a sequence (a verification of K + 1 = 4, a short prefill of 256 padded tokens holding 64 real ones)
  after a long past: one kernel row per sequence (its past read once) against one row per query (the earlier form:
  each query re-reads the past; padding queries too).
Both forms are checked against each other first. Prints a table and writes JSON ({rows: [{case, ms, peer_ms,
speedup, read_floor_ms}]}); read_floor_ms is the latents' bytes at 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json

import torch

from openk3.config import get_preset
from openk3.ops.paged_mla import paged_mla_decode

PAGE = 768
H200_BYTES_PER_S = 4.8e12


def setup(batch: int, past: int, T: int, heads: int, R: int, r: int, gen: torch.Generator):
    pages = -(-(past + T) // PAGE)
    pool = torch.randn(batch * pages + 1, PAGE, R + r, generator=gen).to("cuda", torch.bfloat16)
    tables = (1 + torch.randperm(batch * pages, generator=gen)).to("cuda", torch.int32).view(batch, pages)
    q = torch.randn(batch, T, heads, R + r, generator=gen).to("cuda", torch.bfloat16)
    return q, pool, tables


def time_ms(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=200, return_mode="median")


def several(case: str, batch: int, past: int, T: int, real: int, mc, gen) -> dict:
    """T queries a sequence (real of them real, the rest padding): the sequence-row form vs one row per query."""
    H, R, r = mc.num_heads, mc.kv_lora_rank, mc.qk_rope_head_dim
    q, pool, tables = setup(batch, past, T, H, R, r, gen)
    slots = torch.arange(batch, device="cuda")
    first = torch.full((batch,), past + 1, device="cuda")
    num_tokens = torch.full((batch,), real, device="cuda") if real < T else None
    flat_q = q.reshape(batch * T, H, R + r)
    flat_rows = slots.repeat_interleave(T)
    flat_lengths = (first.view(batch, 1) + torch.arange(T, device="cuda")).reshape(-1)
    new = lambda: paged_mla_decode(q, pool, tables, slots, first, R, 0.1, num_tokens=num_tokens)
    old = lambda: paged_mla_decode(flat_q, pool, tables, flat_rows, flat_lengths, R, 0.1)
    got, want = new()[:, :real], old().view(batch, T, H, R)[:, :real]
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    ms, peer = time_ms(new), time_ms(old)
    read = batch * (past + T) * (R + r) * 2
    return {"case": case, "ms": ms, "peer": "one kernel row per query", "peer_ms": peer, "speedup": peer / ms,
            "read_floor_ms": read / H200_BYTES_PER_S * 1e3}


def decode(case: str, past: int, old_max_splits: int, mc, gen) -> dict:
    H, R, r = mc.num_heads, mc.kv_lora_rank, mc.qk_rope_head_dim
    q, pool, tables = setup(1, past, 1, H, R, r, gen)
    q, slots, lengths = q[:, 0], torch.zeros(1, dtype=torch.long, device="cuda"), torch.tensor([past], device="cuda")
    new = lambda: paged_mla_decode(q, pool, tables, slots, lengths, R, 0.1)
    old = lambda: paged_mla_decode(q, pool, tables, slots, lengths, R, 0.1, num_splits=old_max_splits)
    torch.testing.assert_close(new(), old(), rtol=2e-3, atol=2e-3)
    ms, peer = time_ms(new), time_ms(old)
    read = past * (R + r) * 2
    return {"case": case, "ms": ms, "peer": f"{old_max_splits} splits", "peer_ms": peer, "speedup": peer / ms,
            "read_floor_ms": read / H200_BYTES_PER_S * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-debug", help="the MLA shape (heads, latent width) of this preset")
    ap.add_argument("--old-max-splits", type=int, default=64, help="the decode peer's split count")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/paged_mla.py: needs a CUDA GPU")
    mc, gen = get_preset(args.preset).mla, torch.Generator().manual_seed(0)
    rows = [decode(f"decode, batch 1, {past // 1024}k past", past, args.old_max_splits, mc, gen)
            for past in (65536, 262144)]
    rows += [several(f"verify T=4, batch {b}, {past // 1024}k past", b, past, 4, 4, mc, gen)
             for b, past in ((1, 65536), (8, 16384), (64, 16384))]
    rows.append(several("short prefill T=256 (64 real), 32 rows, 16k past", 32, 16384, 256, 64, mc, gen))
    print(f"{args.preset}: {mc.num_heads} heads, latent {mc.kv_lora_rank} + {mc.qk_rope_head_dim}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':<52} {'ms':>8} {'peer ms':>9} {'speedup':>8} {'floor':>7}  peer")
    for row in rows:
        print(f"{row['case']:<52} {row['ms']:8.4f} {row['peer_ms']:9.4f} {row['speedup']:7.2f}x "
              f"{row['read_floor_ms']:7.4f}  {row['peer']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
