"""Training-step benchmarks.

  python bench/train.py gpu   [--steps 20 --warmup 5 --batch-size 8 --seq-len 4096 --peak-tflops 989] [--profile]
      CUDA only. k3-debug in bf16 autocast (MTP weight 0.3) without and with activation checkpointing, beside a
      dense pre-norm transformer (torch SDPA causal attention, SwiGLU) with the same active parameter count, all
      with AdamW so the models are compared, plus k3-debug with per-head Muon for the optimizer's cost; one run.
      Reports tokens/s, model FLOP utilisation and torch.cuda.max_memory_allocated per configuration.
      --profile: one k3-debug AdamW step under torch.profiler instead, the top operators by GPU time.
  python bench/train.py cpu   [--steps 3 --batch-size 2 --seq-len 256 --threads N]
      One training step (forward + backward + loss) of a small Kimi Linear-shaped model in openk3 beside HF
      transformers' KimiLinearForCausalLM holding the same weights (written by openk3.interop in the hub layout,
      read by transformers' from_pretrained; its pure-PyTorch KDA path). Checks the logits agree first.

Each prints a Markdown table and writes bench/train_<mode>.json.

Model FLOPs per token (for MFU), counted for forward + backward (x3 of forward):
  6 * (active matmul parameters: everything except the embedding table, with routed experts counted top_k /
       num_experts, and the LM head counted once more per MTP layer, which reuses it)
  + softmax attention (MLA layers, the dense model's layers): 6 * T/2 * H * (d_qk + d_v) per token per layer
    (causal: on average T/2 keys)
  + KDA recurrence: 6 * H * 2 * d_k * d_v per token per layer (state read-out and rank-1 update)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import ModelConfig, get_preset
from openk3.info import count_parameters
from openk3.model import K3ForCausalLM
from openk3.train.loop import enable_activation_checkpointing, lm_losses
from openk3.train.optim import build_optimizer

HERE = Path(__file__).parent


# ---- a dense baseline of the same active size ------------------------------------------------------------------

class DenseBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.gate_up, self.down = nn.Linear(dim, 2 * ffn, bias=False), nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(o.transpose(1, 2).reshape(B, T, D))
        gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DenseLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(DenseBlock(dim, heads, ffn) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.heads = heads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def dense_like(cfg: ModelConfig) -> tuple[DenseLM, dict]:
    """A dense LM with k3-debug's width, depth, heads and vocab whose FFN width matches the active parameters."""
    counts = count_parameters(cfg)
    active = counts["active_params"] + counts["mtp_active_params"]
    D, L, H = cfg.hidden_size, cfg.num_layers, cfg.kda.num_heads
    embed_and_head = 2 * cfg.vocab_size * D
    per_layer = (active - embed_and_head) / L
    ffn = max(128, round((per_layer - 4 * D * D) / (3 * D) / 128) * 128)
    return DenseLM(cfg.vocab_size, D, L, H, ffn), {"ffn": ffn, "target_active": active}


# ---- FLOPs ------------------------------------------------------------------------------------------------------

def k3_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    counts = count_parameters(cfg)
    matmul = counts["active_params"] + counts["mtp_active_params"] - cfg.vocab_size * cfg.hidden_size
    matmul += cfg.mtp_layers * cfg.vocab_size * cfg.hidden_size  # the shared LM head runs once more per MTP layer
    m = cfg.mla
    mla_layers = len(cfg.mla_layers) + cfg.mtp_layers
    attn = 6 * (seq_len / 2) * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * mla_layers
    K = cfg.kda_head_dim
    kda = 6 * cfg.kda.num_heads * 2 * K * K * len(cfg.kda_layers)
    return 6 * matmul + attn + kda


def dense_flops_per_token(model: DenseLM, seq_len: int) -> float:
    matmul = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed"))
    dim = model.embed.weight.shape[1]
    return 6 * matmul + 6 * (seq_len / 2) * 2 * dim * len(model.blocks)


# ---- GPU --------------------------------------------------------------------------------------------------------

def time_steps(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / steps


def k3_train_step(model, opt, batch):
    """One bf16-autocast training step of the k3 model on a fresh batch (LM + MTP loss)."""

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _, _ = lm_losses(model, batch(), mtp_weight=0.3)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def k3_result(cfg: ModelConfig, checkpointing: bool, optimizer: str, args: argparse.Namespace, batch) -> dict:
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to("cuda")
    if checkpointing:
        enable_activation_checkpointing(model)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, optimizer=optimizer)

    k3_step = k3_train_step(model, opt, batch)
    torch.cuda.reset_peak_memory_stats()
    seconds = time_steps(k3_step, args.steps, args.warmup)
    tokens = args.batch_size * args.seq_len
    flops = k3_flops_per_token(cfg, args.seq_len) * tokens / seconds
    return {"model": "k3-debug" + (" + act. ckpt" if checkpointing else ""), "optimizer": optimizer,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds, "mfu": flops / (args.peak_tflops * 1e12),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}


