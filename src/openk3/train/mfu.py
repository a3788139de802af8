"""Model FLOPs utilisation of a training step: the FLOPs a token's forward and backward need, over the GPU's dense
bf16 peak (`openk3 train` on CUDA, and bench/train.py's MFU column).

Per token: 6 x the active matmul parameters (the LM head counted once more per MTP layer: the shared head runs
again), causal attention at half the window (6 x T/2 x heads x (qk + v head dims) per MLA layer, the MTP blocks'
included), and the KDA recurrence's state products (6 x heads x 2 K^2 per KDA layer). With packed documents the
attention is shorter than that; the count stays the window's, an upper bound, so packed and unpacked runs compare.
"""

from __future__ import annotations

import torch

from openk3.accounting import count_parameters
from openk3.config import ModelConfig

# dense bf16 peaks (TFLOP/s, SXM parts) by the name torch.cuda.get_device_name reports; others print no MFU
PEAK_BF16_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "A100": 312.0}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    counts = count_parameters(cfg)
    matmul = counts["active_params"] + counts["mtp_active_params"] - cfg.vocab_size * cfg.hidden_size
    matmul += cfg.mtp_layers * cfg.vocab_size * cfg.hidden_size  # the shared LM head runs once more per MTP layer
    m = cfg.mla
    mla_layers = len(cfg.mla_layers) + cfg.mtp_layers
    attn = 6 * (seq_len / 2) * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * mla_layers
    K = cfg.kda_head_dim
    kda = 6 * cfg.kda.num_heads * 2 * K * K * len(cfg.kda_layers)
    return 6 * matmul + attn + kda


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak (FLOP/s) of a CUDA device named in PEAK_BF16_TFLOPS; None elsewhere."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)
