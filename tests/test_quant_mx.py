"""MXFP4 / MXFP8 (openk3.quant.mx) against two oracles and the OCP MX v1.0 spec.

Oracles: torchao's MX formats (`torchao.prototype.mx_formats`, FLOOR scaling: OCP §6.3) for quantization,
compressed-tensors (the `mxfp4-pack-quantized` format's own package) for the packed bytes and scales, and an
element-by-element reference written here from the spec (Python floats, nearest table value, ties to the even
encoding). torchao divides blocks whose scale is the smallest E8M0 (2^-127, blocks with max < 2^-124) by 2^-126
instead (a documented shortcut in its code), so those blocks are compared with the other two only."""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_mx

from openk3.quant import (
    dequantize_mxfp4,
    dequantize_mxfp8,
    fake_quant_mxfp4,
    pack_fp4,
    pack_mxfp4,
    quantize_mxfp4,
    quantize_mxfp8,
    unpack_fp4,
    unpack_mxfp4,
)
from openk3.quant.mx import e2m1_values, e8m0_to_float

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---- the spec, element by element --------------------------------------------------------------------------

def spec_scale(block: list[float], emax_elem: int) -> int | None:
    """OCP §6.3: E8M0 byte of floor(log2(max |v|)) - emax_elem, clamped to [-127, 127]; None for NaN/Inf."""
    if any(math.isnan(v) or math.isinf(v) for v in block):
        return None
    amax = max(abs(v) for v in block)
    e = math.frexp(amax)[1] - 1 - emax_elem if amax else -127
    return max(-127, min(127, e)) + 127


def nearest(value: float, table: list[float]) -> int:
    """Index of the table value nearest to |value|, ties to the even index (the even encoding)."""
    return min(range(len(table)), key=lambda i: (abs(table[i] - abs(value)), i % 2))


def spec_mx(x: torch.Tensor, emax: int, largest: float, table: list[float], sign_bit: int
            ) -> tuple[list[list[int]], list[list[int]]]:
    """The OCP MX rule element by element: per 32-block the E8M0 scale (255 for an all-zero / NaN block), each
    element's magnitude rounded to the nearest `table` entry (saturating at `largest`) and its sign bit."""
    codes, scales = [], []
    for row in x.float().tolist():
        row_codes, row_scales = [], []
        for start in range(0, len(row), 32):
            block = row[start:start + 32]
            s = spec_scale(block, emax)
            row_scales.append(255 if s is None else s)
            for v in block:
                magnitude = 0 if s is None else nearest(min(abs(math.ldexp(v, 127 - s)), largest), table)
                row_codes.append(magnitude | (sign_bit if s is not None and math.copysign(1, v) < 0 else 0))
        codes.append(row_codes)
        scales.append(row_scales)
    return codes, scales


