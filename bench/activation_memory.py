"""Activation memory of a training step, per module kind: k3-debug against bench/train.py's dense model.

    python bench/activation_memory.py [--preset k3-debug --batch-size 1 --seq-len 512 --gpu-tokens 32768]

A CPU proxy for what `python bench/train.py gpu` keeps alive between forward and backward: the bytes of the tensors
autograd saves for backward, counted with `torch.autograd.graph.saved_tensors_hooks` (distinct storages, once
each; parameters and the autocast copies of parameters are left out: they do not grow with the tokens) and
attributed to the innermost module running when they were saved (forward pre/post hooks keep a module stack), in
one forward + loss (the training loop's fused LM head + CE, `ops.loss`, for both models; the dense model also with
plain logits + cross-entropy, the baseline the H200 runs measured) under `torch.autocast("cpu",
dtype=torch.bfloat16)` with fp32 weights, as the GPU step runs under CUDA autocast.

The forward takes the code paths a CUDA step takes, so the count is the GPU's (`cuda_code_paths`): the Triton
autograd Functions of RMSNorm, SiTU-GLU, the KDA short conv + SiLU and the KDA activations (their forward kernels
replaced by the PyTorch references, which write the same values; what each Function saves is its own), the
experts' grouped GEMM (torch's CPU kernel), SDPA's flash kernel (the CPU one saves what the GPU's saves: q, k,
padded v, the output and the log-sum-exp) and, for the dense model, torch's RMSNorm as CUDA's fused kernel (input
and rstd). The KDA core is the exception: its Triton autograd Function (`ops/kda/triton/chunk.py`) saves q, k, v,
g, beta and what its forward kernels formed (not the per-chunk states: the backward replays them), so its row is
that count
(`kda_core_bytes_per_token`; tests/test_activation_memory.py checks it against the Function run by Triton's
interpreter); the CPU forward runs the chunked PyTorch form, whose saved tensors are left out. Bytes per token are
the slope between --seq-len / 2 and --seq-len tokens (`per_token`).

Prints bytes per token by module kind for both models and the ratio k3 / dense with and without the attention
cores, predicts the GPU peak at --gpu-tokens (method in `predicted_peak`), and writes
bench/activation_memory.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest.mock import patch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the Triton Functions run on CPU tensors

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from openk3.cli_options import int_at_least  # noqa: E402
from openk3.config import PRESETS, ModelConfig, get_preset  # noqa: E402
from openk3.model import K3ForCausalLM  # noqa: E402
from openk3.ops.loss import CHUNK_LOGITS_BYTES, linear_cross_entropy  # noqa: E402

HERE = Path(__file__).parent
MTP_WEIGHT = 0.3  # as bench/train.py's k3 step


# ---- the census: saved tensors by module --------------------------------------------------------------------------

class SavedTensorCensus:
    """Within `with census:`, every tensor autograd saves is recorded once per storage under the stack running
    when it was saved: the dotted names of the modules of `root` (module forward hooks keep the stack) and the
    regions pushed with `census.region(name)` (as "@name"). Parameters are not counted; a copy of a parameter
    (autocast's bf16 cast of a weight) goes to `weight_copies` (a per-step constant), everything else to
    `by_stack`."""

    def __init__(self, root: nn.Module):
        self.names = {m: n or "<root>" for n, m in root.named_modules()}
        self.params = {p.untyped_storage().data_ptr() for p in root.parameters()}
        self.stack: list[str] = []
        self.seen: set[int] = set()
        self.by_stack: Counter[tuple[str, ...]] = Counter()
        self.weight_copies = 0
        self._hooks: list = []
        self._saving = None

    def region(self, name: str) -> contextlib.AbstractContextManager:
        @contextlib.contextmanager
        def push() -> Iterator[None]:
            self.stack.append("@" + name)
            try:
                yield
            finally:
                self.stack.pop()
        return push()

    def _pre(self, module, args) -> None:
        if module in self.names:
            self.stack.append(self.names[module])

    def _post(self, module, args, out) -> None:
        if module in self.names:
            self.stack.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.params or key in self.seen or storage.nbytes() == 0:
            return t
        self.seen.add(key)
        if is_weight_copy(t):
            self.weight_copies += storage.nbytes()
        else:
            self.by_stack[tuple(self.stack)] += storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorCensus:
        self._hooks = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                       nn.modules.module.register_module_forward_hook(self._post)]
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saving.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saving.__exit__(*exc)
        for h in self._hooks:
            h.remove()


VIEW_OR_CAST = re.compile(r"(ToCopy|T|Transpose|Permute|View|Unsafe.*View|Reshape.*|Expand|Unbind|Split.*|Alias"
                          r"|Select|Slice)Backward\d*")


def is_weight_copy(t: torch.Tensor) -> bool:
    """A tensor computed from one parameter by casts and views only (autocast's bf16 copy of a weight)."""
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return True
        if not VIEW_OR_CAST.fullmatch(type(fn).__name__):
            return False
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def in_region(census: SavedTensorCensus, name: str, fn: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        with census.region(name):
            return fn(*args, **kwargs)
    return wrapped


# ---- the CUDA step's code paths on CPU ----------------------------------------------------------------------------

def _norm_forward_reference(x2, r2, weight, eps, s_dtype):
    """What `ops.triton_norm._norm_forward`'s kernel writes: (y, s, rstd), computed in PyTorch."""
    s = x2 if r2 is None else (x2 + r2).to(s_dtype)
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1) + eps)
    return (sf * rstd[:, None] * weight.float()).to(s_dtype), s, rstd


def _gated_norm_forward_reference(x2, z2, weight, eps):
    """What `ops.triton_norm._gated_norm_forward`'s kernel writes: (y, rstd), computed in PyTorch."""
    xf = x2.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd[:, None] * weight.float() * torch.sigmoid(z2.float())).to(x2.dtype), rstd


