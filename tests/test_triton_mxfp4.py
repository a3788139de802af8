"""The grouped W4A16 GEMM over MXFP4 experts (`ops.triton_mxfp4`: the row kernel, and the row tiles with the
explicit dequantization or tl.dot_scaled) against dequantize-then-matmul
(`quant.mx.unpack_mxfp4`, then `ops.moe.grouped_matmul_loop`): odd sizes, experts without rows (first, middle,
last), every row in one expert, no rows at all, one to several row tiles per expert, extreme block scales (the
smallest E8M0, the largest, NaN) and every E2M1 code, also through the PTX that decodes them on a GPU (emulated);
and `ops.moe.experts_forward_mxfp4` (sort, two kernels, GLU, combine) against `experts_forward` on the dequantized
weights, eagerly and inside torch.compile. On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py), its
output NaN-poisoned."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import moe as moe_ops
from openk3.ops import triton_experts_common, triton_mxfp4
from openk3.ops.activations import glu_activation
from openk3.quant.mx import pack_mxfp4, unpack_mxfp4
from test_ops_fused import DEV, _Poisoned


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_experts_common, "torch", _Poisoned())  # (the output buffers: split_output)


def weights(E: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weights [E, N, K] over many magnitudes: rows scaled from 1e-3 to 1e2."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-3, 2, N).unsqueeze(-1)
    return pack_mxfp4(w)


def reference(x: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize to x's dtype, then one product per expert in fp32."""
    w = unpack_mxfp4(packed, scales, x.dtype).float()
    return moe_ops.grouped_matmul_loop(x.float(), counts, w)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the output dtype's rounding (the kernel's sums run in another order): elementwise, relative to the
    row's size."""
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all(), "non-finite values (an unwritten element?)"
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = ((got.float() - want) / scale).abs().max()
    assert err <= 2 * eps, float(err)


METHODS = ["rows", "dequant", "dot_scaled"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("counts", "N", "K"), [
    ([3, 0, 17, 1, 0], 45, 96),  # empty experts in the middle and last, N not a multiple of the tile
    ([0, 0, 40], 70, 160),  # every row in the last expert (three row tiles), K with a partial step
    ([1] * 9, 33, 32),  # decode: one row per expert, one scale group
    ([5], 64, 256),  # one expert, whole tiles
    ([150, 0, 7], 40, 96),  # prefill-sized groups: 64-row tiles, 64 inputs a step
    ([300, 130], 24, 160),  # more than 64 rows an expert: 128-row tiles (the Gluon tiles' 8 warps on Hopper)
])
def test_kernel_matches_dequantize_then_matmul(counts, N, K, method):
    counts = torch.tensor(counts)
    E, M = counts.numel(), int(counts.sum())
    packed, scales = weights(E, N, K, seed=M + N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K)).to(torch.bfloat16)
    want = reference(x, counts, packed, scales)
    got = triton_mxfp4.mxfp4_grouped_matmul_triton(x.to(DEV), counts.to(DEV), packed.to(DEV), scales.to(DEV),
                                                   method)
    assert_close(got.cpu(), want, torch.bfloat16)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_inputs_split_over_programs_add_up(splits, method):
    """Split-K: programs over parts of K (whole 128-input steps, the last one partial) write fp32 partial sums,
    added after; an empty expert and NaN-poisoned output buffers stay out of the result."""
    counts, N, K = torch.tensor([2, 0, 1, 4]), 70, 672
    packed, scales = weights(4, N, K, seed=splits)
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(splits)).to(torch.bfloat16)
    got = triton_mxfp4.mxfp4_grouped_matmul_triton(x.to(DEV), counts.to(DEV), packed.to(DEV), scales.to(DEV),
                                                   method, splits)
    assert_close(got.cpu(), reference(x, counts, packed, scales), torch.bfloat16)


@pytest.mark.parametrize(("tiles", "K"), [(8 * 32, 2304), (8 * 36, 1024), (16, 4096), (16, 256), (600, 8192),
                                          (4096, 7168)])
