"""The MoonViT-V2-style vision tower and the projector into the language model (SPEC §12).

Input: an `ImageBatch`, several images of different sizes packed into one sequence without padding:
  patches   [L, 3*p*p]   every image's patches in raster order of its patch grid (row by row), images one after
                         the other; a patch is flattened channel-major (c, y, x), so the Linear below is the
                         released Conv2d(3, D, p, stride=p) weight [D, 3, p, p] read as [D, 3*p*p]
  grid_hws  ((h, w), ..) each image's patch grid (rows, columns), sum of h*w = L; h and w multiples of the merge

Tower (`vision_tower.*`, the released names):
  x = patch_embed.proj(patches) + pos_emb(h, w)      the learned [S, S, D] table resized to each image's (h, w)
  every block:  q|k|v = wqkv(norm0(x)) per head; q, k rotated by 2D RoPE; attention only within an image
                x = x + wo(attention);  x = x + mlp.fc1(gelu_tanh(mlp.fc0(norm1(x))))
  x = encoder.final_layernorm(x)                     RMSNorm everywhere, no biases
Projector (`mm_projector.*`):
  each 2x2 block of a grid becomes one token [x(r,c) | x(r,c+1) | x(r+1,c) | x(r+1,c+1)] (space-to-depth, 4D wide)
  token -> post_norm(proj.2(gelu(proj.0(token))))    -> [N, text hidden size], in the order of the blocks' raster
Image tokens per image: (h/2) * (w/2), i.e. (H/28) * (W/28) for an H x W image at patch 14 and merge 2.

2D RoPE (SPEC §12): inv_freq_i = 1 / theta^(4i/d) for i < d/4; the patch at flat index p of a grid w wide sits at
x = p mod w, y = p div w, and the d/2 rotation angles of a head are interleaved [x f_0, y f_0, x f_1, y f_1, ...],
angle j turning the pair (2j, 2j+1). This is the convention of the checkpoint's reference code as NeMo's
(nemo_automodel/components/models/kimi_k3/vision.py) and SGLang's (python/sglang/srt/models/kimi_k3_vl.py) ports
carry it; torchtitan's moonvit.py instead concatenates [rows | columns], which the released weights would not match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import ModelConfig, VisionConfig
from openk3.model.common import RMSNorm, linear
from openk3.ops.norms import acc_dtype


@dataclass
class ImageBatch:
    """Packed images (see the module docstring): patches [L, 3*p*p] and each image's patch grid (h, w)."""

    patches: torch.Tensor
    grid_hws: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        self.grid_hws = tuple((int(h), int(w)) for h, w in self.grid_hws)
        if self.patches.ndim != 2 or self.patches.shape[0] != sum(h * w for h, w in self.grid_hws):
            raise ValueError(f"patches {list(self.patches.shape)} do not hold the {self.num_patches} patches of "
                             f"the grids {list(self.grid_hws)}")

    @property
    def num_patches(self) -> int:
        return sum(h * w for h, w in self.grid_hws)

    def token_counts(self, merge_size: int) -> list[int]:
        """Image tokens per image after the merge_size x merge_size merge."""
        return [(h // merge_size) * (w // merge_size) for h, w in self.grid_hws]

    def to(self, device: torch.device | str) -> ImageBatch:
        return ImageBatch(self.patches.to(device), self.grid_hws)

    @staticmethod
    def pack(batches: Sequence[ImageBatch]) -> ImageBatch:
        """One batch holding the images of `batches` in order (no padding)."""
        if not batches:
            raise ValueError("pack needs at least one ImageBatch")
        return ImageBatch(torch.cat([b.patches for b in batches]), tuple(g for b in batches for g in b.grid_hws))


# ---- the math, as plain functions ------------------------------------------------------------------------------

def rope_2d_angles(h: int, w: int, head_dim: int, theta: float, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotation angles [h*w, head_dim/2] of an h x w patch grid, interleaved [x f_0, y f_0, x f_1, y f_1, ...]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device, dtype=dtype) / head_dim)
    p = torch.arange(h * w, device=device)
    x, y = (p % w).to(dtype), (p // w).to(dtype)
    return torch.stack([torch.outer(x, inv_freq), torch.outer(y, inv_freq)], dim=-1).flatten(1)


def apply_rope_2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [L, H, K] rotated pairwise: (x_2j, x_2j+1) by angles[:, j] (angles [L, K/2]); fp32 math (fp64 for fp64
    inputs), x's dtype out."""
    pairs = x.to(acc_dtype(x.dtype)).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def interpolate_positions(table: torch.Tensor, h: int, w: int, mode: str) -> torch.Tensor:
    """The learned position table [S, S, D] resized to an h x w grid -> [h*w, D] (align_corners=False)."""
    if (h, w) == tuple(table.shape[:2]):
        return table.flatten(0, 1)
    grid = F.interpolate(table.permute(2, 0, 1).unsqueeze(0).to(acc_dtype(table.dtype)), size=(h, w), mode=mode,
                         align_corners=False)
    return grid[0].permute(1, 2, 0).reshape(h * w, -1).to(table.dtype)


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Non-causal attention within each packed sequence: q, k, v [L, H, K], sequence i spans
    [cu_seqlens[i], cu_seqlens[i+1]) -> [L, H, K]. One SDPA call with a block-diagonal boolean mask [L, L]."""
    lengths = cu_seqlens.diff()
    image = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths.to(q.device))
    mask = image.unsqueeze(0) == image.unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """What varlen_attention_reference computes, without the masked-out work: the sequences of one length are
    attended as one batch, one SDPA call per distinct length (a batch of many small images costs sum n_i^2, not
    (sum n_i)^2). The arguments are those of a fused varlen kernel (flash-attn's flash_attn_varlen_func takes q, k,
    v and cu_seqlens): this is the one place to call such a kernel on a GPU."""
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        by_length.setdefault(end - start, []).append(start)
    if len(bounds) == 2:  # one image: plain attention
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    rows, outs = [], []
    for n, starts in by_length.items():
        idx = (torch.tensor(starts, device=q.device).unsqueeze(1) + torch.arange(n, device=q.device)).flatten()
        group = [t[idx].unflatten(0, (len(starts), n)).transpose(1, 2) for t in (q, k, v)]  # [G, H, n, K]
        outs.append(F.scaled_dot_product_attention(*group).transpose(1, 2).flatten(0, 1))
        rows.append(idx)
    return torch.empty_like(q).index_copy(0, torch.cat(rows), torch.cat(outs))


def patch_merge(x: torch.Tensor, grid_hws: Sequence[tuple[int, int]], merge: int) -> torch.Tensor:
    """Space-to-depth: x [L, D] (packed grids) -> [sum (h/m)(w/m), m*m*D]; the merge x merge block at block row r,
    block column c becomes one token, its patches concatenated in raster order (dy, dx)."""
    out, start = [], 0
    for h, w in grid_hws:
        grid = x[start:start + h * w].view(h // merge, merge, w // merge, merge, x.shape[-1])
        out.append(grid.permute(0, 2, 1, 3, 4).reshape(-1, merge * merge * x.shape[-1]))
        start += h * w
    return torch.cat(out)


# ---- modules (parameter names are the released checkpoint's) ----------------------------------------------------

class PositionTable(nn.Module):
    """patch_embed.pos_emb.weight [S, S, D]: one learned vector per cell of an S x S patch grid."""

    def __init__(self, size: int, dim: int, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, size, dim))
        nn.init.normal_(self.weight, mean=0.0, std=std)


class PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig, std: float):
        super().__init__()
        self.proj = linear(3 * vc.patch_size ** 2, vc.hidden_size, std)
        self.pos_emb = PositionTable(vc.pos_emb_size, vc.hidden_size, std)
        self.interpolation = vc.pos_emb_interpolation

    def forward(self, images: ImageBatch) -> torch.Tensor:
        x = self.proj(images.patches.to(self.proj.weight.dtype))
        table = self.pos_emb.weight
        return x + torch.cat([interpolate_positions(table, h, w, self.interpolation) for h, w in images.grid_hws])


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig, std: float, out_std: float):
        super().__init__()
        self.fc0 = linear(vc.hidden_size, vc.intermediate_size, std)
        self.fc1 = linear(vc.intermediate_size, vc.hidden_size, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm block: norm0, wqkv [3*H*K, D] (rows: all q heads, all k heads, all v heads), wo, norm1, mlp."""

    def __init__(self, vc: VisionConfig, std: float, out_std: float):
        super().__init__()
        self.num_heads, self.head_dim = vc.num_heads, vc.head_dim
        width = vc.num_heads * vc.head_dim
        self.norm0 = RMSNorm(vc.hidden_size, eps=vc.norm_eps)
        self.wqkv = linear(vc.hidden_size, 3 * width, std)
        self.wo = linear(width, vc.hidden_size, out_std)
        self.norm1 = RMSNorm(vc.hidden_size, eps=vc.norm_eps)
        self.mlp = VisionMLP(vc, std, out_std)

    def muon_blocks(self) -> dict[str, str]:
        """Per-head Muon blocks (as the text attention's): wqkv by head rows (3H heads), wo by head columns."""
        return {"wqkv.weight": f"rows:{3 * self.num_heads}", "wo.weight": f"cols:{self.num_heads}"}

    def forward(self, x: torch.Tensor, angles: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        L = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(L, 3, self.num_heads, self.head_dim).unbind(1)
        out = varlen_attention(apply_rope_2d(q, angles), apply_rope_2d(k, angles), v, cu_seqlens)
        x = x + self.wo(out.reshape(L, -1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, vc: VisionConfig, std: float, out_std: float):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(vc, std, out_std) for _ in range(vc.num_layers))
        self.final_layernorm = RMSNorm(vc.hidden_size, eps=vc.norm_eps)


class VisionTower(nn.Module):
    """vision_tower.*: patch_embed.{proj, pos_emb}, encoder.{blocks.N.*, final_layernorm}."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        vc = cfg.vision
        self.config = vc
        std = cfg.init_std
        self.patch_embed = PatchEmbed(vc, std)
        self.encoder = VisionEncoder(vc, std, std / math.sqrt(2 * vc.num_layers))

    def forward(self, images: ImageBatch) -> torch.Tensor:
        """images -> encoded patches [L, D] (packed like the input)."""
        vc, device = self.config, images.patches.device
        x = self.patch_embed(images)
        dtype = acc_dtype(x.dtype)
        angles = torch.cat([rope_2d_angles(h, w, vc.head_dim, vc.rope_theta, device, dtype)
                            for h, w in images.grid_hws])
        lengths = torch.tensor([0] + [h * w for h, w in images.grid_hws], device=device)
        cu_seqlens = lengths.cumsum(0)
        for block in self.encoder.blocks:
            x = block(x, angles, cu_seqlens)
        return self.encoder.final_layernorm(x)


class MMProjector(nn.Module):
    """mm_projector.*: proj.0 [4D, 4D], GELU (erf), proj.2 [hidden, 4D], post_norm [hidden] (no biases)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        vc = cfg.vision
        self.merge_size = vc.merge_size
        self.proj = nn.Sequential(linear(vc.merged_size, vc.merged_size, 1 / math.sqrt(vc.merged_size)), nn.GELU(),
                                  linear(vc.merged_size, cfg.hidden_size, 1 / math.sqrt(vc.merged_size)))
        self.post_norm = RMSNorm(cfg.hidden_size, eps=vc.projector_eps)

    def forward(self, patches: torch.Tensor, grid_hws: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Encoded patches [L, D] -> image tokens [N, hidden] (N = sum (h/m)(w/m))."""
        return self.post_norm(self.proj(patch_merge(patches, grid_hws, self.merge_size)))
