"""`openk3 generate`: text from a trained checkpoint with the incremental decode cache.

The prompt is prefilled once into `model.new_cache(1)`; every new token is one forward of a single position that
appends to the cache (KDA states and MLA latents), so each step costs the same however long the text grows.
Sampling (greedy / temperature / top-k / top-p, seeded) is `openk3.sampling.sample_token`, as in serving.
`--speculative K` (a checkpoint of `openk3 draft`): the draft proposes K tokens and the target verifies them in one
forward of K + 1 positions, with the target's distribution kept exactly (`openk3.draft.speculative`).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from openk3.checkpoints import resolve_checkpoint
from openk3.cli_options import add_kda_options, int_at_least
from openk3.sampling import SamplingParams, request_rng, sample_token


@torch.no_grad()
def generate_ids(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids: set[int] | frozenset = frozenset(), device: torch.device | str = "cpu") -> list[int]:
    """New token ids after `prompt_ids` (stops early at a stop id, which is not returned)."""
    if not prompt_ids:
        raise ValueError("the prompt must have at least one token")
    was_training = model.training
    model.eval()
    rng = request_rng(params.seed)
    cache = model.new_cache(1)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, logits_to_keep=1).logits[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = sample_token(logits, params, rng)
        if token in stop_ids:
            break
        out.append(token)
        logits = model(torch.tensor([[token]], device=device), cache=cache, logits_to_keep=1).logits[0, -1]
    model.train(was_training)
    return out


def run_generate(args: argparse.Namespace) -> int:
    from openk3.interop import load_pretrained
    from openk3.model import configure_kda
    from openk3.tokenizer import TextTokenizer

    ckpt = resolve_checkpoint(args.ckpt)
    if args.tokenizer is None and not (ckpt / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{ckpt} has no tokenizer.json; pass --tokenizer PATH")
    tok = TextTokenizer.from_file(args.tokenizer or ckpt / "tokenizer.json")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=50, help="0 = no top-k cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's)")
    p.add_argument("--speculative", type=int_at_least(0), default=0, metavar="K",
                   help="speculative decoding with the checkpoint's draft (`openk3 draft`): K drafted tokens per "
                        "verification, the target's distribution kept exactly (default: 0, off)")
    add_kda_options(p)
    p.set_defaults(func=run_generate)
