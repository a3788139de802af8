"""Training-step benchmarks.

  python bench/train.py gpu   [--steps 10 --warmup 3 --batch-size 8 --seq-len 4096 --peak-tflops 989] [--profile]
                              [--no-compile] [--json PATH] [--smoke]
      CUDA only (without it: a one-line error). k3-debug in bf16 autocast (MTP weight 0.3) eager, with activation
      checkpointing and with compile_blocks (torch.compile per block; the warm-up steps include compiling), the
      last also with its forward and backward replayed as one CUDA graph (`openk3 train --cuda-graphs`), beside
      a dense pre-norm transformer (torch SDPA causal attention, SwiGLU) with the same active parameter count and
      the same tokens, all with AdamW so the models are compared (the dense model three times: with the fused LM
      head + cross-entropy k3's rows use, `openk3.ops.loss`, so that pair differs in the model only; with plain
      logits + F.cross_entropy, the baseline of the 2026-11-30 / 12-01 measurements; and with each block
      torch.compile'd and the fused loss, "compile, fused loss", the peer every row's `vs_dense_compiled` divides
      by), plus k3-debug with per-head Muon for the optimizer's cost; k3-debug on packed documents (`openk3 train
      --packing docs`: the segment ids of the embedded corpus's windows, real document lengths, on the same random
      tokens) in the compiled variant (CUDA graphs take no packed batches; the row's note says why), with
      `vs_unpacked` (its step over the unpacked compiled row's); and `openk3 train --preset k3-debug --device cuda
      --batch-size 8 --seq-len 4096` run in this process, every other flag at its default (compiled, packing docs:
      no CUDA graphs), its Trainer's steps timed after the warm-up, with `vs_best_k3` (its tokens/s over the best
      k3 row's); one run. Reports step time, tokens/s, model FLOP utilisation and torch.cuda.max_memory_allocated
      per row, and issue 44's targets (JSON `targets`: best k3 step / compiled dense <= 1.2, packed / unpacked
      <= 1.05, CLI defaults / best k3 tokens/s >= 0.95); then the top 10 kernels of one profiled k3-debug AdamW
      step with their share of its kernel time (eager, and compiled when the compiled row ran: JSON
      `profile_compiled`), and k3-debug's MLA attention alone (which SDPA kernel torch picks with v as it is and
      zero-padded to the q/k head dim, and the time of each). Estimated at 6-9 minutes on an H200. Writes
      bench/train_gpu.json (--json PATH: there instead), keeping the file's "fsdp" entry (written by
      bench/fsdp_scaling.py: 1 GPU against FSDP2 on 2).
      --profile: also print torch.profiler's full operator table.
      --smoke: every row on the CPU at toy sizes (k3-tiny, batch 2, 64 tokens, one warm-up and one timed step;
      the compiled rows through Dynamo alone, backend "eager"; no CUDA graph row): checks the code path in about a
      minute on 2 cores; writes JSON only with --json.
  python bench/train.py optim [--steps 10 --warmup 3 --rounds 3 --batch-size 8 --seq-len 4096 --preset k3-debug]
      CUDA only. What per-head Muon costs over AdamW (the peer: fused, as in the gpu rows), as it runs (its
      elementwise passes in Triton) and with PyTorch's multi-tensor passes instead ("muon-pytorch", FSDP2's
      form), two ways on one model: in the eager bf16 training step of the gpu rows (the optimizers alternated
      `--rounds` times, the best of each: a fresh model's step moves by +-3% from one build to the next), and
      the optimizer step alone with fixed random gradients (no forward or backward around it); then the
      heaviest kernels of one step of each Muon form. Writes bench/train_optim.json (rows: optimizer, step_ms and
      over_adamw_ms alone, train_step_ms and train_over_adamw; the two Muon profiles). About a minute.
  python bench/train.py cpu   [--steps 3 --batch-size 2 --seq-len 256 --threads N]
      One training step (forward + backward + loss) of a small Kimi Linear-shaped model in openk3 beside HF
      transformers' KimiLinearForCausalLM holding the same weights (written by openk3.interop in the hub layout,
      read by transformers' from_pretrained; its pure-PyTorch KDA path). Checks the logits agree first.

Each prints Markdown tables (the results table last) and writes bench/train_<mode>.json (gpu rows: kind (k3,
dense, packed, cli-default), model, optimizer, variant, step_ms (the mean), median_step_ms, mfu, peak_gib,
tokens_per_s, warmup_s, vs_dense_compiled; packed: vs_unpacked, vs_unpacked_median, documents_per_row, note;
cli-default: vs_best_k3, command, note).

Model FLOPs per token (for MFU), counted for forward + backward (x3 of forward):
  6 * (active matmul parameters: everything except the embedding table, with routed experts counted top_k /
       num_experts, and the LM head counted once more per MTP layer, which reuses it)
  + softmax attention (MLA layers, the dense model's layers): 6 * T/2 * H * (d_qk + d_v) per token per layer
    (causal: on average T/2 keys)
  + KDA recurrence: 6 * H * 2 * d_k * d_v per token per layer (state read-out and rank-1 update)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import platform
import statistics
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from openk3.accounting import count_parameters
from openk3.cli import build_parser
from openk3.config import ModelConfig, get_preset
from openk3.model import K3ForCausalLM
from openk3.model.compile import compile_blocks
from openk3.ops.attention import causal_sdpa, fused_sdpa_choice, padded_v_for_flash
from openk3.ops.loss import linear_cross_entropy
from openk3.tokenizer import load_or_train
from openk3.train.args import TrainArgs
from openk3.train.command import train_args
from openk3.train.data import BatchStream, PackedRows, load_documents, split_documents, train_and_heldout_documents
from openk3.train.graphs import GraphedForwardBackward
from openk3.train.loop import Trainer, enable_activation_checkpointing, lm_losses
from openk3.train.mfu import flops_per_token
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

    def head_inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """The normed hidden states the LM head reads [B, T, D]."""
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_inputs(ids))


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

def dense_flops_per_token(model: DenseLM, seq_len: int) -> float:
    matmul = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed"))
    dim = model.embed.weight.shape[1]
    return 6 * matmul + 6 * (seq_len / 2) * 2 * dim * len(model.blocks)


# ---- GPU ----

DEVICE = "cuda"  # "cpu" under --smoke (and in tests): the same rows at toy sizes, to check the code path


class WallEvent:
    """torch.cuda.Event's timing calls on the host clock (the rows on the CPU)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: WallEvent) -> float:
        return (end.t - self.t) * 1e3


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else f"cpu ({platform.processor() or platform.machine()})"