def profile_k3_step(cfg: ModelConfig, batch, rows: int = 30) -> None:
    """Where a k3-debug training step spends GPU time: torch.profiler's operators, sorted by their total."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to("cuda")
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, optimizer="adamw")

    step = k3_train_step(model, opt, batch)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))


def gpu(args: argparse.Namespace) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench/train.py gpu needs a CUDA device")
    device = torch.device("cuda")
    cfg = get_preset("k3-debug")
    tokens = args.batch_size * args.seq_len
    results = []

    def batch() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device)

    if args.profile:
        profile_k3_step(cfg, batch)
        return results

    for checkpointing, optimizer in ((False, "adamw"), (True, "adamw"), (False, "muon")):
        results.append(k3_result(cfg, checkpointing, optimizer, args, batch))
        torch.cuda.empty_cache()

    torch.manual_seed(0)
    dense, meta = dense_like(cfg)
    dense = dense.to(device)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def dense_step():
        ids = batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = dense(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        dense_opt.step()
        dense_opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    seconds = time_steps(dense_step, args.steps, args.warmup)
    flops = dense_flops_per_token(dense, args.seq_len) * tokens / seconds
    results.append({"model": f"dense SDPA (ffn {meta['ffn']}, same active params)", "optimizer": "adamw",
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds, "mfu": flops / (args.peak_tflops * 1e12),
                    "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch_size,
           "seq_len": args.seq_len, "peak_tflops": args.peak_tflops}
    (HERE / "train_gpu.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(f"{env}\n\n| model | optimizer | step (ms) | tokens/s | MFU | peak memory (GiB) |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['optimizer']} | {r['seconds'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} "
              f"| {r['mfu']:.1%} | {r['peak_mem_gib']:.2f} |")
    return results


# ---- CPU: openk3 vs HF transformers ----------------------------------------------------------------------------

KIMI_SMALL = {
    "vocab_size": 4096, "hidden_size": 256, "num_layers": 4, "mla_layers": [3],
    "kda": {"num_heads": 4, "head_dim": 64},
    "mla": {"num_heads": 4, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32},
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 128, "num_shared_experts": 1},
    "dense_hidden": 512, "max_seq_len": 4096,
}


def time_cpu_step(model: nn.Module, ids: torch.Tensor, steps: int) -> float:
    def step():
        logits = model(ids[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    best = math.inf
    for _ in range(steps):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def cpu(args: argparse.Namespace) -> dict:
    import transformers

    from openk3.interop import save_pretrained

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = get_preset("kimi-linear-48b").with_overrides(KIMI_SMALL)
    torch.manual_seed(0)
    ours = K3ForCausalLM(cfg).train()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp, layout="hub")
        theirs = transformers.KimiLinearForCausalLM.from_pretrained(tmp, dtype=torch.float32).train()
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=torch.Generator()
                        .manual_seed(1))
    with torch.no_grad():
        a = ours(ids[:, :-1]).logits
        b = theirs(ids[:, :-1]).logits
    rel = float((a - b).norm() / b.norm())
    if rel > 1e-3:
        raise SystemExit(f"openk3 and transformers disagree on the same weights (relative error {rel:.2e})")
    tokens = args.batch_size * args.seq_len
    t_ours = time_cpu_step(ours, ids, steps=args.steps)
    t_theirs = time_cpu_step(theirs, ids, steps=args.steps)
    result = {"env": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "batch": args.batch_size, "seq_len": args.seq_len,
                      "params": sum(p.numel() for p in ours.parameters())},
              "logits_rel_err": rel,
              "openk3": {"step_s": t_ours, "tokens_per_s": tokens / t_ours},
              "transformers": {"step_s": t_theirs, "tokens_per_s": tokens / t_theirs},
              "speedup": t_theirs / t_ours}
    (HERE / "train_cpu.json").write_text(json.dumps(result, indent=1))
    print(f"{result['env']}\nlogits relative error {rel:.1e}\n\n| implementation | train step (s, best of "
          f"{args.steps}) | tokens/s |\n|---|---|---|")
    print(f"| openk3 (chunked KDA) | {t_ours:.3f} | {tokens / t_ours:,.0f} |")
    print(f"| transformers KimiLinearForCausalLM | {t_theirs:.3f} | {tokens / t_theirs:,.0f} |")
    print(f"\nopenk3 is {result['speedup']:.1f}x faster")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="training-step benchmarks (see the module docstring)")
    sub = parser.add_subparsers(dest="mode", required=True)
    g = sub.add_parser("gpu")
    g.add_argument("--steps", type=int, default=20)
    g.add_argument("--warmup", type=int, default=5)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--seq-len", type=int, default=4096)
    g.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100/H200 SXM)")
    g.add_argument("--profile", action="store_true", help="profile one k3-debug step instead of the comparison")
    c = sub.add_parser("cpu")
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--batch-size", type=int, default=2)
    c.add_argument("--seq-len", type=int, default=256)
    c.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    gpu(args) if args.mode == "gpu" else cpu(args)


if __name__ == "__main__":
    main()