def spec_mxfp4(x: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    return spec_mx(x, 2, 6.0, list(E2M1), 8)


def e4m3_table() -> list[float]:
    """The non-negative finite E4M3 values by encoding 0..126 (0x7F is NaN)."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()


def spec_mxfp8(x: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    return spec_mx(x, 8, 448.0, e4m3_table(), 0x80)


# ---- inputs that reach every corner ------------------------------------------------------------------------

def awkward_blocks(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, 96] in `dtype`: each 32-block one kind: random at scales 2^-140 .. 2^126, E2M1 midpoints and their
    fp32 neighbours (ties), maxima past 6 x 2^e (saturation), fp32 subnormals (alone or beside a normal max),
    zeros and -0, values near fp32's max, and random sign flips everywhere."""
    g = torch.Generator().manual_seed(seed)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    blocks = []
    for _ in range(31):
        blocks.append(torch.randn(32, generator=g) * 2.0 ** float(torch.randint(-140, 120, (), generator=g)))
    for e in (-3, 0, 7, 100):
        blocks.append(torch.cat([mids, up, down, mids]) * 2.0**e)
    blocks.append(torch.cat([torch.tensor([7.9, 6.5, -7.0]), torch.rand(29, generator=g) * 8]))  # saturation
    blocks.append(torch.randn(32, generator=g) * 1e-40)  # all fp32 subnormal
    blocks.append(torch.cat([torch.tensor([3.0]), torch.randn(31, generator=g) * 1e-42]))  # flushed to +-0
    blocks.append(torch.randn(32, generator=g) * 2.0**-125)  # max just above the smallest normals
    blocks.append(torch.zeros(32))
    blocks.append(-torch.zeros(32))
    blocks.append(torch.rand(32, generator=g) * 3.4e38)  # near fp32's max
    sign = torch.where(torch.rand(len(blocks), 32, generator=g) < 0.3, -1.0, 1.0)
    x = torch.stack(blocks) * sign
    x = x[torch.randperm(len(x), generator=g)]
    return x.reshape(-1, 96).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_equals_torchao_and_the_spec(dtype):
    x = awkward_blocks(0, dtype)
    codes, scales = quantize_mxfp4(x)
    want_codes, want_scales = spec_mxfp4(x)
    assert scales.tolist() == want_scales and codes.tolist() == want_codes

    ao_scales, ao_packed = to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    assert torch.equal(scales, ao_scales.view(torch.uint8))
    normal = (scales > 0).repeat_interleave(16, dim=-1)  # torchao's 2^-126 shortcut for the smallest scale
    assert normal.float().mean() > 0.8
    assert torch.equal(pack_fp4(codes)[normal], ao_packed.view(torch.uint8)[normal])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_equals_torchao_and_the_spec(dtype):
    x = awkward_blocks(1, dtype)
    elements, scales = quantize_mxfp8(x)
    want_codes, want_scales = spec_mxfp8(x)
    assert scales.tolist() == want_scales and elements.view(torch.uint8).tolist() == want_codes

    ao_scales, ao_elements = to_mx(x.contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
    assert torch.equal(scales, ao_scales.view(torch.uint8))
    normal = (scales > 0).repeat_interleave(32, dim=-1)
    assert torch.equal(elements.view(torch.uint8)[normal], ao_elements.view(torch.uint8)[normal])
    back = dequantize_mxfp8(elements, scales)
    assert torch.equal(back, elements.float() * e8m0_to_float(scales).repeat_interleave(32, dim=-1))


def test_packed_pair_equals_compressed_tensors():
    """weight_packed / weight_scale bytes as compressed-tensors' MXFP4 compressor writes them (given the scale),
    and its decompressor reads ours back to our values; also its bare pack / unpack of E2M1 values."""
    x = awkward_blocks(2)
    packed, scales = pack_mxfp4(x)
    assert packed.shape == (x.shape[0], x.shape[1] // 2) and scales.shape == (x.shape[0], x.shape[1] // 32)
    assert packed.dtype == scales.dtype == torch.uint8
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    ct = MXFP4PackedCompressor.compress({"weight": x, "weight_scale": e8m0_to_float(scales)}, scheme)
    assert torch.equal(ct["weight_scale"], scales)
    # one difference: an input of exactly -0.0 is code 8 (-0) here and in torchao, 0 (+0) in compressed-tensors
    # (its rounding multiplies by torch.sign, which is 0 there); both read back as a zero
    negative_zero = (x == 0) & torch.signbit(x)
    assert negative_zero.any()
    ours, theirs = unpack_fp4(packed), unpack_fp4(ct["weight_packed"])
    assert torch.equal(ours[~negative_zero], theirs[~negative_zero])
    assert (ours[negative_zero] == 8).all() and (theirs[negative_zero] == 0).all()

    ours = unpack_mxfp4(packed, scales, torch.bfloat16)
    theirs = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scales}, scheme)["weight"]
    assert theirs.dtype == torch.bfloat16 and torch.equal(ours.view(torch.int16), theirs.view(torch.int16))

    codes = unpack_fp4(packed)
    assert torch.equal(pack_fp4_to_uint8(e2m1_values(codes)), packed)
    assert torch.equal(unpack_fp4_from_uint8(packed, *codes.shape, dtype=torch.float32), e2m1_values(codes))


def test_spec_vectors():
    """Encodings from the OCP MX v1.0 tables: E2M1 0b0001 = 0.5 (subnormal), 0b0111 = 6, 0b1xxx negative;
    E8M0 0x7F = 1, 0x00 = 2^-127, 0xFE = 2^127, 0xFF = NaN; E4M3 0x7E = 448, 0x08 = 2^-6, 0x01 = 2^-9."""
    assert e2m1_values(torch.arange(16, dtype=torch.uint8)).tolist() == [*E2M1, *(-v for v in E2M1)]
    assert e8m0_to_float(torch.tensor([127, 0, 254, 1], dtype=torch.uint8)).tolist() == [
        1.0, 2.0**-127, 2.0**127, 2.0**-126]
    assert math.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())
    # a block holding every E2M1 value once (max 6: scale 2^0), both signs: codes 0..15 in order
    block = torch.tensor([*E2M1, *(-v for v in E2M1)] * 2)
    codes, scales = quantize_mxfp4(block)
    assert scales.tolist() == [127] and codes.tolist() == list(range(16)) * 2
    assert pack_fp4(codes).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
    elements, scales = quantize_mxfp8(torch.tensor([448.0, 2.0**-6, 2.0**-9, -448.0] * 8))
    assert scales.tolist() == [127] and elements.view(torch.uint8).tolist()[:4] == [0x7E, 0x08, 0x01, 0xFE]