def reset_peak_memory() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    """torch.cuda.max_memory_allocated in GiB (None on the CPU, which keeps no such count)."""
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None


def time_steps(step, steps: int, warmup: int, per_step: list[float] | None = None) -> tuple[float, float]:
    """(seconds per timed step, seconds of the warm-up steps, which include any compilation). With `per_step`,
    each timed step's seconds are appended to it (events between the steps, no synchronisation inside the loop)."""
    start_warmup = time.perf_counter()
    for _ in range(warmup):
        step()
    synchronize()
    warmup_s = time.perf_counter() - start_warmup
    marks = [torch.cuda.Event(enable_timing=True) if DEVICE == "cuda" else WallEvent() for _ in range(steps + 1)]
    marks[0].record()
    for mark in marks[1:]:
        step()
        mark.record()
    synchronize()
    if per_step is not None:
        per_step.extend(a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:]))
    return marks[0].elapsed_time(marks[-1]) / 1000 / steps, warmup_s


def k3_forward_backward(model, cuda_graph: bool = False):
    """The bf16-autocast forward (LM + MTP loss) and backward of the k3 model on a batch (token ids, or PackedRows:
    packed documents); with `cuda_graph` replayed as one CUDA graph after two warm-up calls (the class behind
    `openk3 train --cuda-graphs`)."""

    def forward_backward(batch: torch.Tensor | PackedRows) -> tuple[torch.Tensor]:
        ids, segments = batch if isinstance(batch, PackedRows) else (batch, None)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, cache_enabled=not cuda_graph):
            loss, _, _ = lm_losses(model, ids, mtp_weight=0.3, segments=segments)
        loss.backward()
        return (loss.detach(),)

    return GraphedForwardBackward(forward_backward, list(model.parameters())) if cuda_graph else forward_backward