def test_split_count_fills_the_gpu_for_few_tiles_only(tiles, K):
    """Splits double while the programs stay within SPLIT_TARGET and each keeps MIN_SPLIT_STEPS steps of 128
    inputs."""
    splits = triton_experts_common.k_splits(tiles, K, block_k=128)
    assert splits & (splits - 1) == 0
    steps, target = triton_experts_common.MIN_SPLIT_STEPS, triton_experts_common.SPLIT_TARGET
    assert splits == 1 or (tiles * splits <= target and K // (128 * splits) >= steps)
    assert tiles * splits * 2 > target or K // (128 * splits * 2) < steps  # (no further split fits)


def test_a_negative_split_count_is_refused():
    with pytest.raises(ValueError, match="splits must be >= 0"):
        triton_mxfp4.mxfp4_grouped_matmul_triton(torch.randn(1, 64), torch.tensor([1]), *weights(1, 8, 64, 1),
                                                 splits=-1)


@pytest.mark.parametrize("method", ["dequant", "rows"])
def test_kernel_takes_fp32_rows_exactly(method):
    """fp32 rows: fp32 products (to fp32 rounding of the sums)."""
    counts = torch.tensor([2, 0, 7])
    packed, scales = weights(3, 19, 64, seed=5)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    got = triton_mxfp4.mxfp4_grouped_matmul_triton(x.to(DEV), counts.to(DEV), packed.to(DEV), scales.to(DEV),
                                                   method)
    assert_close(got.cpu(), reference(x, counts, packed, scales), torch.float32)


@pytest.mark.parametrize(("method", "dtype"), [("dequant", torch.float32), ("dequant", torch.bfloat16),
                                               ("rows", torch.float32), ("rows", torch.bfloat16),
                                               ("dot_scaled", torch.bfloat16)])
def test_extreme_scales_and_every_code(method, dtype):
    """Every E2M1 code under block scales from 2^-127 (the E8M0 byte 0: fp32 subnormal weights) to 2^123, read
    one weight at a time (one-hot rows: each output is a single weight, so the comparison is exact); a NaN scale
    (0xFF) makes its column NaN, as in the reference."""
    N, K = 5, 64
    codes = (torch.arange(K) % 16).to(torch.uint8).repeat(N, 1)  # [N, K]: codes 0-15 at inputs 0-15, 32-47
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).unsqueeze(0)
    scales = torch.tensor([[0, 1], [127, 127], [227, 27], [30, 250], [255, 127]], dtype=torch.uint8).unsqueeze(0)
    picks = torch.cat([torch.arange(16), torch.arange(32, 48)])
    x = torch.zeros(picks.numel(), K, dtype=dtype)
    x[torch.arange(picks.numel()), picks] = 1.0
    counts = torch.tensor([picks.numel()])
    want = reference(x, counts, packed, scales)
    got = triton_mxfp4.mxfp4_grouped_matmul_triton(x.to(DEV), counts.to(DEV), packed.to(DEV), scales.to(DEV),
                                                   method).cpu().float()
    assert torch.isnan(got[:, 4]).all() and torch.isnan(want[:, 4]).all()
    assert (want[:, 0] != 0).sum() == 28 and want[:, 3].abs().max() == 6 * 2.0**123  # subnormals, no overflow
    got, want = got[:, :4], want[:, :4]
    # the interpreter's fp32 -> bf16 cast flushes subnormals to zero, and so does tl.dot_scaled on a GPU (an H100,
    # 2026-12-06: the E8M0 byte 0 scale, 2^-127, gave 0 where the reference has 2.9e-39)
    kept = torch.ones_like(want, dtype=torch.bool)
    if dtype == torch.bfloat16 and (DEV == "cpu" or method == "dot_scaled"):
        kept &= (want == 0) | (want.abs() >= torch.finfo(torch.float32).tiny)
    if method == "dot_scaled" and DEV != "cpu":
        # Triton's Hopper emulation of tl.dot_scaled takes the scale as a bf16 value, and 2^-127 is a bf16
        # subnormal: an H100 (2026-12-07) gave 0 for every product under that scale, normal ones (2 x 2^-127) too
        kept[(picks < 32), 0] = False  # inputs 0-31 of output 0: the scale byte 0
    got, want = got[kept], want[kept]
    assert torch.equal(got, want)