def _glu_forward_reference(g2, u2, n_cols, out_shape, dtype, b1, b2):
    """What `ops.triton_glu._forward`'s kernel writes, computed with the reference `situ_glu`."""
    from openk3.ops.activations import situ_glu

    return situ_glu(g2[:, :n_cols], u2[:, :n_cols], b1, b2).to(dtype).reshape(out_shape)


def _conv_forward_reference(x, w, state, dtype, tile=None, groups=1, starts=None):
    """What `ops.triton_conv._forward`'s kernel writes (one contiguous tensor per channel group), computed with
    `ops.conv._conv_silu`."""
    from openk3.ops.conv import _conv_silu

    B, _, C = x.shape
    state = x.new_zeros(B, C, w.shape[-1] - 1) if state is None else state
    return [y.contiguous() for y in _conv_silu(x, w, state, dtype, starts).split(C // groups, dim=-1)]


class _KDAActivationsKernel:
    """Stands in for `_act_fwd_kernel[grid](...)`: writes the same outputs with `kda_activations_reference`."""

    def __getitem__(self, grid):
        from openk3.ops.kda.triton.activations import kda_activations_reference

        def launch(q, k, f, b, A_log, dt_bias, qo, ko, go, bo, n_rows, H, *, G_MIN, KIMI, **_):
            outs = kda_activations_reference(q, k, f, b, A_log, dt_bias, gate="kimi" if KIMI else "k3", g_min=G_MIN)
            for dst, src in zip((qo, ko, go, bo), outs):
                dst.copy_(src)
        return launch


def _fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    """torch's RMSNorm (the dense model's nn.RMSNorm) as CUDA runs it, one fused kernel that saves the input and
    rstd (`_fused_rms_norm`; on CPU torch composes it from ops that save more): here the same Function as k3's."""
    from openk3.ops.triton_norm import rms_norm_triton

    weight = torch.ones(normalized_shape, dtype=x.dtype) if weight is None else weight
    return rms_norm_triton(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)


@contextlib.contextmanager
def cuda_code_paths(census: SavedTensorCensus) -> Iterator[None]:
    """Run a CPU forward through the code a CUDA step runs, so its saved tensors are the GPU's: the Triton
    autograd Functions of RMSNorm (plain and the KDA output's gated one), SiTU-GLU, the short conv + SiLU and the
    KDA activations (each saves what it saves on the GPU; only their forward kernels are replaced by the PyTorch
    references, which write the same values), the experts' grouped GEMM, SDPA (its CPU flash kernel) and torch's
    RMSNorm (as `_fused_rms_norm`). The KDA core runs the chunked PyTorch form inside the region "KDA core" (left
    out of the count: `kda_core_bytes_per_token` gives the Triton Function's). Attention cores run in the region
    "attention core", the experts' GEMMs in "experts"."""
    import openk3.model.common as common
    import openk3.model.kda as model_kda
    import openk3.ops.activations as activations
    import openk3.ops.conv as conv
    import openk3.ops.kda.triton.activations as kda_act
    import openk3.ops.moe as moe
    import openk3.ops.triton_conv as triton_conv
    import openk3.ops.triton_glu as triton_glu
    import openk3.ops.triton_norm as triton_norm

    def use_triton(x: torch.Tensor) -> bool:
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)

    real_kda = model_kda.kda
    with contextlib.ExitStack() as stack:
        for obj, name, value in [
            (activations, "use_triton", use_triton), (common, "use_triton", use_triton),
            (model_kda, "use_triton", use_triton), (conv, "use_triton", use_triton),
            (triton_norm, "_norm_forward", _norm_forward_reference),
            (triton_norm, "_gated_norm_forward", _gated_norm_forward_reference),
            (triton_glu, "_forward", _glu_forward_reference),
            (triton_conv, "_forward", _conv_forward_reference),
            (kda_act, "_act_fwd_kernel", _KDAActivationsKernel()),
            (moe, "grouped_mm_usable", lambda *args: True),
            (moe, "grouped_glu_mlp", in_region(census, "experts", moe.grouped_glu_mlp)),
            (F, "scaled_dot_product_attention", in_region(census, "attention core", F.scaled_dot_product_attention)),
            (F, "rms_norm", _fused_rms_norm),
        ]:
            stack.enter_context(patch.object(obj, name, value))
        stack.enter_context(patch.object(model_kda, "kda", in_region(
            census, "KDA core", lambda *a, **kw: real_kda(*a, **{**kw, "backend": "chunked"}))))
        yield


def kda_core_bytes_per_token(heads: int, head_dim: int, v_dim: int, operand_bytes: int, state_bytes: int,
                             chunk: int = 16) -> float:
    """Bytes per token that the Triton KDA Function (`ops/kda/triton/chunk.py`, `_KDAChunkFunction`) saves for
    one layer: q, k, v in the operand dtype, g [H,K] fp32, beta [H] fp32, and what its kernels formed, in their
    dot dtype (`state_bytes`: bf16 for bf16 inputs on a GPU): the pseudo-values [H,V], W, Qd, kg [H,K] and Aqk
    [H,chunk]; and in fp32 gc [H,K] and the pair terms P and T [H,chunk,chunk] a chunk, the inverse norms of q
    and k [H,2] a token. The states at the chunk starts ([H,K,V] a chunk) are replayed in the backward, one
    layer's at a time, after the peak at the end of the forward."""
    inputs = heads * ((2 * head_dim + v_dim) * operand_bytes + 4 * head_dim + 4)
    formed = heads * (v_dim + 3 * head_dim + chunk) * state_bytes
    return inputs + formed + heads * (head_dim + 2 * chunk * chunk) * 4 / chunk + heads * 2 * 4


# ---- module kinds -------------------------------------------------------------------------------------------------

NORMS = "RMSNorms (pre-norms)"
KDA_PROJ = "KDA projections, conv, gates, output"
KDA_CORE = "KDA core (Triton Function, counted)"
MLA_PROJ = "MLA projections, norms, K/V expansion"
ATTN_PROJ = "attention projections (qkv, o)"
ATTN_CORE = "attention core (SDPA flash)"
ROUTER = "MoE router"
DISPATCH = "MoE dispatch / combine"
EXPERTS = "MoE routed experts (grouped GEMMs, SiTU-GLU)"
SHARED = "MoE shared expert"
LATENT = "MoE latent projections + norm"
FFN = "dense FFN"
STREAM = "AttnRes / residual stream, embedding"
HEAD = "LM head + loss (final norm included)"
MTP = "MTP layer, its head and loss"
KINDS = (NORMS, KDA_PROJ, KDA_CORE, MLA_PROJ, ATTN_PROJ, ATTN_CORE, ROUTER, DISPATCH, EXPERTS, SHARED, LATENT, FFN,
         STREAM, HEAD, MTP)
CORES = (KDA_CORE, ATTN_CORE)  # differ between the CPU and the GPU: left out of the ratio


def k3_module_kinds(model: K3ForCausalLM) -> dict[str, str]:
    """Module name -> kind for k3 (each module takes its parent's kind unless its own type says otherwise)."""
    from openk3.model.kda import KimiDeltaAttention
    from openk3.model.mla import GatedMLA
    from openk3.model.moe import GLUMLP, MoE, TopkRouter
    from openk3.model.transformer import DecoderLayer

    kinds: dict[str, str] = {"<root>": HEAD, "lm_head": HEAD, "model.norm": HEAD, "model": STREAM,
                             "model.embed_tokens": STREAM}
    for name, module in model.named_modules():
        parent = kinds.get(name.rpartition(".")[0], STREAM)
        leaf = name.rpartition(".")[2]
        if name.startswith("mtp"):
            kind = MTP
        elif isinstance(module, KimiDeltaAttention):
            kind = KDA_PROJ
        elif isinstance(module, GatedMLA):
            kind = MLA_PROJ
        elif isinstance(module, TopkRouter):
            kind = ROUTER
        elif isinstance(module, MoE):
            kind = DISPATCH
        elif parent == DISPATCH:
            kind = {"routed_down": LATENT, "routed_up": LATENT, "latent_norm": LATENT,
                    "shared_experts": SHARED}.get(leaf, DISPATCH)
        elif isinstance(module, GLUMLP) and parent == STREAM:
            kind = FFN
        elif isinstance(module, DecoderLayer):
            kind = STREAM
        elif leaf in ("input_layernorm", "post_attention_layernorm"):
            kind = NORMS
        else:
            kind = kinds.get(name, parent)
        kinds[name or "<root>"] = kind
    return kinds


def dense_module_kinds(model: nn.Module) -> dict[str, str]:
    kinds = {"<root>": HEAD, "head": HEAD, "norm": HEAD, "embed": STREAM, "blocks": STREAM}
    for name, _ in model.named_modules():
        leaf = name.rpartition(".")[2]
        if name.startswith("blocks."):
            kinds[name] = {"attn_norm": NORMS, "ffn_norm": NORMS, "qkv": ATTN_PROJ, "o": ATTN_PROJ}.get(leaf, FFN)
    return kinds  # a DenseBlock's own ops are the SwiGLU product and the residual adds (which save nothing)


def kind_of(stack: tuple[str, ...], kinds: dict[str, str]) -> str:
    """The kind of a saved tensor from the census stack at the time it was saved."""
    module = next((s for s in reversed(stack) if not s.startswith("@")), "<root>")
    region = stack[-1] if stack and stack[-1].startswith("@") else None
    kind = kinds[module]
    if region == "@attention core":
        return ATTN_CORE
    if region == "@KDA core":
        return KDA_CORE
    if kind == MTP or region == "@MTP loss":
        return MTP
    if region == "@experts":
        return EXPERTS
    if region == "@LM loss":
        return HEAD
    return kind


# ---- the two models -----------------------------------------------------------------------------------------------

def _batch(vocab: int, batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(1))


def _kinds_total(census: SavedTensorCensus, kinds: dict[str, str]) -> dict[str, int]:
    totals = dict.fromkeys(KINDS, 0)
    for stack, nbytes in census.by_stack.items():
        totals[kind_of(stack, kinds)] += nbytes
    return totals


def k3_census(cfg: ModelConfig, batch: int, seq_len: int) -> dict:
    """Saved bytes by kind of one k3 training forward + loss (bench/train.py's step: LM + 0.3 MTP loss); the
    KDA core's bytes are replaced by `kda_core_bytes_per_token`'s count."""
    from openk3.model.kda import configure_kda

    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).train()
    configure_kda(model, backend="triton")
    ids = _batch(cfg.vocab_size, batch, seq_len)
    census = SavedTensorCensus(model)
    with census, cuda_code_paths(census), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids[:, :-1], return_logits=False)  # the head applied inside the fused loss, as `lm_losses`
        with census.region("LM loss"):
            lm = linear_cross_entropy(out.head_inputs.flatten(0, 1), model.lm_head.weight, ids[:, 1:].flatten())
        with census.region("MTP loss"):
            mtp = linear_cross_entropy(out.mtp_head_inputs[0].flatten(0, 1), model.lm_head.weight,
                                       ids[:, 2:].flatten())
        (lm + MTP_WEIGHT * mtp).detach()
    kinds = _kinds_total(census, k3_module_kinds(model))
    tokens = batch * seq_len
    cpu_chunked = kinds[KDA_CORE]
    K = cfg.kda_head_dim
    kinds[KDA_CORE] = round(tokens * len(cfg.kda_layers) * kda_core_bytes_per_token(cfg.kda.num_heads, K, K, 2, 2))
    return {"tokens": tokens, "kinds": kinds, "weight_copies": census.weight_copies,
            "kda_core_cpu_chunked": cpu_chunked, "params": sum(p.numel() for p in model.parameters())}


