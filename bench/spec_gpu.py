"""Speculative decoding in the GPU engine (issue 15): k3-debug with its MTP layer fitted as an EAGLE-style draft to
the target's own distribution; decode tokens/s with `speculative` K against without, at 1 and 32 clients.

    python bench/spec_gpu.py [--preset k3-debug] [--k 3] [--fit-steps 300] [--clients 1 32] [--new-tokens 128]
                             [--compile-prefill] [--smoke] [--json bench/spec_gpu.json]

1. The target: the preset with random weights. A random target's text has no structure of its own, so the draft
   (`openk3.draft.EagleDraft` on the target's MTP layer) is fitted to what acceptance measures, the target's
   distribution: --fit-steps steps of the LK loss over 3 unrolled steps (`openk3.train.draft.draft_losses`, fp32
   weights under bf16 autocast) on windows the target sampled itself (the engine, temperature 1, 16-token random
   prompts), fresh windows every 50 steps.
2. Held-out alpha (the mean of sum_x min(p, q) per unrolled step) on windows sampled apart.
3. Two engines in bf16 as `openk3 serve` runs them (one without speculation: compiled decode in CUDA graphs; one
   with speculative K: the compiled verification of K + 1 positions and the draft passes in CUDA graphs), each
   started once for the largest client count, with C requests of --new-tokens tokens each from 16-token prompts,
   at temperature 1 (speculation keeps the target's distribution exactly) and greedy: generated tokens per second
   of wall time, and accepted drafts per verification; then the verification step against K + 1 decode steps.
Prints a table and writes JSON. `--smoke`: k3-tiny on the CPU, a few steps, to check the script.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from openk3.config import get_preset
from openk3.draft import EagleDraft
from openk3.model import K3ForCausalLM
from openk3.model.moe import decisive_routing
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import ByteTokenizer
from openk3.train.draft import draft_losses

PROMPT_TOKENS = 16


def engine_for(model, draft, k: int, clients: int, compile_decode: bool, compile_prefill: bool) -> Engine:
    config = EngineConfig(prefix_cache=False, speculative=k, compile_decode=compile_decode,
                          compile_prefill=compile_prefill,
                          scheduler=SchedulerConfig(max_running=max(clients, 2)))
    started = time.perf_counter()
    engine = Engine(model, ByteTokenizer(), config, draft=draft if k else None)
    print(f"engine with K={k} started in {time.perf_counter() - started:.0f} s (graphs: "
          f"{engine.runner.captured() or engine.runner.graph_error})", flush=True)
    return engine


def generate(engine: Engine, clients: int, new_tokens: int, seed: int, temperature: float = 1.0,
             ) -> tuple[list[list[int]], float]:
    """`clients` requests at once (random prompts inside the tokenizer's ids, at `temperature`): each one's prompt +
    output, and the wall seconds until all finished."""
    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True, seed=seed * 1000 + i)
              for i in range(clients)]
    prompts = torch.randint(0, engine.vocab_limit, (clients, PROMPT_TOKENS), generator=gen).tolist()
    start = time.perf_counter()
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    return [r.prompt + r.output for r in requests], time.perf_counter() - start


def verify_vs_decode(engine: Engine, batch: int = 3, prompt: int = 40) -> dict:
    """The engine's verification step against K + 1 of its plain decode steps on the same tokens after the same
    prompts (each as captured), with decisive routing (a random router's near-ties flip experts between two
    correct bf16 runs: `openk3.model.moe.decisive_routing`): max |logits difference| / max |logits| and the share
    of argmaxes that agree."""
    with decisive_routing(engine.model):
        return _verify_vs_decode(engine, batch, prompt)


def _verify_vs_decode(engine: Engine, batch: int, prompt: int) -> dict:
    runner, K, V = engine.runner, engine.config.speculative, engine.vocab_limit
    gen = torch.Generator().manual_seed(5)
    slots = [engine.states.alloc() for _ in range(batch)]
    for slot in slots:
        engine.tables.set(slot, [engine.pages.alloc() for _ in range(-(-(prompt + K + 1) // engine.page_size))])
    with torch.no_grad():
        for slot in slots:
            runner.prefill([torch.randint(0, V, (prompt,), generator=gen).tolist()], [slot], [0])
        rows = torch.randint(0, V, (batch, K + 1), generator=gen).tolist()
        saved = engine.states.conv[:, slots].clone(), engine.states.recurrent[:, slots].clone()
        got = runner.verify(rows, slots, [prompt] * batch)[0].float().clone()
        engine.states.conv[:, slots], engine.states.recurrent[:, slots] = saved  # (the latents are rewritten alike)
        want = torch.stack([runner.decode([r[t] for r in rows], slots, [prompt + t] * batch).float().clone()
                            for t in range(K + 1)], dim=1)
    for slot in slots:
        for pid in engine.tables.clear(slot):
            engine.pages.release(pid)
        engine.states.free(slot)
    return {"max_rel_diff": ((got - want).abs().max() / want.abs().max()).item(),
            "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


def fit_draft(model, draft, sampler: Engine, args, device) -> list[float]:
    """The draft's LK fit on windows the target sampled (fresh ones every 50 steps); the losses per step."""
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-3)
    losses, windows = [], None
    for step in range(args.fit_steps):
        if step % 50 == 0:
            with torch.no_grad():
                windows = torch.tensor(generate(sampler, args.fit_batch, args.new_tokens, seed=step)[0], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = draft_losses(model, draft, windows, "lk", steps=args.k)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="target preset (default k3-debug; k3-tiny with --smoke)")
    ap.add_argument("--k", type=int, default=3, help="drafted tokens per verification")
    ap.add_argument("--fit-steps", type=int, default=None, help="draft fitting steps (default 300; 4 with --smoke)")
    ap.add_argument("--fit-batch", type=int, default=16, help="sampled windows per fitting step")
    ap.add_argument("--clients", type=int, nargs="+", default=None, help="concurrent requests (default 1 32)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 128; 8 with --smoke)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0],
                    help="sampling temperatures of the timed requests (0: greedy; default 1 0)")
    ap.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU, a few steps")
    ap.add_argument("--compile-prefill", action="store_true",
                    help="the engines compile the units that the verification forward runs (EngineConfig)")
    ap.add_argument("--no-compile", action="store_true",
                    help="the engines' steps uncompiled (still in CUDA graphs): each engine starts in well under a "
                         "minute instead of ~3")
    ap.add_argument("--json", default="bench/spec_gpu.json")
    args = ap.parse_args()
    for key, full, small in (("preset", "k3-debug", "k3-tiny"), ("fit_steps", 300, 4), ("clients", [1, 32], [1, 4]),
                             ("new_tokens", 128, 8)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.smoke else full)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/spec_gpu.py: needs a CUDA GPU (torch sees none); --smoke runs it on the CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    gpu = device.type == "cuda"
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(args.preset)).to(device).eval()
    model.requires_grad_(False)
    draft = EagleDraft(model)
    draft.train()
    for p in draft.trainable_parameters():
        p.requires_grad_(True)
    started = time.perf_counter()
    # sampling windows for the fit: an fp32 engine without speculation, no compile (a few dozen steps)
    sampler = Engine(model, ByteTokenizer(), EngineConfig(prefix_cache=False, compile_decode=False,
                                                          scheduler=SchedulerConfig(max_running=args.fit_batch)))
    losses = fit_draft(model, draft, sampler, args, device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
        held_out = torch.tensor(generate(sampler, args.fit_batch, args.new_tokens, seed=99_999)[0], device=device)
        _, alphas = draft_losses(model, draft, held_out, "lk", steps=args.k)
    del sampler
    fit_s = time.perf_counter() - started
    print(f"draft fitted in {fit_s:.0f} s: LK loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out alpha per "
          f"unrolled step {[round(a, 3) for a in alphas]}", flush=True)

    draft.eval()
    if gpu:
        model.to(torch.bfloat16)
        draft.to(torch.bfloat16)
    rows = [{"clients": clients, "temperature": t} for t in args.temperatures for clients in args.clients]
    checks = {}
    for k in (0, args.k):
        engine = engine_for(model, draft, k, max(args.clients), gpu and not args.no_compile, args.compile_prefill)
        for row in rows:
            clients, temperature = row["clients"], row["temperature"]
            generate(engine, clients, args.new_tokens, 1, temperature)  # warm-up: the allocator, this batch's shapes
            before = (engine.metrics.spec_drafts, engine.metrics.spec_accepted_tokens)
            outputs, seconds = generate(engine, clients, args.new_tokens, 2, temperature)
            tokens = sum(len(o) - PROMPT_TOKENS for o in outputs)
            row[f"tok_per_s_k{k}"] = tokens / seconds
            if k:
                rounds = engine.metrics.spec_drafts - before[0]
                row["accepted_per_verification"] = (engine.metrics.spec_accepted_tokens - before[1]) / max(1, rounds)
            print(f"K={k}, {clients} clients, temperature {temperature:g}: {tokens / seconds:,.0f} tok/s", flush=True)
        if k:
            checks = verify_vs_decode(engine)
            print(f"verification vs {k + 1} decode steps: {checks}", flush=True)
        del engine
    for row in rows:
        row["speedup"] = row[f"tok_per_s_k{args.k}"] / row["tok_per_s_k0"]
    print(f"\n| clients | temperature | tok/s | tok/s, K={args.k} | speedup | accepted per verification |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['temperature']:g} | {r['tok_per_s_k0']:,.0f} | {r[f'tok_per_s_k{args.k}']:,.0f} "
              f"| {r['speedup']:.2f}x | {r['accepted_per_verification']:.2f} |")
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "preset": args.preset, "k": args.k, "new_tokens": args.new_tokens,
              "fit": {"steps": args.fit_steps, "seconds": fit_s, "loss_first": losses[0], "loss_last": losses[-1],
                      "alpha_held_out": alphas},
              "compile_prefill": args.compile_prefill, "compile_decode": gpu and not args.no_compile, "rows": rows,
              "verify_vs_decode": checks, "smoke": args.smoke}
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