def test_no_rows_and_bad_operands():
    packed, scales = weights(4, 8, 64, seed=1)
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    out = triton_mxfp4.mxfp4_grouped_matmul_triton(x.to(DEV), torch.zeros(4, dtype=torch.long).to(DEV),
                                                   packed.to(DEV), scales.to(DEV))
    assert out.shape == (0, 8)
    rows = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"scales \[E, N, K/32\]"):
        triton_mxfp4.check_mxfp4_operands(rows, torch.tensor([3, 0, 0, 0]), packed, scales[..., :1])
    with pytest.raises(ValueError, match="one row count per expert"):
        triton_mxfp4.check_mxfp4_operands(rows, torch.tensor([3]), packed, scales)
    with pytest.raises(ValueError, match="uint8"):
        triton_mxfp4.check_mxfp4_operands(rows, torch.tensor([3, 0, 0, 0]), packed.float(), scales)
    with pytest.raises(ValueError, match="method must be one of"):
        triton_mxfp4.mxfp4_grouped_matmul_triton(rows, torch.tensor([3, 0, 0, 0]), packed, scales, "gemv")
    with pytest.raises(ValueError, match="bf16 or fp16 rows"):
        triton_mxfp4.mxfp4_grouped_matmul_triton(rows.float(), torch.tensor([3, 0, 0, 0]), packed, scales,
                                                 "dot_scaled")


def experts(E: int, inter: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = pack_mxfp4(torch.randn(E, 2 * inter, dim, generator=g) * 0.1)
    down = pack_mxfp4(torch.randn(E, dim, inter, generator=g) * 0.1)
    return gate_up, down


@pytest.mark.parametrize("method", ["auto", "expand"])
@pytest.mark.parametrize(("N", "E", "k"), [(1, 8, 2), (13, 6, 3)])  # decode (most experts empty), a prefill
def test_experts_forward_mxfp4_matches_dequantized_experts(N, E, k, method):
    gate_up, down = experts(E, 32, 64, seed=N)
    g = torch.Generator().manual_seed(E)
    x = torch.randn(N, 64, generator=g).to(torch.bfloat16)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    act = glu_activation("swiglu")
    want = moe_ops.experts_forward(x, indices, w, unpack_mxfp4(*gate_up, torch.bfloat16),
                                   unpack_mxfp4(*down, torch.bfloat16), act)
    dev = [t.to(DEV) for t in (*gate_up, *down)]
    got = moe_ops.experts_forward_mxfp4(x.to(DEV), indices.to(DEV), w.to(DEV), dev[:2], dev[2:], act, method)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=0.02, atol=0.02 * want.abs().max().item())