def test_rounding_ties_to_even_and_saturation():
    """With the block max at 6 (scale 1): each midpoint goes to the neighbour with the even encoding, anything
    past 6 saturates to 6, and a negative value that rounds to zero keeps its sign."""
    values = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.2, 0.26, 4.9, 5.1]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, 0.5, 4.0, 6.0]
    x = torch.tensor(values + [0.0] * (32 - len(values)))
    q = fake_quant_mxfp4(x)
    assert q[:len(want)].tolist() == want and torch.signbit(q[9])
    big = torch.tensor([7.99] + [0.0] * 31)  # max 7.99: floor(log2) = 2, scale 1, saturated to 6
    assert fake_quant_mxfp4(big)[0] == 6.0


def test_dequantize_is_exact_for_every_code_and_scale():
    codes = torch.arange(16, dtype=torch.uint8).repeat(255, 2)  # [255, 32]
    scales = torch.arange(255, dtype=torch.uint8).unsqueeze(-1)  # every finite E8M0
    want = torch.tensor([[math.ldexp(v, s - 127) for v in [*E2M1, *(-v for v in E2M1)] * 2] for s in range(255)],
                        dtype=torch.float64)  # exact; past 2^128 (scales 253, 254 x 2 and up) inf in fp32 and bf16
    assert torch.equal(dequantize_mxfp4(codes, scales), want.float())
    assert torch.equal(dequantize_mxfp4(codes, scales, torch.bfloat16), want.to(torch.bfloat16))
    assert torch.equal(want.float().double()[:252], want[:252])  # every scale our quantizer makes: exact


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_make_their_block_nan(bad):
    x = torch.randn(2, 64)
    x[1, 40] = bad
    codes, scales = quantize_mxfp4(x)
    assert scales[1, 1] == 0xFF and not codes[1, 32:].any()
    back = dequantize_mxfp4(codes, scales)
    assert back[1, 32:].isnan().all() and not back[:, :32].isnan().any() and not back[0].isnan().any()
    elements, scales8 = quantize_mxfp8(x)
    assert scales8[1, 1] == 0xFF and dequantize_mxfp8(elements, scales8)[1, 32:].isnan().all()
    if bad != bad:  # torchao also gives a NaN block the NaN scale
        assert to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)[0].view(torch.uint8)[1, 1] == 0xFF


def test_fake_quant_is_idempotent_and_within_the_grid_spacing():
    x = awkward_blocks(3)
    q = fake_quant_mxfp4(x)
    assert torch.equal(fake_quant_mxfp4(q), q)
    scale = e8m0_to_float(quantize_mxfp4(x).scales).repeat_interleave(32, dim=-1)
    error, m = (q - x).abs(), x.abs() / scale
    half_gap = torch.where(m < 2, 0.25, torch.where(m < 4, 0.5, 1.0)) * scale  # E2M1 spacing 0.5, 1, 2
    assert (error[m <= 6] <= half_gap[m <= 6]).all()
    assert (error <= 2 * scale).all()  # saturated: |x| < 8 x scale becomes 6 x scale


def test_shapes_and_errors():
    w = torch.randn(3, 5, 64)  # leading dims carried along (the 3-D expert tensors)
    packed, scales = pack_mxfp4(w)
    assert packed.shape == (3, 5, 32) and scales.shape == (3, 5, 2)
    assert torch.equal(unpack_mxfp4(packed, scales), fake_quant_mxfp4(w))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_mxfp4(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"weight_scale needs \[3, 5, 2\]"):
        unpack_mxfp4(packed, scales[..., :1])
    with pytest.raises(ValueError, match="uint8"):
        unpack_mxfp4(packed.int(), scales)
