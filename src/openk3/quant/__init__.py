"""Quantization for K3's routed experts (SPEC §13): the OCP MX formats (MXFP4 weights, MXFP8 activations), the
packed layout of compressed-tensors' `mxfp4-pack-quantized` checkpoints, and fake quantization for QAT."""

from openk3.quant.mx import (
    MXFP4,
    MXFP8,
    dequantize_mxfp4,
    dequantize_mxfp8,
    fake_quant_mxfp4,
    fake_quant_mxfp8,
    pack_fp4,
    pack_mxfp4,
    quantize_mxfp4,
    quantize_mxfp8,
    unpack_fp4,
    unpack_mxfp4,
)

__all__ = ["MXFP4", "MXFP8", "quantize_mxfp4", "dequantize_mxfp4", "quantize_mxfp8", "dequantize_mxfp8",
           "fake_quant_mxfp4", "fake_quant_mxfp8", "pack_fp4", "unpack_fp4", "pack_mxfp4", "unpack_mxfp4"]