def load_train_bench():
    spec = importlib.util.spec_from_file_location("bench_train", HERE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense_census(cfg: ModelConfig, batch: int, seq_len: int, loss: str = "fused") -> dict:
    """The same for bench/train.py's dense model of k3's active size, with its step's loss (`dense_loss`: "fused",
    the loss k3's step uses, or "plain" CE on full logits, outside autocast)."""
    train_bench = load_train_bench()
    torch.manual_seed(0)
    model, meta = train_bench.dense_like(cfg)
    ids = _batch(cfg.vocab_size, batch, seq_len)
    census = SavedTensorCensus(model)
    with census, cuda_code_paths(census), census.region("LM loss"), patch.object(train_bench, "DEVICE", "cpu"):
        train_bench.dense_loss(model, ids, loss).detach()
    return {"tokens": batch * seq_len, "kinds": _kinds_total(census, dense_module_kinds(model)),
            "weight_copies": census.weight_copies, "ffn": meta["ffn"],
            "params": sum(p.numel() for p in model.parameters())}


# ---- per token, the GPU's peak, the table -------------------------------------------------------------------------

def per_token(small: dict, large: dict) -> dict:
    """Bytes per token by kind as the slope between two token counts (so per-step constants, e.g. the grouped
    GEMM's padding rows, drop out), and those constants at the larger count."""
    dt = large["tokens"] - small["tokens"]
    slope = {k: (large["kinds"][k] - small["kinds"][k]) / dt for k in KINDS}
    constant = sum(large["kinds"].values()) - sum(slope.values()) * large["tokens"]
    return {"per_token": slope, "constant_bytes": constant}


def without_cores(kinds: dict[str, float]) -> float:
    return sum(v for k, v in kinds.items() if k not in CORES)


def predicted_peak(params: int, weight_copies: int, constant: float, per_token_bytes: float, tokens: int,
                   loss_transient: float) -> float:
    """torch.cuda.max_memory_allocated of an AdamW step, in bytes, at the end of forward / start of backward (where
    the saved activations are all alive): fp32 weights and AdamW's two fp32 moments (12 B per parameter; the
    gradients are None after zero_grad(set_to_none=True)), autocast's bf16 weight copies that backward holds, the
    saved activations, and the loss's transient buffers (`ce_transient` or `fused_ce_transient`)."""
    return 12 * params + weight_copies + constant + per_token_bytes * tokens + loss_transient


def ce_transient(vocab: int, tokens: int, logits_alive: bool) -> float:
    """F.cross_entropy on [tokens, vocab] logits: its backward's two fp32 [tokens, vocab] buffers (the gradient of
    the log-softmax output and of its input); `logits_alive`: the step still holds its bf16 logits (bench/train.py's
    dense step keeps them in a local)."""
    return 8 * vocab * tokens + (2 * vocab * tokens if logits_alive else 0)


def fused_ce_transient(vocab: int, hidden: int, tokens: int) -> float:
    """openk3.ops.loss.linear_cross_entropy on a GPU (the k3 step's `lm_losses`; its saved gradients grad_hidden
    [tokens, hidden] and grad_weight [vocab, hidden] fp32 are in the census): the larger of its forward's per-chunk
    buffers (the chunk's bf16 logits, which the Triton kernel turns into their gradient in place:
    CHUNK_LOGITS_BYTES, or less for fewer tokens; the weight's bf16 copy: 2 B per [vocab, hidden] element) and its
    backward's grad_output-scaled copies of the two stored gradients (fp32)."""
    forward = min(CHUNK_LOGITS_BYTES, 2 * tokens * vocab) + 2 * vocab * hidden
    backward = 4 * (tokens + vocab) * hidden
    return max(forward, backward)


def measure(cfg: ModelConfig, batch: int, seq_len: int, gpu_tokens: int) -> dict:
    out = {}
    fused = fused_ce_transient(cfg.vocab_size, cfg.hidden_size, gpu_tokens)
    transients = {"k3": fused, "dense": fused, "dense_plain_ce": ce_transient(cfg.vocab_size, gpu_tokens,
                                                                               logits_alive=False)}
    censuses = {"k3": k3_census, "dense": dense_census,
                "dense_plain_ce": lambda *a: dense_census(*a, loss="plain")}
    for name, census in censuses.items():
        start = time.perf_counter()
        small, large = census(cfg, batch, seq_len // 2), census(cfg, batch, seq_len)
        row = per_token(small, large) | {k: v for k, v in large.items() if k not in ("kinds", "tokens")}
        total = sum(row["per_token"].values())
        row["total_per_token"] = total
        row["total_per_token_without_cores"] = without_cores(row["per_token"])
        row["predicted_peak_gib"] = predicted_peak(row["params"], row["weight_copies"], row["constant_bytes"], total,
                                                   gpu_tokens, transients[name]) / 2**30
        row["loss_transient_gib"] = transients[name] / 2**30
        row["seconds"] = time.perf_counter() - start
        out[name] = row
    out["ratio"] = out["k3"]["total_per_token"] / out["dense"]["total_per_token"]
    out["ratio_without_cores"] = out["k3"]["total_per_token_without_cores"] / out["dense"][
        "total_per_token_without_cores"]
    out["predicted_peak_ratio"] = out["k3"]["predicted_peak_gib"] / out["dense"]["predicted_peak_gib"]
    out["predicted_peak_ratio_vs_plain_ce"] = out["k3"]["predicted_peak_gib"] / out["dense_plain_ce"][
        "predicted_peak_gib"]
    return out


def print_table(result: dict) -> None:
    env = result["env"]
    k3, dense = result["k3"], result["dense"]
    print(f"{env}\n\nSaved for backward, bytes per token (slope between {env['batch']} x {env['seq_len'] // 2} and "
          f"{env['batch']} x {env['seq_len']} tokens), CPU bf16 autocast through the CUDA code paths\n")
    print(f"| module kind | {env['preset']} | dense (ffn {dense['ffn']}) |\n|---|---|---|")
    for kind in KINDS:
        a, b = k3["per_token"][kind], dense["per_token"][kind]
        if round(a) or round(b):
            print(f"| {kind} | {a:,.0f} | {b:,.0f} |")
    print(f"| **total** | {k3['total_per_token']:,.0f} | {dense['total_per_token']:,.0f} |")
    print(f"| total without the attention cores | {k3['total_per_token_without_cores']:,.0f} | "
          f"{dense['total_per_token_without_cores']:,.0f} |")
    print(f"\nk3 / dense: {result['ratio']:.2f}x, {result['ratio_without_cores']:.2f}x without the attention cores."
          f"\nPredicted GPU peak at {env['gpu_tokens']:,} tokens (AdamW, `predicted_peak`): {env['preset']} "
          f"{k3['predicted_peak_gib']:.1f} GiB, dense {dense['predicted_peak_gib']:.1f} GiB "
          f"({result['predicted_peak_ratio']:.2f}x; both with the fused loss); the dense model with plain logits + "
          f"cross-entropy {result['dense_plain_ce']['predicted_peak_gib']:.1f} GiB "
          f"({result['predicted_peak_ratio_vs_plain_ce']:.2f}x).")


def main() -> None:
    parser = argparse.ArgumentParser(description="activation memory per module kind (see the module docstring)")
    parser.add_argument("--preset", default="k3-debug", choices=sorted(PRESETS))
    parser.add_argument("--batch-size", type=int_at_least(1), default=1)
    parser.add_argument("--seq-len", type=int_at_least(4), default=512,
                        help="the larger of the two lengths measured (even)")
    parser.add_argument("--gpu-tokens", type=int_at_least(1), default=8 * 4096, help="tokens of the predicted GPU step")
    parser.add_argument("--threads", type=int_at_least(1), default=None)
    parser.add_argument("--out", type=Path, default=HERE / "activation_memory.json")
    args = parser.parse_args()
    if args.seq_len % 2:
        parser.error(f"--seq-len must be even, got {args.seq_len}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = get_preset(args.preset)
    env = {"preset": args.preset, "batch": args.batch_size, "seq_len": args.seq_len, "gpu_tokens": args.gpu_tokens,
           "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d")}
    result = {"env": env} | measure(cfg, args.batch_size, args.seq_len, args.gpu_tokens)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
