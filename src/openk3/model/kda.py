"""Kimi Delta Attention layer (SPEC-K3 §2), K3 variant and Kimi Linear variant by config."""

from __future__ import annotations

import math

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.common import (
    FusableLinears,
    KeepFp32,
    RMSNorm,
    ShortConv,
    linear,
    linear_concat,
    linear_split,
    out_std,
    shared_cast,
)
from openk3.model.documents import Documents
from openk3.ops.conv import causal_conv1d, causal_conv1d_step, conv_window_after, conv_windows
from openk3.ops.fused import use_triton
from openk3.ops.gates import k3_gate, kimi_gate
from openk3.ops.kda import BACKENDS, kda, resolve_backend
from openk3.ops.norms import acc_dtype, gated_rms_norm, l2_norm


class KimiDeltaAttention(FusableLinears, KeepFp32, nn.Module):
    """KDA token mixer. D = hidden_size, H = num_heads, K = V = head_dim, W = conv kernel.

    Parameters (names follow HF / the Kimi Linear hub checkpoint; [out, in] for Linear weights):
      q_proj, k_proj   [H*K, D]   rows h*K:(h+1)*K belong to head h
      v_proj           [H*V, D]   rows per head likewise
      q_conv1d, k_conv1d, v_conv1d .weight [H*K, 1, W]   (K3 / kda.fused_conv=False: one conv per projection)
      conv1d.weight    [2*H*K + H*V, 1, W]  channels q|k|v (kda.fused_conv=True: HF transformers' runtime layout,
                                            the concatenation of the three above along dim 0)
      f_a_proj         [K, D]     forget gate, low rank (shared by heads)
      f_b_proj         [H*K, K]   rows per head
      A_log            [H] fp32   init log U(1, 16). HF Kimi Linear stores it as [1, 1, H, 1]: same values,
                                  `A_log.reshape(-1)` to load, `.view(1, 1, H, 1)` to save.
      dt_bias          [H*K] fp32 per head and channel, head-major; init 0 (K3) / inverse softplus of
                                  U(1e-3, 1e-1) (Kimi Linear, fla's init)
      b_proj           [H, D]     beta = sigmoid(b_proj x), row h for head h
      g_proj           [H*V, D]   K3 full-rank output gate (kda.output_gate="full"), rows per head
      g_a_proj, g_b_proj [K, D], [H*V, K]  Kimi Linear low-rank output gate (kda.output_gate="lowrank")
      o_norm.weight    [V]        per-head RMSNorm of the KDA output (eps = rms_eps), shared by heads
      o_proj           [D, H*V]   columns h*V:(h+1)*V read head h
    Forward: q, k, v = SiLU(conv(proj(x))); q, k L2-normalised per head (fp32); g = gate(f_b(f_a(x))) (fp32);
    beta = sigmoid(b_proj x); o = KDA(q, k, v, g, beta) with scale K^-0.5;
    y = o_proj( RMSNorm_head(o) * sigmoid(output gate) ).
    Fused for inference (`fuse_projections`, the serving engine's start-up): the six Linears that read x
    (`input_linears`) in one buffer, `fused["input"]`.
    """

    _fp32_names = ("A_log", "dt_bias")

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        kc = cfg.kda
        D, H, K = cfg.hidden_size, kc.num_heads, cfg.kda_head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.v_head_dim = H, K, K
        self.gate_kind, self.lower_bound = kc.gate, kc.gate_lower_bound
        self.fused_conv, self.output_gate = kc.fused_conv, kc.output_gate
        self.kda_backend = "auto"  # configure_kda sets it for a whole model
        std = cfg.init_std
        self.q_proj = linear(D, H * K, std)
        self.k_proj = linear(D, H * K, std)
        self.v_proj = linear(D, H * K, std)
        if kc.fused_conv:
            self.conv1d = ShortConv(3 * H * K, kc.conv_kernel)
        else:
            self.q_conv1d = ShortConv(H * K, kc.conv_kernel)
            self.k_conv1d = ShortConv(H * K, kc.conv_kernel)
            self.v_conv1d = ShortConv(H * K, kc.conv_kernel)
        self.f_a_proj = linear(D, K, std)
        self.f_b_proj = linear(K, H * K, std)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32).uniform_(1.0, 16.0).log())
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))
        if kc.gate == "kimi":  # fla / HF init: dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1)
            with torch.no_grad():
                dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.b_proj = linear(D, H, std)
        if kc.output_gate == "full":
            self.g_proj = linear(D, H * K, std)
        else:
            self.g_a_proj = linear(D, K, std)
            self.g_b_proj = linear(K, H * K, std)
        self.o_norm = RMSNorm(K, eps=cfg.rms_eps)
        self.o_proj = linear(H * K, D, out_std(cfg))

    def conv_weight(self) -> torch.Tensor:
        """[2HK+HV, W]: the q|k|v conv kernels as one depthwise kernel (the fused and separate layouts alike)."""
        if self.fused_conv:
            return self.conv1d.weight.squeeze(1)
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., 2HK+HV]: the q, k and v projections of x (q|k|v along the last dim) as one matrix
        product, whose output is the conv's input as it stands (three products would be concatenated: a copy of it
        each way, and three smaller GEMMs)."""
        return linear_concat(x, [self.q_proj, self.k_proj, self.v_proj], self._fused_input(qkv=True))

    def muon_blocks(self) -> dict[str, str]:
        """Per-head Muon blocks (SPEC §6) of this layer's matrices, by parameter name: the q/k/v projections by
        head rows ("rows:H"), o_proj by head columns ("cols:H"). The gates' matrices are orthogonalised whole."""
        H = self.num_heads
        return {"q_proj.weight": f"rows:{H}", "k_proj.weight": f"rows:{H}", "v_proj.weight": f"rows:{H}",
                "o_proj.weight": f"cols:{H}"}

    def gate_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B,T,D] -> (f [B,T,H,K], the forget gate's logits; b [B,T,H], beta's; the output gate's [B,T,H*V]):
        the three products of x (the gates' first matrices, `input_linears()[3:]`) as one (`linear_split`), then the
        low-rank second matrices."""
        B, T, _ = x.shape
        b, f_low, gate = linear_split(x, self.input_linears()[3:], self._fused_input(qkv=False))
        if self.output_gate != "full":
            gate = self.g_b_proj(gate)
        return self.f_b_proj(f_low).view(B, T, self.num_heads, self.head_dim), b, gate

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,T,D] -> f [B,T,H,K], the forget gate before its activation."""
        B, T, _ = x.shape
        return self.f_b_proj(self.f_a_proj(x)).view(B, T, self.num_heads, self.head_dim)

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,T,D] -> g [B,T,H,K] fp32 log decay."""
        return self._gate(self.gate_logits(x))

    def _gate(self, f: torch.Tensor) -> torch.Tensor:
        if self.gate_kind == "k3":
            return k3_gate(f, self.A_log, self.dt_bias, self.lower_bound)
        return kimi_gate(f, self.A_log, self.dt_bias)

    def activate(self, q, k, x, backend: str):
        """The KDA inputs from the conv outputs q, k and x: L2-normalised q, k, g (fp32) and beta."""
        return self.activate_logits(q, k, self.gate_logits(x), self.b_proj(x), backend)

    def activate_logits(self, q, k, f, b, backend: str):
        """`activate` from the projections of x: the forget gate's logits f [B,T,H,K] and beta's b [B,T,H]. When the
        Triton kernels will run, one Triton pass does all four, forward and backward (bench/NOTES-kda.md run 6)."""
        b = b.to(acc_dtype(f.dtype))
        if backend == "triton":
            from openk3.ops.kda.triton import kda_activations  # triton is an optional dependency

            return kda_activations(q, k, f, b, self.A_log, self.dt_bias, gate=self.gate_kind, g_min=self.lower_bound)
        return l2_norm(q), l2_norm(k), self._gate(f), torch.sigmoid(b)

    def out_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if self.output_gate == "full" else self.g_b_proj(self.g_a_proj(x))

    def input_linears(self) -> list[nn.Linear]:
        """The projections that read the layer's input x, in the order of `fused["input"]`'s rows: q, k, v (`qkv`),
        beta, the forget gate's first matrix, the output gate's (first) matrix (`gate_projections`)."""
        gate = self.g_proj if self.output_gate == "full" else self.g_a_proj
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj, gate]

    def fusion_groups(self) -> dict[str, list[nn.Linear]]:
        """One buffer for the six: a decode step reads x's projections with one matrix-vector product
        (`openk3.model.decode.kda_input_projections`), a prefill with two, q|k|v's and the gates' (row ranges)."""
        return {"input": self.input_linears()}

    def _fused_input(self, qkv: bool) -> torch.Tensor | None:
        """The rows of `fused["input"]` that `qkv` reads (q|k|v, the first 3HK) or else `gate_projections` (the
        rest), a view; None unfused."""
        fused = self.fused.get("input")
        if fused is None:
            return None
        rows = 3 * self.num_heads * self.head_dim
        return fused[:rows] if qkv else fused[rows:]

    def gate_min(self) -> float | None:
        """The lower bound of this layer's gate: K3's g_min; none for Kimi Linear's softplus gate."""
        return self.lower_bound if self.gate_kind == "k3" else None

    def _kda_with_checkpoints(self, q, k, v, g, beta, initial, conv_state, qkv_in, offsets, cache, backend):
        """KDA over the T new tokens, recording the layer's state (conv window and recurrent state) after each of
        `offsets` tokens in the cache, from the same call."""
        o, state, states = kda(q, k, v, g, beta, initial_state=initial, output_final_state=True, backend=backend,
                               gate_min=self.gate_min(), state_offsets=tuple(offsets))
        for end, s in zip(offsets, states):
            cache.record_checkpoint(end, self.layer_idx, conv_window_after(conv_state, qkv_in, end), s)
        return o, state

    def _documents_kda(self, q, k, v, g, beta, documents: Documents, backend: str) -> torch.Tensor:
        """KDA over a packed batch [B,T,...], the state zero at every document start. The Triton kernels run the
        flattened batch varlen (documents.cu_seqlens); the PyTorch backends keep their layout and set the decay to
        exp(-inf) = 0 at each document's first token, which is the same reset: S_t = (I - beta k k^T) Diag(0)
        S_{t-1} + beta k v^T = beta k v^T, what the recurrence gives from a zero state (SPEC-K3 §2), the gate's
        gradient there 0 as it is from a zero state. (`gate_min` is not passed then: it would clamp the -inf; the
        gate is bounded already.)"""
        B, T, H, _ = q.shape
        if backend == "triton":
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
            o, _ = kda(*flat, cu_seqlens=documents.cu_seqlens, backend=backend, gate_min=self.gate_min())
            return o.view(B, T, H, -1)
        g = torch.where(documents.resets.view(B, T, 1, 1), float("-inf"), g)
        return kda(q, k, v, g, beta, backend=backend)[0]

    def forward(self, x: torch.Tensor, cache=None, documents: Documents | None = None) -> torch.Tensor:
        """x [B,T,D] -> [B,T,D]. With a HybridCache, starts from and updates this layer's conv/recurrent state. With
        `documents` (a packed batch, no cache), the conv window and the recurrent state reset at every document
        start (`_documents_kda`)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if documents is not None:
            if cache is not None:
                raise ValueError("packed documents are a training input: pass documents or a cache, not both")
            documents.check(B, T)
        layer_cache = cache.layers[self.layer_idx] if cache is not None else None
        # two products read x (q|k|v, whose output is the conv's input as it stands, and the gates'): under autocast,
        # views of one bf16 copy (each would keep its own for backward). Both run before the first kernel call:
        # compiled, each Triton call (the conv's, KDA's) ends a graph, and x read by several graphs has their
        # gradients summed outside compiled code (an fp32 add and an fp32 copy of the gradient per extra graph:
        # 2.1 ms of k3-debug's compiled step on an H200)
        x_qkv, x_gates = shared_cast(x, 2)
        qkv = qkv_in = self.qkv(x_qkv)  # [B,T,3HK]
        f, b, out_gate = self.gate_projections(x_gates)
        w = self.conv_weight()
        if layer_cache is not None and T == 1:
            y, conv_state = causal_conv1d_step(qkv[:, 0], w, layer_cache.conv_state)
            qkv = y.unsqueeze(1).split(H * K, dim=-1)
        else:  # q, k, v as tensors of their own on CUDA (no copy of each out of q|k|v, nor of their gradients in)
            qkv, conv_state = causal_conv1d(qkv, w, layer_cache.conv_state if layer_cache is not None else None,
                                            groups=3, starts=documents.starts if documents is not None else None)
        q, k, v = (t.reshape(B, T, H, K) for t in qkv)
        backend = resolve_backend(self.kda_backend, x.device, T)
        q, k, g, beta = self.activate_logits(q, k, f, b, backend)
        ragged = cache.num_tokens if cache is not None else None
        if ragged is not None:  # right padding: no decay (g = 0) and no write (beta = 0) keep the state (SPEC §2)
            pad = torch.arange(T, device=x.device) >= ragged.view(B, 1)
            g = g.masked_fill(pad[..., None, None], 0.0)
            beta = beta.masked_fill(pad[..., None], 0.0)
            conv_state = conv_windows(layer_cache.conv_state, qkv_in, ragged)
        initial = layer_cache.recurrent_state if layer_cache is not None else None
        offsets = [t for t in cache.checkpoint_offsets if 0 < t < T] if cache is not None else []
        if documents is not None:
            o, state = self._documents_kda(q, k, v, g, beta, documents, backend), None
        elif offsets:
            o, state = self._kda_with_checkpoints(q, k, v, g, beta, initial, layer_cache.conv_state, qkv_in,
                                                  offsets, cache, backend)
        else:
            o, state = kda(q, k, v, g, beta, initial_state=initial, output_final_state=layer_cache is not None,
                           backend=backend, gate_min=self.gate_min())
        if layer_cache is not None:
            layer_cache.conv_state = conv_state
            layer_cache.recurrent_state = state
            if T in cache.checkpoint_offsets:
                cache.record_checkpoint(T, self.layer_idx, conv_state, state)
        return self.output_gated(out_gate, o, x_gates.dtype)

    def output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x [B,T,D], KDA output o [B,T,H,V] -> o_proj(RMSNorm_head(o) * sigmoid(output gate(x))) [B,T,D]. The norm
        and gate are one Triton pass each way where `ops.fused.use_triton` says so (model.common.RMSNorm's rule),
        keeping o and the gate's input, not their fp32 copies and products."""
        return self.output_gated(self.out_gate(x), o, x.dtype)

    def output_gated(self, gate: torch.Tensor, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`output` from the output gate's logits gate [B,T,H*V] (its projection of x), in `dtype` (x's)."""
        B, T, H, V = o.shape
        gate = gate.view(B, T, H, V)
        if use_triton(o) and use_triton(gate):
            from openk3.ops.triton_norm import gated_rms_norm_triton  # triton is an optional dependency

            o = gated_rms_norm_triton(o, gate, self.o_norm.weight, self.o_norm.eps)
        else:
            o = gated_rms_norm(o, gate, self.o_norm.weight, self.o_norm.eps)
        return self.o_proj(o.to(dtype).reshape(B, T, H * V))


def configure_kda(model: nn.Module, *, backend: str = "auto") -> None:
    """Set the KDA backend ("auto" lets `resolve_backend` choose per call) on every KDA layer of `model`."""
    if backend not in BACKENDS:
        raise ValueError(f"kda backend must be one of {BACKENDS}, got {backend!r}")
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            module.kda_backend = backend
