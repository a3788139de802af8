"""Where a k3 training step goes on a GPU, unit by unit, beside the dense baseline of bench/train.py.

  python bench/train_parts.py [--preset k3-debug --batch-size 8 --seq-len 4096 --reps 5]

CUDA only. Each unit of the k3 model (a KDA token mixer, an MLA token mixer, a MoE FFN, the dense FFN of layer 0,
an RMSNorm, the fused LM head + cross-entropy) runs forward + backward alone
under bf16 autocast, on the inputs it receives in the model (captured from one forward of a real batch) and a
random output gradient, eagerly and then compiled the way `compile_blocks` compiles it; the dense model's block
and loss likewise. Each unit's time times its count per step, summed, against the whole step (eager, and with
`compile_blocks`): what is left is the glue between the units (the Block AttnRes stream, autograd's gradient
sums, the embedding) and the optimizer. Also the whole step with the whole model under one torch.compile (graph
breaks at the KDA kernels), to measure what fusing across the units gives. --profile N lists the N heaviest
kernels of one compiled step; --ablate times the compiled step without Block AttnRes and without the MTP layer
(what each costs). Prints Markdown tables and writes bench/train_parts.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import traceback
from pathlib import Path

import torch
from torch import nn

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.model.compile import compile_blocks
from openk3.ops.loss import linear_cross_entropy
from openk3.train.optim import build_optimizer

HERE = Path(__file__).parent
# what the step costs without a component: plain pre-norm residuals instead of Block AttnRes, no MTP layer
ABLATIONS = {"no AttnRes": {"attn_res_block_size": None}, "no MTP": {"mtp_layers": 0}}


def _load_train_bench():
    spec = importlib.util.spec_from_file_location("bench_train", HERE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_bench = _load_train_bench()


def capture_inputs(model: nn.Module, units: dict[str, nn.Module], ids: torch.Tensor) -> dict[str, tuple]:
    """The positional inputs each unit receives in one forward of `ids` (its first call), detached copies."""
    seen: dict[str, tuple] = {}
    hooks = []
    for name, unit in units.items():
        def grab(module, args, name=name):
            if name not in seen:
                seen[name] = tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args)
        hooks.append(unit.register_forward_pre_hook(grab))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(ids, return_logits=False)
    for h in hooks:
        h.remove()
    return seen


def fwd_bwd_ms(fn, inputs: tuple, params: list[nn.Parameter], reps: int, warmup: int = 3) -> float:
    """Forward + backward of fn(*inputs) under bf16 autocast, with a fixed random output gradient (ms per call)."""
    leaves = tuple(x.requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fn(*leaves)
    grad = torch.randn_like(out) * 1e-3 if out.dim() else None

    def run():
        for p in params:
            p.grad = None
        for x in leaves:
            if torch.is_tensor(x):
                x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(*leaves)
        y.backward(grad)

    return train_bench.time_steps(run, reps, warmup)[0] * 1e3


def k3_units(model: K3ForCausalLM) -> tuple[dict[str, nn.Module], dict[str, int]]:
    """One representative of each kind of unit, and how many of that kind one training step runs."""
    layers = list(model.model.layers)
    kda = [l for l in layers if l.attn_kind == "kda"]
    mla = [l for l in layers if l.attn_kind == "mla"] + [m.block for m in model.mtp or []]
    moe = [l for l in layers if l.ffn_kind == "moe"] + [m.block for m in model.mtp or [] if m.block.ffn_kind == "moe"]
    dense = [l for l in layers if l.ffn_kind == "dense"]
    mtp = len(model.mtp or [])
    norms = 2 * (len(layers) + mtp) + 3 * mtp + 1  # two per decoder layer; each MTP layer's enorm, hnorm, norm; final
    units = {"KDA token mixer": kda[0].self_attn, "MLA token mixer": mla[0].self_attn, "MoE FFN": moe[0].mlp}
    counts = {"KDA token mixer": len(kda), "MLA token mixer": len(mla), "MoE FFN": len(moe)}
    if dense:
        units["dense FFN"], counts["dense FFN"] = dense[0].mlp, len(dense)
    units["RMSNorm (hidden)"], counts["RMSNorm (hidden)"] = kda[0].input_layernorm, norms
    return units, counts


def measure_units(units: dict[str, nn.Module], inputs: dict[str, tuple], reps: int) -> dict[str, dict]:
    rows = {}
    for name, unit in units.items():
        args = inputs[name]
        params = list(unit.parameters())
        row = {"eager_ms": fwd_bwd_ms(unit, args, params, reps)}
        unit.compile()
        try:
            row["compiled_ms"] = fwd_bwd_ms(unit, args, params, reps)
        except Exception as e:  # keep the other rows
            row["compiled_error"] = train_bench.error_summary(e)
            traceback.print_exc()
        unit._compiled_call_impl = None
        rows[name] = row
        print(f"{name}: {row}")
    return rows


def loss_ms(head_inputs: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, reps: int) -> float:
    return fwd_bwd_ms(lambda h: linear_cross_entropy(h.flatten(0, 1), head, targets.flatten()), (head_inputs,),
                      [head], reps)


def measure_parts(cfg, ids: torch.Tensor, args: argparse.Namespace) -> tuple[dict, dict, dict, dict]:
    """(k3 unit rows, their counts per step, the dense model's rows, their counts)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).cuda()
    units, counts = k3_units(model)
    inputs = capture_inputs(model, units, ids[:, :-1])
    parts = measure_units(units, inputs, args.reps)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(ids[:, :-1], return_logits=False)
    parts["LM head + CE"] = {"eager_ms": loss_ms(out.head_inputs, model.lm_head.weight, ids[:, 1:], args.reps)}
    counts["LM head + CE"] = 1 + cfg.mtp_layers  # the MTP loss on T-1 positions: counted as a whole one
    del model, out
    train_bench.free_gpu()
    dense_parts, dense_counts = measure_dense(cfg, ids, args.reps)
    train_bench.free_gpu()
    return parts, counts, dense_parts, dense_counts


def measure_dense(cfg, ids: torch.Tensor, reps: int) -> tuple[dict[str, dict], dict[str, int]]:
    """The dense baseline's block and its plain LM head + cross-entropy, forward + backward."""
    dense, _ = train_bench.dense_like(cfg)
    dense = dense.cuda()
    B, T = ids.shape[0], ids.shape[1] - 1
    h = torch.randn(B, T, cfg.hidden_size, device="cuda")
    block, head = dense.blocks[0], dense.head
    parts = {"dense block": {"eager_ms": fwd_bwd_ms(block, (h,), list(block.parameters()), reps)}}
    parts["LM head + CE (plain)"] = {"eager_ms": fwd_bwd_ms(
        lambda x: torch.nn.functional.cross_entropy(head(x).flatten(0, 1).float(), ids[:, 1:].flatten()),
        (h,), [head.weight], reps)}
    return parts, {"dense block": len(dense.blocks), "LM head + CE (plain)": 1}


def step_ms(cfg, variant: str, batch, reps: int, profile_kernels: int = 0) -> dict:
    """The whole AdamW step: eager, compile_blocks, or the whole model under one torch.compile; with
    profile_kernels, also the top kernels of one profiled step (name, ms, share, calls)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).cuda()
    if variant == "compile_blocks":
        compile_blocks(model)
    elif variant == "compile_model":
        model.compile()
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, optimizer="adamw")
    torch.cuda.reset_peak_memory_stats()
    try:
        step = train_bench.k3_train_step(model, opt, batch)
        seconds, warmup_s = train_bench.time_steps(step, reps, 3)
        row = {"step_ms": seconds * 1e3, "warmup_s": warmup_s, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        if profile_kernels:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            row["top_kernels"] = train_bench.top_kernels(prof, rows=profile_kernels)
    except Exception as e:
        row = {"error": train_bench.error_summary(e)}
        traceback.print_exc()
    print(f"step {variant}: {row}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k3-debug")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", default="eager,compile_blocks,compile_model",
                        help="whole-step variants to time, comma-separated (empty: none)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list the N kernels with the most time in one profiled compile_blocks step")
    parser.add_argument("--steps-only", action="store_true", help="time the whole steps only, not the units")
    parser.add_argument("--ablate", action="store_true",
                        help="also time compile_blocks steps of the model without Block AttnRes and without MTP")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_parts.py needs a CUDA device")
    cfg = get_preset(args.preset)
    B, T = args.batch_size, args.seq_len

    def batch() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (B, T + 1), device="cuda")

    no_parts = ({}, {}, {}, {})
    parts, counts, dense_parts, dense_counts = no_parts if args.steps_only else measure_parts(cfg, batch(), args)

    steps = {}
    for variant in filter(None, args.steps.split(",")):
        steps[variant] = step_ms(cfg, variant, batch, args.reps, args.profile if variant == "compile_blocks" else 0)
        train_bench.free_gpu()
    for name, override in ABLATIONS.items() if args.ablate else ():
        steps[f"compile_blocks, {name}"] = step_ms(cfg.with_overrides(override), "compile_blocks", batch, args.reps)
        train_bench.free_gpu()

    def summed(rows, counts_, key):
        return sum(counts_[n] * r.get(key, r["eager_ms"]) for n, r in rows.items())

    print(f"\n{cfg.name}, batch {B} x {T}, bf16 autocast, forward + backward per call ({args.reps} reps)\n")
    print("| unit | calls per step | eager (ms) | compiled (ms) | eager x calls | compiled x calls |\n"
          "|---|---|---|---|---|---|")
    for rows, counts_ in ((parts, counts), (dense_parts, dense_counts)):
        for n, r in rows.items():
            c = r.get("compiled_ms", r["eager_ms"])
            print(f"| {n} | {counts_[n]} | {r['eager_ms']:.2f} | {c:.2f} | {counts_[n] * r['eager_ms']:.1f} | "
                  f"{counts_[n] * c:.1f} |")
    k3_eager, k3_compiled = summed(parts, counts, "eager_ms"), summed(parts, counts, "compiled_ms")
    dense_sum = summed(dense_parts, dense_counts, "eager_ms")
    print(f"\nsum of the k3 units: eager {k3_eager:.1f} ms, compiled {k3_compiled:.1f} ms; dense: {dense_sum:.1f} ms")
    for variant, row in steps.items():
        print(f"whole step, {variant}: " + str({k: v for k, v in row.items() if k != "top_kernels"}))
        if "top_kernels" in row:
            print("\n| kernel | ms | share | calls |\n|---|---|---|---|")
            for k in row["top_kernels"]:
                print(f"| {k['kernel'][:100]} | {k['ms']:.2f} | {k['share']:.1%} | {k['calls']} |")
    (HERE / "train_parts.json").write_text(json.dumps(
        {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": cfg.name, "batch": B,
                 "seq_len": T, "reps": args.reps},
         "k3_units": parts, "k3_counts": counts, "dense_units": dense_parts, "dense_counts": dense_counts,
         "k3_units_sum_ms": {"eager": k3_eager, "compiled": k3_compiled}, "dense_units_sum_ms": dense_sum,
         "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
