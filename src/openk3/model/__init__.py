"""nn.Modules of the hybrid K3 model (thin wrappers over openk3.ops)."""

from openk3.model.kda import KimiDeltaAttention, configure_kda
from openk3.model.mla import GatedMLA
from openk3.model.moe import GLUMLP, MoE, TopkRouter
from openk3.model.transformer import DecoderLayer, K3ForCausalLM, K3Model, K3Output, MTPLayer

__all__ = ["K3ForCausalLM", "K3Model", "K3Output", "DecoderLayer", "MTPLayer", "KimiDeltaAttention", "GatedMLA",
           "MoE", "GLUMLP", "TopkRouter", "configure_kda"]
