"""Kernels that the CPU tests run under the Triton interpreter also compile for sm_90 (ptxas ships with Triton; no
GPU needed): the interpreter accepts code that the compiler refuses (a constexpr rebound in a static_range loop
reached the GPU that way, 2026-12-07), and registers spilled to local memory cost a kernel its speed. The Gluon
MXFP4 tiles, which the interpreter cannot run, compile here too: their weights reach the MMA without a shared-memory
load in the main loop (the convert to the operand layout is checked trivial as they compile). Compiled in a child
process, where TRITON_INTERPRET is unset before Triton is imported."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"

COMPILE = f"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, {str(BENCH)!r})
import triton
from sass_loops import compile_sm90, main_loop
import triton.language as tl
from openk3.ops import gluon_mxfp4, paged_mla, triton_combine, triton_routing, triton_sampling
from openk3.ops.kda.triton import one_pass
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
cases = {{
    "sample cut": (triton_sampling._sample_cut_kernel, dict(logits_ptr="*fp32", params_ptr="*fp64", out_ptr="*i64",
                   V="i32", stride="i32"), dict(BLOCK=4096, SELECT=triton_sampling.SELECT_BLOCK), 8),
    "split merge, all at once": (paged_mla._combine_splits_kernel, dict(out="*fp32", lse="*fp32", merged="*fp32",
                                 S="i32", H="i32", R="i32"), dict(ALL_S=64, BLOCK_S=64, BLOCK_H=1, BLOCK_R=128), 4),
    "split merge, walked": (paged_mla._combine_splits_kernel, dict(out="*fp32", lse="*fp32", merged="*fp32",
                            S="i32", H="i32", R="i32"), dict(ALL_S=8, BLOCK_S=1, BLOCK_H=16, BLOCK_R=512), 4),
    "routing": (triton_routing._routing_kernel, dict(logits_ptr="*fp32", bias_ptr="*fp32", scores_ptr="*fp32",
                weights_ptr="*fp32", indices_ptr="*i64", N="i32", E="i32", scaling="fp32"),
                dict(TOP_K=8, HAS_BIAS=True, RENORMALIZE=True, BLOCK_N=1, BLOCK_E=256, BLOCK_K=8), 4),
    "moe combine": (triton_combine._combine_kernel, dict(y_ptr="*bf16", position_ptr="*i64", weights_ptr="*fp32",
                    out_ptr="*bf16", D="i32"), dict(K=8, BLOCK_D=triton_combine.BLOCK_D), 4),
}}
for rows in (16, 32, 64, 128):
    warps = gluon_mxfp4.tile_warps(rows)
    cases[f"gluon mxfp4 tiles, {{rows}} rows"] = (gluon_mxfp4._mxfp4_tiles_kernel, dict(
        x_ptr="*bf16", counts_ptr="*i32", w_ptr="*u8", s_ptr="*u8", out_ptr="*bf16", M="i32", N="i32", K="i32",
        E="i32", K_SPLIT="i32"), dict(BLOCK_M=rows, BLOCK_E=256, WARPS=warps), warps)
out = {{}}
for name, (fn, types, constexprs, warps) in cases.items():
    sass, registers, spill = compile_sm90(fn, types, constexprs, warps, bin_dir)
    out[name] = dict(registers=registers, spill=spill, loop=dict(main_loop(sass)))
kda = {{n: "*bf16" for n in ("q", "k", "v", "g", "beta", "o")}}
kda.update({{n: "*fp32" for n in ("A_log", "dt_bias", "h0", "ht", "ckpt")}}, cu="*i32", chunk_off="*i32", scale="fp32",
           N="i32", H="i32")
kda.update({{n: "*fp32" for n in ("PT", "RN")}}, AQK="*bf16")
for hier, BV, given in ((False, 32, False), (False, 64, False), (True, 32, False), (True, 64, False), (True, 64, True)):
    # the launches kda_one_pass_fwd makes: one pipeline stage, ONE_PASS_WARPS
    constexprs = dict(ckpt_slot=None, K=128, V=128, BT=16, BK=128, BS=32, BV=BV, HAS_H0=True, STORE_FINAL=True,
                      PREC="tf32", DT=tl.bfloat16, ACT=1, G_MIN=-5.0, G_FLOOR=-110.0 if hier else -5.0, HIER=hier,
                      PAIRS_GIVEN=given)
    _, registers, spill = compile_sm90(one_pass._one_pass_kernel, kda, constexprs, one_pass.ONE_PASS_WARPS, bin_dir,
                                       num_stages=1)
    out[f"kda one pass, hier {{hier}}, {{BV}} columns, pairs given {{given}}"] = dict(registers=registers, spill=spill)
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_without_spills():
    run = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result) == {"sample cut", "split merge, all at once", "split merge, walked", "routing", "moe combine",
                           *(f"gluon mxfp4 tiles, {rows} rows" for rows in (16, 32, 64, 128)),
                           *(f"kda one pass, hier {hier}, {bv} columns, pairs given {given}"
                             for hier, bv, given in ((False, 32, False), (False, 64, False), (True, 32, False),
                                                     (True, 64, False), (True, 64, True)))}
    assert all(r["registers"] > 0 and r["spill"] == 0 for r in result.values()), result
    for rows in (16, 32, 64, 128):
        loop = result[f"gluon mxfp4 tiles, {rows} rows"]["loop"]
        assert loop.get("HGMMA") and loop.get("STS") and not loop.get("LDS"), loop  # x stored; no operand loaded
