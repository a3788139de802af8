"""Feed-forward blocks: dense GLU FFN and (Stable Latent) MoE (SPEC-K3 §5)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.common import FusableLinears, KeepFp32, RMSNorm, linear, linear_concat, out_std, shared_cast
from openk3.ops.activations import apply_glu, glu_activation
from openk3.ops.moe import Routing, experts_forward, routing_with, sigmoid_topk_routing
from openk3.ops.norms import acc_dtype, fp32_island


def _act(cfg: ModelConfig):
    return glu_activation(cfg.activation, cfg.situ_beta_gate, cfg.situ_beta_up)


class GLUMLP(FusableLinears, nn.Module):
    """down_proj(act(gate_proj x, up_proj x)); act = SiTU-GLU (K3) or SwiGLU (Kimi Linear).
    gate_proj, up_proj [I, D]; down_proj [D, I]. Used for the dense FFN and the shared experts. The two
    projections run as one product ([gate | up], `linear_concat`; fused for inference: `fused["gate_up"]`). With
    fusable=False a wider product reads them, whose module fuses them (the LatentMoE's shared expert)."""

    def __init__(self, cfg: ModelConfig, dim: int, hidden: int, fusable: bool = True):
        super().__init__()
        self.gate_proj = linear(dim, hidden, cfg.init_std)
        self.up_proj = linear(dim, hidden, cfg.init_std)
        self.down_proj = linear(hidden, dim, out_std(cfg))
        self.act = _act(cfg)
        self.fusable = fusable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(x))

    def projections(self) -> list[nn.Linear]:
        """The Linears that read the FFN's input, in the order of `down`'s packed input: gate, up."""
        return [self.gate_proj, self.up_proj]

    def fusion_groups(self) -> dict[str, list[nn.Linear]]:
        return {"gate_up": self.projections()} if self.fusable else {}

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> `down`'s packed input [..., 2I] = [gate | up]: one product."""
        return linear_concat(x, self.projections(), self.fused.get("gate_up"))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The FFN's output from its packed projections gate_up [..., 2I] = [gate | up] (computed by `forward`, or
        by a caller inside a wider product)."""
        return self.down_proj(apply_glu(self.act, gate_up))


class TopkRouter(KeepFp32, nn.Module):
    """Sigmoid router. weight [E, D] (fp32); buffer e_score_correction_bias [E] (fp32, used for selection only,
    never trained by gradient: Quantile Balancing updates it). In training mode the detached sigmoid scores of the
    last forward are kept in `last_scores` [tokens, E]."""

    _fp32_names = ("weight", "e_score_correction_bias")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.routed_scaling_factor, self.renormalize = moe.routed_scaling_factor, moe.renormalize
        self.weight = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, dtype=torch.float32))
        nn.init.normal_(self.weight, mean=0.0, std=cfg.init_std)
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        self.last_scores: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, D] -> Routing(weights [N,k], indices [N,k], scores [N,E])."""
        acc = acc_dtype(x.dtype)
        with fp32_island(x):  # fp32 logits under a bf16 autocast too: near-ties decide the top-k
            logits = torch.nn.functional.linear(x.to(acc), self.weight.to(acc))
        routing = sigmoid_topk_routing(
            logits, self.e_score_correction_bias, self.top_k,
            renormalize=self.renormalize, scaling=self.routed_scaling_factor,
        )
        if self.training:
            self.last_scores = routing.scores.detach()
        return routing


@contextmanager
def pinned_routing(model: nn.Module, choices: list[torch.Tensor] | None = None) -> Iterator[list[torch.Tensor]]:
    """Take the routers' near-ties out of a comparison of two runs (bf16 against fp32, quantized against not).

    With choices=None, every TopkRouter's expert indices are recorded, in call order, into the yielded list; with
    a list recorded so, the routers take those choices in the same order (combine weights from their own scores).
    A randomly initialised router scores all experts nearly alike, so bf16 rounding alone changes many tokens'
    expert sets and with them the logits; pinned, only the arithmetic differs (bench/gpu_checks.py)."""
    recorded = [] if choices is None else choices
    replay = iter(recorded)

    def hook(router: TopkRouter, args, routing: Routing) -> Routing | None:
        if choices is None:
            recorded.append(routing.indices.detach().clone())
            return None
        return routing_with(routing.scores, next(replay).to(routing.indices.device),
                            renormalize=router.renormalize, scaling=router.routed_scaling_factor)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopkRouter)]
    try:
        yield recorded
    finally:
        for h in handles:
            h.remove()