def test_auto_expands_prefill_sized_batches(monkeypatch):
    """Method "auto" expands the experts (then the bf16 path) where `expands` says so: bf16 on a GPU with the
    grouped GEMM, at least EXPAND_MIN_ROWS rows an expert; the W4A16 kernels otherwise."""
    assert not moe_ops.expands(torch.bfloat16, torch.zeros(4096, 8, dtype=torch.long), 256)  # CPU
    gate_up, down = experts(4, 32, 64, seed=3)
    x, indices, w = torch.randn(5, 64).to(torch.bfloat16), torch.tensor([[0, 1]] * 5), torch.rand(5, 2)
    calls = []
    monkeypatch.setattr(triton_mxfp4, "expand_mxfp4", lambda *a: calls.append(a[-1]) or unpack_mxfp4(*a))
    act = glu_activation("swiglu")
    for expands in (False, True):
        monkeypatch.setattr(moe_ops, "expands", lambda *a, e=expands: e)
        moe_ops.experts_forward_mxfp4(x.to(DEV), indices.to(DEV), w.to(DEV), [t.to(DEV) for t in gate_up],
                                      [t.to(DEV) for t in down], act)
    assert calls == [torch.bfloat16, torch.bfloat16]  # gate_up and down, expanded once each, when it expands


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 19, 96), (1, 1, 32)])
def test_expand_equals_unpack(shape, dtype):
    """`expand_mxfp4` (one Triton pass) gives `unpack_mxfp4`'s values to the bit over random codes and scales, the
    smallest E8M0 scale (2^-127) and the NaN one included; on CPU the interpreter's fp32 -> bf16 cast flushes the
    bf16 subnormals (the smallest scale's values) to zero, so those are left out there."""
    g = torch.Generator().manual_seed(shape[1])
    packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (*shape[:-1], shape[-1] // 32), generator=g, dtype=torch.uint8)
    scales.view(-1)[0], scales.view(-1)[-1] = 0, 255
    got = triton_mxfp4.expand_mxfp4(packed.to(DEV), scales.to(DEV), dtype).cpu()
    want = unpack_mxfp4(packed, scales, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    kept = torch.ones_like(want, dtype=torch.bool)
    if dtype == torch.bfloat16 and DEV == "cpu":
        kept = (want == 0) | ~(want.float().abs() < torch.finfo(torch.float32).tiny)
    same = (got == want) | (got.isnan() & want.isnan())
    assert same[kept].all() and want.isnan().any()
    with pytest.raises(ValueError, match="K/32"):
        triton_mxfp4.expand_mxfp4(packed, scales[..., :0], dtype)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_kernel_stays_whole_in_compiled_code(backend):
    """Inside torch.compile (the compiled decode step on a GPU) the kernel is a custom op: no graph break, and
    Inductor lowers it around the rest."""
    gate_up, down = experts(5, 32, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16).to(DEV)
    indices = torch.tensor([[0, 4], [4, 1], [2, 0]]).to(DEV)
    w = torch.rand(3, 2, generator=g).to(DEV)
    dev = [t.to(DEV) for t in (*gate_up, *down)]
    act = glu_activation("swiglu")
    want = moe_ops.experts_forward_mxfp4(x, indices, w, dev[:2], dev[2:], act)
    torch._dynamo.reset()
    step = torch.compile(lambda x: moe_ops.experts_forward_mxfp4(x, indices, w, dev[:2], dev[2:], act),
                         backend=backend, fullgraph=True)
    with torch.no_grad():
        got = step(x)
    exact = backend == "aot_eager"  # (Inductor fuses the GLU and the combine: bf16 rounding apart)
    torch.testing.assert_close(got, want, rtol=0 if exact else 0.02, atol=0 if exact else 0.02 * want.abs().max())


def test_auto_picks_by_rows_per_expert():
    """A decode step's rows (at most one per expert on average; 1/16 where the Gluon tiles run) go one a program,
    larger groups (fp32 rows too) to the explicit dequantization's tiles, never to tl.dot_scaled's; a method asked
    for is kept."""
    pick = triton_mxfp4.pick_method
    assert pick("auto", 8, 256) == pick("auto", 256, 256) == "rows"
    assert pick("auto", 257, 256) == pick("auto", 32 * 256, 256) == pick("auto", 1 << 20, 256) == "dequant"
    assert pick("dequant", 1, 256) == "dequant" and pick("rows", 9, 1) == "rows"
    assert pick("dot_scaled", 5, 256) == "dot_scaled"
    # where the Gluon tiles run, they take all but the sparsest batches (up to 1/16 row an expert)
    assert pick("auto", 16, 256, gluon=True) == "rows" and pick("auto", 17, 256, gluon=True) == "dequant"
    assert pick("rows", 1 << 20, 256, gluon=True) == "rows"
    with pytest.raises(ValueError, match="method must be one of"):
        pick("scaled", 5, 256)


def run_code_pair_ptx(asm: str, words: torch.Tensor, scale_pairs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """`triton_experts_common._code_pair_asm`'s PTX run instruction by instruction on int64 tensors holding 32-bit
    registers ($2 the words, $3 the scale pairs; bf16x2 products rounded by torch's fp32 -> bf16 cast), for the
    instructions it uses: the GPU runs the string itself, the CPU interpreter a Triton twin. Returns the two
    outputs: bf16 halves, or fp32 registers."""
    regs = {"$2": words.to(torch.int64)} | ({} if scale_pairs is None else {"$3": scale_pairs.to(torch.int64)})
    mask = 0xFFFFFFFF

    def value(operand):
        return regs[operand] if operand in regs else int(operand, 0)

    def halves(r):  # a register's two bf16 halves, as fp32 bit patterns
        return [((r >> shift) & 0xFFFF).to(torch.int32) << 16 for shift in (0, 16)]

    for line in asm.strip("{} ").split(";"):
        if not line.strip() or line.strip().startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # the unpack into the two 16-bit outputs
            r = regs[args.split(",")[-1].strip()]
            return tuple(h.view(torch.float32).to(torch.bfloat16) for h in halves(r))
        d, *src = [a.strip() for a in args.split(",")]
        a = value(src[0])
        if op == "mov.b32":
            regs[d] = a if isinstance(a, torch.Tensor) else torch.full_like(words, a, dtype=torch.int64)
        elif op in ("shl.b32", "shr.u32"):
            regs[d] = ((a << value(src[1])) if op == "shl.b32" else (a >> value(src[1]))) & mask
        elif op in ("and.b32", "or.b32"):
            regs[d] = (a & value(src[1])) if op == "and.b32" else (a | value(src[1]))
        elif op == "mul.rn.bf16x2":
            out = [(x.view(torch.float32) * y.view(torch.float32)).to(torch.bfloat16).float().view(torch.int32)
                   .to(torch.int64) >> 16 & 0xFFFF for x, y in zip(halves(a), halves(value(src[1])))]
            regs[d] = out[0] | (out[1] << 16)
        else:
            raise AssertionError(f"an instruction the emulation does not know: {line}")
    return tuple(regs[out].to(torch.int32).view(torch.float32) for out in ("$0", "$1"))  # the fp32 outputs


def test_the_code_pair_ptx_decodes_every_code_at_extreme_scales():
    """The PTX of the tiles' decode on a GPU, emulated: codes i and i + 4 of each word, times 2^126 and the scale,
    equal the reference's values in bf16 for every code in every position and the E8M0 bytes 0 (a subnormal
    scale), 1, 127, 200, 254 and 255 (NaN); the row kernel's (unscaled, fp32) the codes' values."""
    codes = torch.arange(16).unsqueeze(1).add(torch.arange(8)).remainder(16)  # [16 words, 8 positions]
    words = (codes << (4 * torch.arange(8))).sum(1)
    packed = torch.stack([(codes[:, 2 * j] | (codes[:, 2 * j + 1] << 4)) for j in range(4)], 1).to(torch.uint8)
    for s in (0, 1, 127, 200, 254, 255):
        byte = torch.full((16,), s, dtype=torch.uint8)
        want = unpack_mxfp4(packed.reshape(1, 64), byte[:4].reshape(1, 4), torch.float32).reshape(16, 8)
        half = int(torch.tensor(float("nan") if s == 255 else 2.0 ** (s - 127)).to(torch.bfloat16).view(torch.int16))
        for i in range(4):
            lo, hi = run_code_pair_ptx(triton_experts_common._code_pair_asm(i), words,
                                       torch.full((16,), half | (half << 16)))
            for got, column in ((lo, i), (hi, i + 4)):
                torch.testing.assert_close(got, want[:, column].to(torch.bfloat16), rtol=0, atol=0, equal_nan=True,
                                           msg=f"E8M0 byte {s}, code position {column}")
            if s == 127:  # the row kernel's form: the codes' values in fp32, unscaled
                lo, hi = run_code_pair_ptx(triton_experts_common._code_pair_asm(i, unscaled_fp32=True), words, None)
                assert torch.equal(lo, want[:, i]) and torch.equal(hi, want[:, i + 4]), i