def k3_train_step(model, opt, batch, forward_backward=None):
    """One training step of the k3 model on a fresh batch: `forward_backward` (default: k3_forward_backward's
    eager one), then the optimizer."""
    forward_backward = forward_backward or k3_forward_backward(model)

    def step():
        forward_backward(batch())
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


K3_VARIANTS = {  # variant -> (activation checkpointing, compile_blocks, CUDA graph)
    "eager": (False, False, False),
    "act. ckpt": (True, False, False),
    "compile": (False, True, False),
    "compile + CUDA graph": (False, True, True),
}


def build_k3(cfg: ModelConfig, variant: str, optimizer: str, **compile_options):
    """The k3 model and optimizer of a variant; `compile_options` go to `compile_blocks` (e.g. mode, backend)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(DEVICE)
    checkpointing, compiled, _ = K3_VARIANTS[variant]
    if checkpointing:
        enable_activation_checkpointing(model)
    if compiled:
        compile_blocks(model, **compile_options)
    return model, build_optimizer(model, lr=1e-4, weight_decay=0.1, optimizer=optimizer)


def result_row(kind: str, model: str, optimizer: str, variant: str, seconds: float, warmup_s: float,
               flops_per_token: float, args: argparse.Namespace, per_step: list[float]) -> dict:
    """A results row; kind: "k3" (the unpacked variants), "dense", "packed" or "cli-default". step_ms is the mean
    of the timed steps; median_step_ms leaves out a one-time cost inside them (a packed batch's first layout of a
    new kind compiles a Triton kernel variant once: bench/RESULTS.md, 2026-12-06 fifth session)."""
    tokens = args.batch_size * args.seq_len
    return {"kind": kind, "model": model, "optimizer": optimizer, "variant": variant, "step_ms": seconds * 1e3,
            "median_step_ms": statistics.median(per_step) * 1e3, "tokens_per_s": tokens / seconds,
            "mfu": flops_per_token * tokens / seconds / (args.peak_tflops * 1e12), "peak_gib": peak_gib(),
            "warmup_s": warmup_s}


def k3_result(cfg: ModelConfig, variant: str, optimizer: str, args: argparse.Namespace, batch,
              kind: str = "k3") -> dict:
    model, opt = build_k3(cfg, variant, optimizer, **compile_options(args))
    reset_peak_memory()
    forward_backward = k3_forward_backward(model, cuda_graph=K3_VARIANTS[variant][2])
    graphed = forward_backward if isinstance(forward_backward, GraphedForwardBackward) else None
    warmup = max(args.warmup, graphed.warmup + 1) if graphed else args.warmup  # the timed steps replay
    per_step = []
    seconds, warmup_s = time_steps(k3_train_step(model, opt, batch, forward_backward), args.steps, warmup, per_step)
    row = result_row(kind, cfg.name, optimizer, variant, seconds, warmup_s, flops_per_token(cfg, args.seq_len), args,
                     per_step)
    if graphed is not None and graphed.failed:  # the step ran eagerly: say so beside its time
        row["graph_error"] = graphed.failed
    return row


def dense_loss(dense: DenseLM, ids: torch.Tensor, loss: str) -> torch.Tensor:
    """The dense model's next-token loss, "fused" through openk3's chunked LM head + CE (as k3's `lm_losses`) or
    "plain" (bf16 logits, then F.cross_entropy on their fp32 copy)."""
    if loss == "fused":
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            h = dense.head_inputs(ids[:, :-1])
            return linear_cross_entropy(h.flatten(0, 1), dense.head.weight, ids[:, 1:].flatten())
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        logits = dense(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


DENSE_COMPILED = "compile, fused loss"  # the dense row every row's `vs_dense_compiled` divides by


def dense_result(cfg: ModelConfig, args: argparse.Namespace, batch, loss: str, compiled: bool = False) -> dict:
    """The dense model's row: eager, or with each block torch.compile'd (`compiled`, as compile_blocks does k3's)."""
    torch.manual_seed(0)
    dense, meta = dense_like(cfg)
    dense = dense.to(DEVICE)
    for block in dense.blocks if compiled else []:
        block.compile(**compile_options(args))
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def step():
        dense_loss(dense, batch(), loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak_memory()
    per_step = []
    seconds, warmup_s = time_steps(step, args.steps, args.warmup, per_step)
    return result_row("dense", f"dense SDPA (ffn {meta['ffn']}, same active params)", "adamw",
                      f"{'compile' if compiled else 'eager'}, {loss} loss", seconds, warmup_s,
                      dense_flops_per_token(dense, args.seq_len), args, per_step)


def top_kernels(prof, rows: int = 10, device_type=None) -> list[dict]:
    """The `rows` kernels with the most device time in a torch.profiler run, each with its share of all the
    device time the profile saw (`device_type`: the profiler's DeviceType of the kernels; by default DEVICE's).
    User annotations (record_function ranges such as `Optimizer.step`) span kernels and are left out."""
    from torch.autograd import DeviceType

    if device_type is None:
        device_type = DeviceType.CUDA if DEVICE == "cuda" else DeviceType.CPU
    attr = "self_cpu_time_total" if device_type == DeviceType.CPU else "self_device_time_total"
    time_of = lambda e: getattr(e, attr)  # microseconds
    kernels = [e for e in prof.key_averages() if e.device_type == device_type and not e.is_user_annotation]
    total = sum(time_of(e) for e in kernels) or 1.0
    kernels.sort(key=time_of, reverse=True)
    return [{"kernel": e.key, "ms": time_of(e) / 1e3, "share": time_of(e) / total, "calls": e.count}
            for e in kernels[:rows]]


def profiler_activities() -> list:
    """torch.profiler's activities for the timed device: CPU, and CUDA where the kernels run."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])


def profile_k3_step(cfg: ModelConfig, batch, args: argparse.Namespace, variant: str = "eager") -> dict:
    """One k3 AdamW step of `variant` under torch.profiler, after two warm-up steps: the top 10 kernels."""
    from torch.profiler import profile

    model, opt = build_k3(cfg, variant, "adamw", **compile_options(args))
    step = k3_train_step(model, opt, batch)
    for _ in range(2):
        step()
    synchronize()
    start = time.perf_counter()
    with profile(activities=profiler_activities()) as prof:
        step()
        synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    if args.profile:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
    kernels = top_kernels(prof)
    device_ms = sum(k["ms"] for k in top_kernels(prof, rows=10**9))
    return {"step_wall_ms_profiled": wall_ms, "device_ms": device_ms, "top_kernels": kernels}


def mla_attention_timing(cfg: ModelConfig, args: argparse.Namespace, reps: int = 10) -> dict:
    """The k3 model's MLA attention alone (causal SDPA, bf16, forward + backward) with v as it is and zero-padded to
    the q/k head dim: which kernel torch picks for each, and the time of each (ms)."""
    m = cfg.mla
    B, T, H = args.batch_size, args.seq_len, m.num_heads
    dk, dv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    make = lambda d: torch.randn(B, T, H, d, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = make(dk), make(dk), make(dv)
    grad_out = torch.randn(B, H, T, dv, device=DEVICE, dtype=torch.bfloat16)
    out = {"auto_pads_v": padded_v_for_flash(q, k, v) is not None}
    for pad in (False, True):
        vv = F.pad(v, (0, dk - dv)) if pad else v
        name = "padded" if pad else "unpadded"
        out[f"{name}_backend"] = SDPBackend(fused_sdpa_choice(q, k, vv)).name

        def run(pad=pad):
            causal_sdpa(q, k, v, dk**-0.5, pad_v=pad).backward(grad_out)

        out[f"{name}_ms"] = time_steps(run, reps, 3)[0] * 1e3
    return out


def print_results(env: dict, targets: dict, results: list[dict], profiles: dict, mla: dict) -> None:
    print(f"{env}\n\nMLA attention (B x H x T = {env['batch']} x {env['mla_heads']} x {env['seq_len']}, fwd+bwd): "
          f"v as is -> {mla['unpadded_backend']} {mla['unpadded_ms']:.2f} ms; v padded -> {mla['padded_backend']} "
          f"{mla['padded_ms']:.2f} ms; the model pads: {mla['auto_pads_v']}")
    for variant, profile in profiles.items():
        if profile is None:
            continue
        print_kernels(f"Profile of one {env['preset']} AdamW step ({variant}): {profile['device_ms']:.1f} ms of "
                      f"kernel time (wall {profile['step_wall_ms_profiled']:.1f} ms under the profiler)",
                      profile["top_kernels"], digits=1)
    for r in results:
        if r.get("note"):
            print(f"\n{r['variant']}: {r['note']}")
    print("\ntargets: " + "; ".join(f"{name} {value:.2f}" if value is not None else f"{name} -"
                                    for name, value in targets.items()))
    print("\n| model | optimizer | variant | step (ms) | median step (ms) | tokens/s | MFU | peak memory (GiB) | "
          "warm-up (s) | vs dense compiled |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['model']} | {r['optimizer']} | {r['variant']} | failed: {r['error']} | | | | | | |")
            continue
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        ratio = "-" if r["vs_dense_compiled"] is None else f"{r['vs_dense_compiled']:.2f}x"
        print(f"| {r['model']} | {r['optimizer']} | {r['variant']} | {r['step_ms']:.1f} | {r['median_step_ms']:.1f} "
              f"| {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {peak} | {r['warmup_s']:.1f} | {ratio} |")


def error_summary(e: Exception) -> str:
    """The exception's type, first line and last line (Inductor's errors put the cause last)."""
    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
    return f"{type(e).__name__}: {lines[0][:150]}" + (f" ... {lines[-1][:150]}" if len(lines) > 1 else "")


def free_gpu() -> None:
    """Release the last row's model and optimizer (compiled code holds on to them until Dynamo is reset), so each
    row's peak memory is its own."""
    torch._dynamo.reset()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def print_kernels(title: str, kernels: list[dict], digits: int) -> None:
    print(f"\n{title}\n\n| kernel | ms | share | calls |\n|---|---|---|---|")
    for k in kernels:
        print(f"| {k['kernel'][:90]} | {k['ms']:.{digits}f} | {k['share']:.1%} | {k['calls']} |")


def cuda_mode(mode: str, args: argparse.Namespace):
    """(the preset's config, a fresh random batch [B, T + 1] a call) for a CUDA-only mode; exits without CUDA (unless
    the run is pointed at the CPU: --smoke)."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench/train.py {mode} needs a CUDA device")
    cfg = get_preset(args.preset)

    def batch() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=DEVICE)

    return cfg, batch


def compile_options(args: argparse.Namespace) -> dict:
    """torch.compile's options for the compiled rows: Inductor's defaults; under --smoke Dynamo alone (backend
    "eager": the rows' tracing and guards without Inductor's minutes of C++ builds on a CPU)."""
    return {"backend": "eager"} if args.smoke else {}


def attempt(make_row, may_fail: bool, **identity) -> dict:
    """make_row()'s row, the device freed after it. When it raises and `may_fail` (a compiled row: compiling can
    fail on some torch / triton pair), the row of `identity` with the error instead, so the other rows still run."""
    try:
        row = make_row()
        print(f"row done: {json.dumps(row)}", flush=True)  # (a run cut off by a time limit keeps what it measured)
        return row
    except Exception as e:
        if not may_fail:
            raise
        traceback.print_exc()
        return {**identity, "error": error_summary(e)}
    finally:
        free_gpu()


def corpus_segments(cfg: ModelConfig, args: argparse.Namespace):
    """(a call giving the next batch's segment ids [B, T + 1], the mean documents per row): packed windows of the
    embedded corpus as `openk3 train` reads it (its tokenizer, trained and cached as the trainer does, the training
    split, BatchStream's windows), so the document lengths are the real ones."""
    docs = load_documents(None)
    tokenizer = load_or_train([d.text for d in split_documents(docs)[0]], cfg.vocab_size)
    (tokens, segments), _ = train_and_heldout_documents(docs, tokenizer)
    stream = BatchStream(tokens, args.seq_len, args.batch_size, seed=0, segments=segments)
    rows = segments[:stream.num_windows * args.seq_len].view(-1, args.seq_len)
    docs_per_row = float(((rows[:, 1:] != rows[:, :-1]).sum(1) + 1).double().mean())
    return (lambda: stream.next_packed()[1]), docs_per_row


PACKED_NOTE = ("the best variant that takes packed batches, as `openk3 train --packing docs` runs: compiled (eager "
               "when the compiled row did not run), without CUDA graphs: each batch has its own document layout (the "
               "KDA kernels' varlen chunk tables are built on the host; a graph would replay its first batch's)")


def k3_row(results: list[dict], variant: str) -> dict | None:
    """The unpacked AdamW k3 row of `variant` when it ran."""
    return next((r for r in results if r["kind"] == "k3" and r["optimizer"] == "adamw" and r["variant"] == variant
                 and "error" not in r), None)


def packed_result(cfg: ModelConfig, args: argparse.Namespace, batch, results: list[dict]) -> dict:
    """k3 on packed documents (`openk3 train --packing docs`) in the variant PACKED_NOTE names, on the same random
    tokens as the other rows with the segment ids of the corpus's windows (`corpus_segments`): the rows differ in
    the packing only. `vs_unpacked`: its step time over that variant's unpacked row's."""
    variant = "compile" if k3_row(results, "compile") else "eager"
    unpacked = k3_row(results, variant)
    segments, docs_per_row = corpus_segments(cfg, args)
    packed = lambda: PackedRows(batch(), segments())
    row = attempt(partial(k3_result, cfg, variant, "adamw", args, packed, "packed"), K3_VARIANTS[variant][1],
                  kind="packed", model=cfg.name, optimizer="adamw")
    row.update(variant=f"{variant}, packed", note=PACKED_NOTE, documents_per_row=docs_per_row)
    if "error" not in row:
        row["vs_unpacked"] = row["step_ms"] / unpacked["step_ms"]
        row["vs_unpacked_median"] = row["median_step_ms"] / unpacked["median_step_ms"]
    return row


def cli_default_result(args: argparse.Namespace, results: list[dict]) -> dict:
    """`openk3 train --preset P --device D --batch-size B --seq-len T` in this process: its TrainArgs built by the
    command's own parser (every other flag at its default, --out a temporary directory), its steps timed after the
    warm-up steps as `openk3 train` runs them (`Trainer.steps`: each step's numbers read once the next is queued).
    `vs_best_k3`: its tokens/s over the best k3 row's."""
    argv = ["train", "--preset", args.preset, "--device", DEVICE, "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len)]
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(train_args(build_parser().parse_args(argv + ["--out", out])))
        reset_peak_memory()
        per_step = []
        seconds, warmup_s = time_steps(partial(next, trainer.steps()), args.steps, args.warmup, per_step)
    t = trainer.args
    fast = ["compile" if t.compile else "eager"] + ["CUDA graph"] * t.cuda_graphs + [f"packing {trainer.packing}"]
    row = result_row("cli-default", trainer.cfg.name, t.optimizer, f"openk3 train defaults ({', '.join(fast)})",
                     seconds, warmup_s, flops_per_token(trainer.cfg, args.seq_len), args, per_step)
    best = max(r["tokens_per_s"] for r in results if r["kind"] in ("k3", "packed") and "error" not in r)
    row.update(command="openk3 " + " ".join(argv), note=trainer.fast_path_note, vs_best_k3=row["tokens_per_s"] / best)
    return row


def add_vs_dense_compiled(results: list[dict]) -> None:
    """Every row's step time over the compiled dense row's (`vs_dense_compiled`; None without that row)."""
    base = next((r for r in results if r["kind"] == "dense" and r["variant"] == DENSE_COMPILED and "error" not in r),
                None)
    for r in results:
        if "error" not in r:
            r["vs_dense_compiled"] = r["step_ms"] / base["step_ms"] if base else None


def target_ratios(results: list[dict]) -> dict:
    """Issue 44's three ratios: the best k3 step over the compiled dense step (target <= 1.2), the packed step over
    the unpacked one (<= 1.05; also of their median steps, which leave out one-time kernel compiles), the CLI
    defaults' tokens/s over the best k3 row's (>= 0.95); None where a row is missing."""
    ok = [r for r in results if "error" not in r]
    first = lambda kind, key: next((r[key] for r in ok if r["kind"] == kind), None)
    k3 = [r["vs_dense_compiled"] for r in ok if r["kind"] == "k3" and r["vs_dense_compiled"] is not None]
    return {"best_k3_vs_dense_compiled": min(k3, default=None), "packed_vs_unpacked": first("packed", "vs_unpacked"),
            "packed_vs_unpacked_median": first("packed", "vs_unpacked_median"),
            "cli_default_vs_best_k3": first("cli-default", "vs_best_k3")}


def gpu(args: argparse.Namespace) -> list[dict]:
    cfg, batch = cuda_mode("gpu", args)
    rows = [("eager", "adamw"), ("act. ckpt", "adamw"), ("eager", "muon")]
    rows += [] if args.no_compile else [("compile", "adamw")] + [("compile + CUDA graph", "adamw")] * (DEVICE == "cuda")
    results = [attempt(partial(k3_result, cfg, variant, optimizer, args, batch), K3_VARIANTS[variant][1], kind="k3",
                       model=cfg.name, optimizer=optimizer, variant=variant) for variant, optimizer in rows]
    # fused: the loss k3's rows use, so the eager pair differs in the model only
    dense = [("fused", False), ("plain", False)] + ([] if args.no_compile else [("fused", True)])
    results += [attempt(partial(dense_result, cfg, args, batch, loss, compiled), compiled, kind="dense",
                        model="dense SDPA", optimizer="adamw", variant=DENSE_COMPILED) for loss, compiled in dense]
    results.append(packed_result(cfg, args, batch, results))
    results.append(attempt(partial(cli_default_result, args, results), DEVICE == "cuda", kind="cli-default",
                           model=cfg.name, optimizer=TrainArgs().optimizer, variant="openk3 train defaults"))
    add_vs_dense_compiled(results)
    profile = profile_k3_step(cfg, batch, args)
    free_gpu()
    profile_compiled = profile_k3_step(cfg, batch, args, "compile") if k3_row(results, "compile") else None
    free_gpu()
    mla = mla_attention_timing(cfg, args)
    env = {"gpu": device_name(), "preset": args.preset, "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "triton": _version("triton"), "batch": args.batch_size,
           "seq_len": args.seq_len, "mla_heads": cfg.mla.num_heads, "steps": args.steps, "warmup": args.warmup,
           "peak_tflops": args.peak_tflops}
    targets = target_ratios(results)
    path = args.json or (None if args.smoke else HERE / "train_gpu.json")
    if path is not None:
        path = Path(path)
        kept = {k: v for k, v in json.loads(path.read_text()).items() if k == "fsdp"} if path.exists() else {}
        path.write_text(json.dumps({"env": env, "targets": targets, "results": results, "profile": profile,
                                    "profile_compiled": profile_compiled, "mla_attention": mla, **kept}, indent=1))
    print_results(env, targets, results, {"eager": profile, "compile_blocks": profile_compiled}, mla)
    return results


def optim(args: argparse.Namespace) -> list[dict]:
    cfg, batch = cuda_mode("optim", args)
    model, _ = build_k3(cfg, "eager", "adamw")
    opts = {name: build_optimizer(model, lr=1e-4, weight_decay=0.1, optimizer=name.split("-")[0],
                                  fused=False if name == "muon-pytorch" else None)
            for name in ("adamw", "muon", "muon-pytorch")}
    train_s = {name: math.inf for name in opts}
    for _ in range(args.rounds):  # the optimizers on the same model, alternated: the best of each
        for name, opt in opts.items():
            train_s[name] = min(train_s[name], time_steps(k3_train_step(model, opt, batch), args.steps,
                                                          args.warmup)[0])
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for name, opt in opts.items():
        alone_s, warmup_s = time_steps(opt.step, args.steps, args.warmup)
        rows.append({"optimizer": name, "step_ms": alone_s * 1e3, "train_step_ms": train_s[name] * 1e3,
                     "warmup_s": warmup_s})
    profile = {name: profile_optimizer_step(opts[name]) for name in ("muon", "muon-pytorch")}
    parameters = sum(p.numel() for p in model.parameters())
    for r in rows:
        r["over_adamw_ms"] = r["step_ms"] - rows[0]["step_ms"]
        r["train_over_adamw"] = r["train_step_ms"] / rows[0]["train_step_ms"] - 1
    env = {"gpu": device_name(), "preset": args.preset, "torch": torch.__version__,
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "batch": args.batch_size,
           "seq_len": args.seq_len, "parameters": parameters}
    (HERE / "train_optim.json").write_text(json.dumps({"env": env, "results": rows, "profile_muon": profile["muon"],
                                                       "profile_muon_pytorch": profile["muon-pytorch"]}, indent=1))
    print(env)
    for name, prof in profile.items():
        print_kernels(f"One {name} step: {prof['device_ms']:.1f} ms of kernel time", prof["top_kernels"], digits=2)
    print("\n| optimizer | step alone (ms) | over AdamW (ms) | eager training step (ms) | over AdamW |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['step_ms']:.2f} | {r['over_adamw_ms']:+.2f} | {r['train_step_ms']:.1f} | "
              f"{r['train_over_adamw']:+.1%} |")
    return rows


def profile_optimizer_step(opt: torch.optim.Optimizer) -> dict:
    from torch.profiler import profile

    with profile(activities=profiler_activities()) as prof:
        opt.step()
        synchronize()
    return {"device_ms": sum(k["ms"] for k in top_kernels(prof, rows=10**9)), "top_kernels": top_kernels(prof)}


def _version(package: str) -> str | None:
    try:
        return importlib.import_module(package).__version__
    except ImportError:
        return None


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
    args.json.write_text(json.dumps(result, indent=1))
    print(f"{result['env']}\nlogits relative error {rel:.1e}\n\n| implementation | train step (s, best of "
          f"{args.steps}) | tokens/s |\n|---|---|---|")
    print(f"| openk3 (chunked KDA) | {t_ours:.3f} | {tokens / t_ours:,.0f} |")
    print(f"| transformers KimiLinearForCausalLM | {t_theirs:.3f} | {tokens / t_theirs:,.0f} |")
    print(f"\nopenk3 is {result['speedup']:.1f}x faster")
    return result


def step_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The timed steps and the batch shape of the CUDA modes."""
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    return parser


SMOKE = {"preset": "k3-tiny", "batch_size": 2, "seq_len": 64, "steps": 1, "warmup": 1}  # gpu --smoke's sizes


def main() -> None:
    parser = argparse.ArgumentParser(description="training-step benchmarks (see the module docstring)")
    sub = parser.add_subparsers(dest="mode", required=True)
    g = step_arguments(sub.add_parser("gpu"))
    g.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100/H200 SXM)")
    g.add_argument("--profile", action="store_true", help="also print torch.profiler's full operator table")
    g.add_argument("--no-compile", action="store_true", help="leave out the compiled rows (their warm-up compiles)")
    g.add_argument("--preset", default="k3-debug", help="the k3 model (the dense baseline is sized to match it)")
    g.add_argument("--smoke", action="store_true", help="every row on the CPU at toy sizes (" + ", ".join(
        f"{k}={v}" for k, v in SMOKE.items()) + "; compiled rows through Dynamo alone, no CUDA graph): the code path")
    g.add_argument("--json", default=None, metavar="PATH",
                   help="where the results go (default: bench/train_gpu.json; under --smoke: nowhere)")
    o = step_arguments(sub.add_parser("optim"))
    o.add_argument("--rounds", type=int, default=3, help="training-step timings per optimizer, alternated")
    o.add_argument("--preset", default="k3-debug")
    c = sub.add_parser("cpu", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="one training step, openk3 against transformers' KimiLinearForCausalLM")
    c.add_argument("--steps", type=int, default=3, help="timed steps of each implementation (the best is kept)")
    c.add_argument("--batch-size", type=int, default=2, help="sequences a step")
    c.add_argument("--seq-len", type=int, default=256, help="tokens a sequence")
    c.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's own choice)")
    c.add_argument("--json", type=Path, default=HERE / "train_cpu.json", help="the results")
    args = parser.parse_args()
    if getattr(args, "smoke", False):
        global DEVICE
        DEVICE = "cpu"
        vars(args).update(SMOKE)
    {"gpu": gpu, "optim": optim, "cpu": cpu}[args.mode](args)


if __name__ == "__main__":
    main()
