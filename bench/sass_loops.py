"""The MXFP4 expert kernels compiled for sm_90 without a GPU: registers, spills and the SASS instructions of each
kernel's main loop per weight (a thread's loop instructions over the weights it takes a step), with the PTX decode
of the codes (what runs on an NVIDIA GPU), with its Triton twin (what the interpreter runs) and, for the tiles,
with Triton's own MXFP4 path, tl.dot_scaled (the peers).

Where a kernel is bound by instructions, not bytes (a decode step's expert GEMMs dequantize every weight they read),
the loop's instructions a weight are a proxy for its time that needs no GPU: ptxas and cuobjdump ship with Triton.
Triton versions differ; to match a GPU machine's, put that version's unpacked wheel first (--triton DIR).

    python bench/sass_loops.py [--triton /path/to/unpacked/triton-3.6] [--out bench/sass_loops.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, bin_dir: str,
                 num_stages: int | None = None) -> tuple[str, int, int]:
    """SASS text, registers and spill (stack) bytes of `fn` (a Triton or Gluon kernel) compiled for sm_90 with the
    given argument types, constexprs and launch options (integer and pointer arguments assumed divisible by 16, as
    Triton specializes real launches)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    names = list(fn.arg_names)
    sig = {n: "constexpr" if n in constexprs else signature[n] for n in names}
    fixed = {(i,): constexprs[n] for i, n in enumerate(names) if n in constexprs}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n not in constexprs and n != "M" and (signature[n].startswith("*") or signature[n] == "i32")}
    source = ASTSource
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    kernel = compile(source(fn=fn, signature=sig, constexprs=fixed, attrs=aligned),
                     target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages})})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin.name], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def main_loop(sass: str) -> collections.Counter:
    """Opcodes of the longest loop: the instructions between a backward branch's target and the branch."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    where = {address: i for i, (address, _) in enumerate(code)}
    best = (0, 0)
    for i, (address, text) in enumerate(code):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in where:
            start = where[int(target.group(1), 16)]
            best = max(best, (start, i + 1), key=lambda span: span[1] - span[0])
    return collections.Counter(re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0]
                               for _, text in code[best[0]:best[1]])


def cases():
    """(kernel, tile, decodes, function, signature, constexprs, warps, weights a thread takes per loop step): the
    decodes are (name, constexprs, warps) variants of the kernel."""
    import triton.language as tl

    from openk3.ops import triton_expert_rows, triton_mxfp4

    types = dict(x_ptr="*bf16", counts_ptr="*i32", w_ptr="*u8", s_ptr="*u8", out_ptr="*bf16", M="i32", N="i32",
                 K="i32", E="i32", K_SPLIT="i32")
    dequant = triton_mxfp4.DEQUANT_WARPS
    for block_m, (block_k, scaled_warps) in triton_mxfp4.TILES.items():
        tile = dict(BLOCK_M=block_m, BLOCK_N=triton_mxfp4.BLOCK_N, BLOCK_K=block_k, BLOCK_E=256, DOT=tl.bfloat16,
                    PRECISION="tf32")
        decodes = [("PTX", dict(SCALED_FORMAT="", ASM=True), dequant),
                   ("Triton", dict(SCALED_FORMAT="", ASM=False), dequant),
                   ("tl.dot_scaled", dict(SCALED_FORMAT="bf16", ASM=False), scaled_warps)]
        yield ("mxfp4 tiles", f"{block_m} rows", decodes, triton_mxfp4._mxfp4_grouped_matmul_kernel, types, tile,
               triton_mxfp4.BLOCK_N * block_k / 32)
    rows = triton_expert_rows
    yield ("mxfp4 rows", "1 row", [("PTX", dict(ASM=True), rows.WARPS), ("Triton", dict(ASM=False), rows.WARPS)],
           rows._expert_rows_kernel, types, dict(BLOCK_N=rows.BLOCK_N, BLOCK_K=rows.BLOCK_K, BLOCK_E=256, MXFP4=True),
           rows.BLOCK_N * rows.BLOCK_K / 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton", help="an unpacked Triton wheel's directory to compile with (its triton/ inside)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "sass_loops.json"))
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's (before Triton is imported)
    if args.triton:
        sys.path.insert(0, args.triton)
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    rows = []
    print(f"sm_90 SASS, triton {triton.__version__}, bf16 rows: the main loop per weight\n")
    print("| kernel | tile | decode | warps | registers | spill bytes | loop instructions | a weight |")
    print("|---|---|---|---|---|---|---|---|")
    for kernel, tile, decodes, fn, types, constexprs, step_weights in cases():
        for decode, variant, warps in decodes:
            sass, registers, spill = compile_sm90(fn, types, dict(constexprs, **variant), warps, bin_dir)
            loop = main_loop(sass)
            row = dict(kernel=kernel, tile=tile, decode=decode, warps=warps, registers=registers,
                       spill_bytes=spill, loop_instructions=sum(loop.values()),
                       per_weight=sum(loop.values()) * warps / step_weights, top_opcodes=dict(loop.most_common(8)))
            rows.append(row)
            print(f"| {kernel} | {tile} | {decode} | {warps} | {registers} | {spill} | {row['loop_instructions']} | "
                  f"{row['per_weight']:.2f} |")
    with open(args.out, "w") as f:
        json.dump(dict(triton=triton.__version__, target="sm_90", date=time.strftime("%Y-%m-%d"), rows=rows), f,
                  indent=2)
        f.write("\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
