"""OCP Microscaling (MX v1.0) formats for K3's routed experts (SPEC §13): MXFP4 weights, MXFP8 activations.

A block is 32 consecutive values along the last dimension (the input dimension of the matmul they feed). It is
stored as one shared E8M0 scale X = 2^e and 32 elements P_i of the element format, with V_i ~ X * P_i.

Scale (OCP MX v1.0 §6.3): e = floor(log2(max_i |V_i|)) - emax_elem, where emax_elem is the exponent of the
element format's largest normal (2 for E2M1: 6 = 1.5 * 2^2; 8 for E4M3: 448 = 1.75 * 2^8), clamped to E8M0's
range [-127, 127] (an all-zero or tiny block gets e = -127). The E8M0 byte is e + 127; 0xFF is NaN.

Elements: P_i = V_i / X rounded to the nearest element value, ties to the even encoding, magnitudes past the
format's maximum saturated to it (±6 for E2M1, ±448 for E4M3). E2M1 values: {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6};
the 4-bit code is the sign in bit 3 and the E2M1 bit pattern (2 exponent bits, 1 mantissa bit) in bits 0-2, so
code c & 7 indexes [0, 0.5, 1, 1.5, 2, 3, 4, 6]. A negative value that rounds to zero keeps its sign (code 8), as
in torchao; compressed-tensors writes +0 (code 0) for an input of exactly -0.0. Both read back as zero.

NaN / Inf: neither element format can hold them, so a block holding a NaN or ±Inf gets the NaN scale 0xFF (the
OCP rule: a NaN scale makes every element of its block NaN) with element codes 0, and dequantizes to all NaN.
torchao's MX formats give such a block with a NaN the same 0xFF; for ±Inf they instead saturate, which would turn
an overflowed weight into a plausible finite one.

Everything is computed on the fp32 value of the input (bf16 and fp16 convert to fp32 exactly); V_i / X is a
multiplication by a power of two, exact wherever the result can matter. Dequantized values are exact in fp32 and
bf16 (at most two significant bits for E2M1, four for E4M3, exponents within fp32's range).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_EMAX, E2M1_MAX = 2, 6.0
E4M3_EMAX, E4M3_MAX = 8, 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # by 3-bit code
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between codes c and c + 1, c = 0..6


class MXFP4(NamedTuple):
    codes: torch.Tensor  # uint8 [..., n], one 4-bit E2M1 code per value (sign in bit 3)
    scales: torch.Tensor  # uint8 [..., n / 32], biased E8M0 exponents


class MXFP8(NamedTuple):
    elements: torch.Tensor  # float8_e4m3fn [..., n]
    scales: torch.Tensor  # uint8 [..., n / 32]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> fp32 [..., n / 32, 32]."""
    n = x.shape[-1] if x.dim() else 0
    if n % BLOCK:
        raise ValueError(f"MX formats group {BLOCK} values along the last dimension; it has {n} "
                         f"(shape {list(x.shape)}), not a multiple of {BLOCK}")
    if not x.is_floating_point():
        raise ValueError(f"MX quantization takes a floating-point tensor, got {x.dtype}")
    return x.float().reshape(*x.shape[:-1], n // BLOCK, BLOCK)


def _shared_scale(blocks: torch.Tensor, emax_elem: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [..., g, 32] fp32 -> (E8M0 bytes uint8 [..., g], 2^-e fp32 [..., g, 1] to multiply the block by).

    floor(log2(amax)) is amax's fp32 exponent field minus 127. For an fp32-subnormal or zero amax the field is 0,
    which gives an e below -127 that the clamp turns into -127, as the true logarithm would."""
    amax = blocks.abs().amax(-1)
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS - emax_elem
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    finite = torch.isfinite(amax)
    scales = torch.where(finite, exponent + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    # 2^-e as fp32 bits: biased exponent 127 - e lies in [2, 254] (e in [-127, 125]): a normal number
    inverse = ((E8M0_BIAS - exponent.clamp(max=E8M0_BIAS - 2)) << 23).view(torch.float32)
    return scales, inverse.unsqueeze(-1)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(s - 127): the bit pattern s << 23, except s = 0 (2^-127, an fp32 subnormal) and
    s = 0xFF (NaN)."""
    s = scales.to(torch.int32)
    value = (s << 23).view(torch.float32)
    value = torch.where(s == 0, 2.0**-127, value)
    return torch.where(s == E8M0_NAN, float("nan"), value)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by the block scale -> 4-bit E2M1 codes, round to nearest, ties to even,
    saturating at ±6. The magnitude code counts the midpoints passed; at a midpoint between codes c and c + 1 the
    value goes to whichever code is even (up when c + 1 is even, so `>=`; down otherwise, so `>`)."""
    magnitude = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for c, midpoint in enumerate(_E2M1_MIDPOINTS):
        code += (magnitude >= midpoint) if (c + 1) % 2 == 0 else (magnitude > midpoint)
    return code | (torch.signbit(scaled).to(torch.uint8) << 3)


def quantize_mxfp4(x: torch.Tensor) -> MXFP4:
    """x [..., n] (n a multiple of 32) -> MXFP4(codes uint8 [..., n], scales uint8 [..., n / 32])."""
    blocks = _blocks(x)
    scales, inverse = _shared_scale(blocks, E2M1_EMAX)
    codes = _e2m1_codes(blocks * inverse)
    codes = codes.masked_fill((scales == E8M0_NAN).unsqueeze(-1), 0)
    return MXFP4(codes.reshape(x.shape), scales)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> their fp32 E2M1 values."""
    table = torch.tensor(E2M1_MAGNITUDES, device=codes.device)
    table = torch.cat([table, -table])
    return table[codes.long()]


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 codes [..., n] and scales [..., n / 32] -> values [..., n] in `dtype`."""
    values = e2m1_values(codes).reshape(*codes.shape[:-1], -1, BLOCK)
    return (values * e8m0_to_float(scales).unsqueeze(-1)).reshape(codes.shape).to(dtype)


def quantize_mxfp8(x: torch.Tensor) -> MXFP8:
    """x [..., n] -> MXFP8 with E4M3 elements (torch's float8_e4m3fn cast rounds to nearest even; the clamp
    before it saturates at ±448, as OCP asks, whatever the cast does with overflow)."""
    blocks = _blocks(x)
    scales, inverse = _shared_scale(blocks, E4M3_EMAX)
    scaled = (blocks * inverse).clamp(-E4M3_MAX, E4M3_MAX)
    scaled = scaled.masked_fill((scales == E8M0_NAN).unsqueeze(-1), 0.0)
    return MXFP8(scaled.to(torch.float8_e4m3fn).reshape(x.shape), scales)


def dequantize_mxfp8(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = elements.float().reshape(*elements.shape[:-1], -1, BLOCK)
    return (values * e8m0_to_float(scales).unsqueeze(-1)).reshape(elements.shape).to(dtype)


def fake_quant_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype (no gradient: see openk3.quant.qat for the straight-through form)."""
    return dequantize_mxfp4(*quantize_mxfp4(x.detach()), dtype=x.dtype)


def fake_quant_mxfp8(x: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp8(*quantize_mxfp8(x.detach()), dtype=x.dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., n] -> uint8 [..., n / 2]: value 2j in the low nibble, value 2j + 1 in the high nibble
    (compressed-tensors' `mxfp4-pack-quantized`, also torchao's and the OCP-conformant kernels' order)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing two FP4 values per byte needs an even last dimension, got {list(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> 4-bit codes [..., 2m] (inverse of pack_fp4)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] -> compressed-tensors' `mxfp4-pack-quantized` pair (weight_packed uint8 [out, in / 2],
    weight_scale uint8 [out, in / 32]); leading dimensions other than `out` are carried along."""
    codes, scales = quantize_mxfp4(weight)
    return pack_fp4(codes), scales


def unpack_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(weight_packed [out, in / 2], weight_scale [out, in / 32]) -> the weight [out, in] in `dtype`."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"weight_packed and weight_scale must be uint8, got {packed.dtype} and {scales.dtype}")
    width = 2 * packed.shape[-1]
    if packed.shape[:-1] != scales.shape[:-1] or width != BLOCK * scales.shape[-1]:
        raise ValueError(f"weight_packed {list(packed.shape)} holds {width} values per row, so weight_scale needs "
                         f"{list(packed.shape[:-1]) + [width // BLOCK]} (one per {BLOCK}), got {list(scales.shape)}")
    return dequantize_mxfp4(unpack_fp4(packed), scales, dtype)
