"""Pure tensor functions (no nn.Module state): the math of SPEC-K3 §2-§5 in plain PyTorch.

Each op is the reference a fast path (Triton, grouped GEMMs) is tested against. Submodules:
norms (RMSNorm, L2 norm), gates (KDA forget gates), conv (short causal conv with a carried state),
activations (SiTU-GLU, SwiGLU), attention (MLA expanded and absorbed), moe (routing, expert compute),
attnres (Block Attention Residuals), kda (Kimi Delta Attention), loss (LM head + cross-entropy, chunked); the
Triton fast paths of the fp32 islands in triton_glu (SiTU-GLU) and triton_norm (RMSNorm + residual add), and fused
(when they run).
"""
