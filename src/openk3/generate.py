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
from openk3.cli_options import (
    ShowDefaults,
    add_kda_options,
    check_triton,
    cpu_threads,
    float_in,
    int_at_least,
    resolve_device,
)
from openk3.generation import generate_ids
from openk3.sampling import SamplingParams


def check_context(prompt_tokens: int, new_tokens: int, context: int) -> None:
    """Refuse what the server refuses: an empty prompt, one that fills the model's context (the server's 413), or a
    reply that could run past it (its 400)."""
    if not prompt_tokens:
        raise ValueError("--prompt is empty: give at least one character to continue")
    if prompt_tokens >= context:
        raise ValueError(f"--prompt has {prompt_tokens} tokens; the model's context holds {context}")
    if prompt_tokens + new_tokens > context:
        raise ValueError(f"--max-new-tokens {new_tokens} and the prompt's {prompt_tokens} tokens exceed the model's "
                         f"context of {context} tokens: at most {context - prompt_tokens} can follow this prompt")


def run_generate(args: argparse.Namespace) -> int:
    from openk3.interop import config_from_json, load_pretrained
    from openk3.interop.files import read_config
    from openk3.model import configure_kda
    from openk3.tokenizer import TextTokenizer

    device = resolve_device(args.device)
    check_triton(device, "--kda-backend", args.kda_backend)
    ckpt = resolve_checkpoint(args.ckpt)
    if args.tokenizer is None and not (ckpt / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{ckpt} has no tokenizer.json; pass --tokenizer PATH")
    tok = TextTokenizer.from_file(args.tokenizer or ckpt / "tokenizer.json")
    prompt = tok.encode(args.prompt)
    cfg = config_from_json(read_config(ckpt))[0]
    if tok.vocab_size > cfg.vocab_size:  # its ids past the embedding table would fail inside the model
        raise ValueError(f"the tokenizer ({args.tokenizer or ckpt / 'tokenizer.json'}) has {tok.vocab_size} ids, "
                         f"the model's vocabulary {cfg.vocab_size}: pass the tokenizer it was trained with")
    check_context(len(prompt), args.max_new_tokens, cfg.max_seq_len)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(args.threads))
    model = load_pretrained(ckpt).to(device)
    configure_kda(model, backend=args.kda_backend)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
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
    p = subparsers.add_parser("generate", help="sample text from a trained checkpoint", formatter_class=ShowDefaults,
                              description="Sample text from a checkpoint (a step-NNNNNN/ directory, or a run "
                                          "directory: its latest checkpoint) with the incremental decode cache.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory or training --out directory")
    p.add_argument("--prompt", required=True,
                   help="the text to continue (control tokens such as <|im_start|> written in it are read as such); "
                        "with the reply it must fit the model's context")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=200, help="tokens to sample at most")
    p.add_argument("--temperature", type=float_in(0), default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float_in(0, 1, open_low=True), default=0.95,
                   help="nucleus sampling: the smallest set of tokens holding this much probability")
    p.add_argument("--top-k", type=int_at_least(0), default=50, help="0 = no top-k cut")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--threads", type=int_at_least(0), default=0,
                   help="torch threads on CPU (0: auto: all cores, or 1 when the machine is already busy)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's)")
    p.add_argument("--speculative", type=int_at_least(0), default=0, metavar="K",
                   help="speculative decoding with the checkpoint's draft (`openk3 draft`): K drafted tokens per "
                        "verification, the target's distribution kept exactly (default: 0, off)")
    add_kda_options(p)
    p.set_defaults(func=run_generate)
