"""`openk3 generate`: text from a trained checkpoint with the incremental decode cache.

The decode loop is `openk3.generation.generate_ids` (shared with training's end-of-run sample): the prompt is
prefilled once into the model's cache, then one forward per new token.
`--speculative K` (a checkpoint of `openk3 draft`): the draft proposes K tokens and the target verifies them in one
forward of K + 1 positions, with the target's distribution kept exactly (`openk3.draft.speculative`).
"""

from __future__ import annotations

import argparse
import sys

import torch

from openk3.checkpoints import resolve_checkpoint
from openk3.cli_options import add_kda_options, cpu_threads, int_at_least
from openk3.generation import generate_ids
from openk3.sampling import SamplingParams


def run_generate(args: argparse.Namespace) -> int:
    from openk3.interop import load_pretrained
    from openk3.model import configure_kda
    from openk3.tokenizer import TextTokenizer

    ckpt = resolve_checkpoint(args.ckpt)
    if args.tokenizer is None and not (ckpt / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{ckpt} has no tokenizer.json; pass --tokenizer PATH")
    tok = TextTokenizer.from_file(args.tokenizer or ckpt / "tokenizer.json")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(args.threads))
    model = load_pretrained(ckpt).to(device)
    configure_kda(model, backend=args.kda_backend)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompt = tok.encode(args.prompt)
    if args.speculative:
        from openk3.draft import SpeculationStats, load_draft, speculative_generate

        stats = SpeculationStats()
        ids = speculative_generate(model, load_draft(model, ckpt), prompt, args.max_new_tokens, params,
                                   args.speculative, {tok.eos_id}, device, stats)
    else:
        ids = generate_ids(model, prompt, args.max_new_tokens, params, {tok.eos_id}, device)
    print(args.prompt + tok.decode(ids))
    if args.speculative and stats.rounds:
        print(f"speculative decoding: {stats.accepted} of {stats.drafted} drafted tokens accepted in "
              f"{stats.rounds} verifications (acceptance length {stats.accept_len:.2f})", file=sys.stderr)
    return 0


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="sample text from a trained checkpoint",
                              description="Sample text from a checkpoint (a step-NNNNNN/ directory, or a run "
                                          "directory: its latest checkpoint) with the incremental decode cache.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory or training --out directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=50, help="0 = no top-k cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--threads", type=int_at_least(0), default=0,
                   help="torch threads on CPU (0: auto: all cores, or 1 when the machine is already busy)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's)")
    p.add_argument("--speculative", type=int_at_least(0), default=0, metavar="K",
                   help="speculative decoding with the checkpoint's draft (`openk3 draft`): K drafted tokens per "
                        "verification, the target's distribution kept exactly (default: 0, off)")
    add_kda_options(p)
    p.set_defaults(func=run_generate)
