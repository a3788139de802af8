"""`openk3 info`: a preset's parameter counts, routed-expert bytes and decode-cache sizes (the definitions:
openk3.accounting)."""

from __future__ import annotations

import argparse
import json
import sys

from openk3.accounting import cache_bytes, count_parameters, expert_bytes
from openk3.accounting import short_count as _num
from openk3.cli_options import ShowDefaults, int_at_least
from openk3.config import PRESETS, ModelConfig, get_preset


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def info_report(cfg: ModelConfig, context: int = 1 << 20) -> dict:
    counts = count_parameters(cfg)
    return {"preset": cfg.name, **counts, "moe_expert_bytes": expert_bytes(counts["breakdown"]["moe_experts"]),
            "cache": cache_bytes(cfg, context)}


def format_report(rep: dict) -> str:
    total = rep["total_params"]
    lines = [
        f"model {rep['preset']}",
        f"  total parameters   {_num(total):>10}  ({total:,})",
        f"  active parameters  {_num(rep['active_params']):>10}  ({rep['active_params']:,})",
        "  breakdown (MTP and vision excluded from the totals):",
    ]
    for comp, n in rep["breakdown"].items():
        if n:
            lines.append(f"    {comp:<12} {_num(n):>10}  {100 * n / total:6.2f}%")
    lines.append(f"    {'mtp':<12} {_num(rep['mtp_params']):>10}  (active {_num(rep['mtp_active_params'])})")
    if rep["vision_params"]:
        v = rep["vision_breakdown"]
        lines.append(f"    {'vision':<12} {_num(rep['vision_params']):>10}  (tower {_num(v['vision_tower'])},"
                     f" projector {_num(v['mm_projector'])}; every image token uses all of it)")
    if rep["breakdown"]["moe_experts"]:
        b = rep["moe_expert_bytes"]
        lines.append(f"  routed expert weights: {_bytes(b['bf16'])} in bf16, {_bytes(b['mxfp4'])} in MXFP4 "
                     "(4-bit values + an 8-bit scale per 32, as released)")
    c = rep["cache"]
    lines += [
        "  decode cache per sequence:",
        f"    KDA state ({c['kda_layers']} layers, fp32 state + bf16 conv)  {_bytes(c['kda_bytes_per_sequence'])}"
        " (constant)",
        f"    MLA latent ({c['mla_layers']} layers, bf16)  {_bytes(c['mla_bytes_per_token'])} per token",
        f"    at {c['context_tokens']:,} tokens: {_bytes(c['bytes_per_sequence_at_context'])}"
        f" (MLA {_bytes(c['mla_bytes_per_sequence_at_context'])}, KDA {_bytes(c['kda_bytes_per_sequence'])}),"
        f" {_bytes(c['bytes_per_token_at_context'])} per token",
    ]
    return "\n".join(lines)


def run_info(args: argparse.Namespace) -> int:
    try:
        cfg = get_preset(args.preset)
    except ValueError as e:
        print(f"openk3 info: error: {e}", file=sys.stderr)
        return 2
    rep = info_report(cfg, args.context)
    print(format_report(rep))
    if args.json:
        print(json.dumps(rep))
    return 0


def add_info_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "info", help="parameter counts and decode-cache sizes of a preset (built on the meta device)",
        description="Print total / activated parameters, a per-component breakdown and the decode-cache size.",
        formatter_class=ShowDefaults,
    )
    p.add_argument("--preset", default="k3-tiny", help=f"model preset: {', '.join(sorted(PRESETS))}")
    p.add_argument("--json", action="store_true", help="also print the report as JSON on the last line")
    p.add_argument("--context", type=int_at_least(1), default=1 << 20,
                   help="context length (tokens) for the per-sequence cache size")
    p.set_defaults(func=run_info)
    return p