@contextmanager
def decisive_routing(model: nn.Module, spacing: float = 2.0) -> Iterator[None]:
    """Inside, every router's selection bias is set to distinct values `spacing` apart (a random order per layer),
    so that each picks the same experts for every token whatever bf16 rounding does to the scores (sigmoid, in
    (0, 1)): a random-init router's near-ties would otherwise flip experts between two correct runs
    (bench/RESULTS.md). In place, so captured CUDA graphs see it too; unlike `pinned_routing` it needs no
    reference run, so two engines stepping in different orders and batch shapes can be compared."""
    gen = torch.Generator().manual_seed(0)
    routers = [m for m in model.modules() if isinstance(m, TopkRouter)]
    kept = [r.e_score_correction_bias.clone() for r in routers]
    for r in routers:
        r.e_score_correction_bias.copy_(torch.randperm(r.num_experts, generator=gen).float() * spacing)
    try:
        yield
    finally:
        for r, bias in zip(routers, kept):
            r.e_score_correction_bias.copy_(bias)


class Experts(nn.Module):
    """E routed experts as 3-D weights (HF's layout): gate_up_proj [E, 2I, Din] (rows [:I] gate, [I:] up),
    down_proj [E, Dout, I]. Din = Dout = the latent width (LatentMoE) or hidden_size (plain MoE)."""

    def __init__(self, cfg: ModelConfig, dim: int):
        super().__init__()
        E, inter = cfg.moe.num_experts, cfg.moe.expert_hidden
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, dim))
        self.down_proj = nn.Parameter(torch.empty(E, dim, inter))
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=cfg.init_std)
        nn.init.normal_(self.down_proj, mean=0.0, std=out_std(cfg) if cfg.moe.latent_dim is None else cfg.init_std)
        self.act = _act(cfg)

    def muon_blocks(self) -> dict[str, str]:
        """Muon orthogonalises each expert's matrices on their own (SPEC §6): one block per expert."""
        return {"gate_up_proj": "experts", "down_proj": "experts"}

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return experts_forward(x, routing.indices, routing.weights, self.gate_up_proj, self.down_proj, self.act)


class MoE(FusableLinears, nn.Module):
    """Stable LatentMoE (moe.latent_dim set) or plain MoE (latent_dim None, Kimi Linear):

        out = routed_up( latent_norm( sum_k p_k Expert_k( routed_down(x) ) ) ) + shared_experts(x)

    gate: TopkRouter on full-width x. routed_down [L, D], routed_up [D, L], latent_norm.weight [L] (when
    moe.latent_norm). shared_experts: one GLUMLP of hidden expert_hidden * num_shared_experts at full width.
    The LatentMoE runs routed_down and the shared expert's gate and up as one product (fused for inference:
    `fused["input"]`); the plain MoE's shared expert runs its own (`GLUMLP.gate_up`).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        D = cfg.hidden_size
        self.gate = TopkRouter(cfg)
        self.latent_dim = moe.latent_dim
        if moe.latent_dim is not None:
            self.routed_down = linear(D, moe.latent_dim, cfg.init_std)
            self.latent_norm = RMSNorm(moe.latent_dim, eps=cfg.rms_eps) if moe.latent_norm else None
            self.routed_up = linear(moe.latent_dim, D, out_std(cfg))
        self.experts = Experts(cfg, moe.latent_dim if moe.latent_dim is not None else D)
        self.shared_experts = (
            GLUMLP(cfg, D, moe.expert_hidden * moe.num_shared_experts, fusable=moe.latent_dim is None)
            if moe.num_shared_experts > 0 else None
        )

    def input_linears(self) -> list[nn.Linear]:
        """The LatentMoE's Linears that read x, in the order of its product's columns: routed_down, then the shared
        expert's gate and up."""
        return [self.routed_down] + (self.shared_experts.projections() if self.shared_experts is not None else [])

    def fusion_groups(self) -> dict[str, list[nn.Linear]]:
        return {} if self.latent_dim is None else {"input": self.input_linears()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.gate(flat)  # the router reads x itself (fp32 routing under autocast too)
        shared = self.shared_experts
        if self.latent_dim is None:  # the experts read x; with the shared expert, views of one autocast copy
            to_experts, *to_shared = shared_cast(flat, 1 + (shared is not None))
            y = self.experts(to_experts, routing)
            gate_up = shared.gate_up(to_shared[0]) if shared is not None else None
        else:  # routed_down and the shared expert's gate and up: one product (`linear_concat`)
            h = linear_concat(flat, self.input_linears(), self.fused.get("input"))
            latent, gate_up = h.split([self.latent_dim, h.shape[-1] - self.latent_dim], dim=-1)
            y = self.experts(latent, routing)
            if self.latent_norm is not None:
                y = self.latent_norm(y)
            y = self.routed_up(y)
        if shared is not None:
            y = y + shared.down(gate_up)
        return y.view(shape)
