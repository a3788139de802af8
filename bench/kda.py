"""KDA kernel benchmark on one GPU: openk3's Triton kernels beside fla 0.6.0 and torch SDPA, one process.

    python bench/kda.py [--json PATH] [--quick] [--shapes 0,1,2,3,4] [--fla-shapes 0,1,2,3,4]
    python bench/kda.py --stages [--tune] [--shapes ...]     each launch of ours timed alone (and variants)
    python bench/kda.py --gate-modes [--shapes ...]          bounded vs any-gate kernels, beside fla's matching path

Shapes (bf16, K = V = 128) from issue 5; modes fwd and fwd+bwd; decode of 64 and 256 sequences x 32 heads with
an fp32 state pool; device-copy bandwidth and a bf16 GEMM rate as the two ceilings. fla runs its Triton path
(FLA_DISABLE_BACKEND_DISPATCH=1) with the K3 safe gate, L2 norm and beta sigmoid in its kernel; ours is timed
three ways: on pre-activated inputs (the `kda` contract, K3's floor declared: the bounded kernels), with the
activations as a separate Triton pass
(`kda_activations` then `kda_triton`) and with them fused into the chunk kernels (`kda_triton_fused`, the
like-for-like comparison with fla).
Cold start: wall time to the first finished fwd+bwd per shape with an empty Triton cache (a fresh cache dir per
run unless TRITON_CACHE_DIR is set; set it to reuse a warm cache in a second call, and ignore the cold column).
fla's first autotuning takes about 4 minutes on a fresh H200: all five shapes with fla need about 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kda-bench-cache-"))
os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from openk3.ops.kda.triton import (  # noqa: E402
    kda_activations,
    kda_decode,
    kda_final_state_triton,
    kda_triton,
    kda_triton_fused,
)

SHAPES = [  # name, B, T, H, cu_seqlens
    ("B1 T8192 H32", 1, 8192, 32, None),
    ("B1 T32768 H32", 1, 32768, 32, None),
    ("B8 T4096 H32", 8, 4096, 32, None),
    ("B1 T8192 H96", 1, 8192, 96, None),
    ("varlen 8x1024 H64", 1, 8192, 64, [i * 1024 for i in range(9)]),
]
K = V = 128
G_MIN = -5.0
FLOP_PER_TOKEN_HEAD = 11.5e6 / 64  # forward, chunk 64 WY form (KERNELS.md); fwd+bwd counted as 3x


def ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings():
    src = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    bw = 2 * src.numel() / t / 1e9  # TB/s, bytes read + written
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = ms(lambda: a @ b)
    return bw, 2 * 8192**3 / t / 1e9


def raw_inputs(B, T, H, dev="cuda"):
    """What the model really produces before activation: projections, gate logits, beta logits."""
    bf = torch.bfloat16
    return dict(
        q=torch.randn(B, T, H, K, device=dev, dtype=bf), k=torch.randn(B, T, H, K, device=dev, dtype=bf),
        v=torch.randn(B, T, H, V, device=dev, dtype=bf), f=torch.randn(B, T, H, K, device=dev, dtype=bf),
        b=torch.randn(B, T, H, device=dev, dtype=bf),
        A_log=torch.log(torch.empty(H, device=dev).uniform_(1, 16)), dt_bias=0.1 * torch.randn(H * K, device=dev))


def activate(r):
    """K3's activations in PyTorch (SPEC §2): l2norm q,k; g = g_min sigmoid(exp(A_log)(f + dt_bias)); sigmoid b."""
    H = r["q"].shape[2]
    a = r["A_log"].exp().view(H, 1)
    g = G_MIN * torch.sigmoid(a * (r["f"].float() + r["dt_bias"].view(H, K)))
    return (F.normalize(r["q"].float(), dim=-1, eps=1e-6).to(torch.bfloat16),
            F.normalize(r["k"].float(), dim=-1, eps=1e-6).to(torch.bfloat16), r["v"], g.to(torch.bfloat16),
            torch.sigmoid(r["b"].float()).to(torch.bfloat16))


def runners(r, cu):
    from fla.ops.kda import chunk_kda

    pre = [x.detach().requires_grad_() for x in activate(r)]
    raw = {n: r[n].detach().requires_grad_() for n in ("q", "k", "v", "f", "b")}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    cu_l = None if cu is None else cu_t.long()

    def ours():
        return kda_triton(*pre, cu_seqlens=cu_t, gate_min=G_MIN)[0]

    def ours_act():
        acts = kda_activations(raw["q"], raw["k"], raw["f"], raw["b"], r["A_log"], r["dt_bias"], g_min=G_MIN)
        return kda_triton(*acts[:2], raw["v"], *acts[2:], cu_seqlens=cu_t)[0]

    def ours_fused():
        return kda_triton_fused(raw["q"], raw["k"], raw["v"], raw["f"], raw["b"], r["A_log"], r["dt_bias"],
                                g_min=G_MIN, cu_seqlens=cu_t)[0]

    def fla():
        return chunk_kda(raw["q"], raw["k"], raw["v"], raw["f"], raw["b"], A_log=r["A_log"], dt_bias=r["dt_bias"],
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=G_MIN, cu_seqlens=cu_l)[0]

    return {"ours": (ours, pre), "ours+act": (ours_act, list(raw.values())),
            "ours+fused": (ours_fused, list(raw.values())), "fla": (fla, list(raw.values()))}


def fwd_bwd(fn, leaves, do):
    def step():
        for x in leaves:
            x.grad = None
        fn().backward(do)
    return step


def bench_shape(name, B, T, H, cu, results, with_fla=True):
    r = raw_inputs(B, T, H)
    row = {"shape": name}
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    for who, (fn, leaves) in runners(r, cu).items():
        if who == "fla" and not with_fla:
            continue
        step = fwd_bwd(fn, leaves, do)
        if who in ("ours", "ours+fused", "fla"):  # ours+fused compiles its own specialisations
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            row[f"{who} cold s"] = time.perf_counter() - t0
        with torch.no_grad():
            row[f"{who} fwd"] = ms(fn)
        row[f"{who} fwdbwd"] = ms(step)
        if who in ("ours", "fla", "ours+fused"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row[f"{who} peak GB"] = (torch.cuda.max_memory_allocated() - base) / 1e9
    if cu is None:
        qs, ks, vs = (r[n].transpose(1, 2) for n in ("q", "k", "v"))
        with torch.no_grad():
            row["sdpa fwd"] = ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
    th = B * T * H  # achieved rates of the fused path: it reads q, k, v, f, b and writes o (bf16)
    row["fused TB/s"] = th * (2 * (3 * K + 2 * V) + 2) / row["ours+fused fwd"] / 1e9
    row["fused TFLOP/s"] = th * FLOP_PER_TOKEN_HEAD / row["ours+fused fwd"] / 1e9
    row["fused fwdbwd TFLOP/s"] = 3 * th * FLOP_PER_TOKEN_HEAD / row["ours+fused fwdbwd"] / 1e9
    results.append(row)
    return row


def bench_decode(N, H, results, copy_bw):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    dev = "cuda"
    q = F.normalize(torch.randn(N, H, K, device=dev), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(N, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(N, H, V, device=dev, dtype=torch.bfloat16)
    g = (G_MIN * torch.rand(N, H, K, device=dev)).to(torch.bfloat16)
    beta = torch.rand(N, H, device=dev).to(torch.bfloat16)
    P = 2 * N
    pool = torch.randn(P, H, K, V, device=dev)
    slots = torch.randperm(P, device=dev)[:N].to(torch.int32)
    pool_fla = pool.clone()

    def fla():
        fused_recurrent_kda_fwd(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1),
                                initial_state=pool_fla, output_final_state=True, inplace_final_state=True,
                                ssm_state_indices=slots.long())

    state_bytes = 2 * N * H * K * V * 4
    row = {"decode": f"{N} seqs x {H} heads"}
    for who, fn in (("ours", lambda: kda_decode(q, k, v, g, beta, pool, slots)), ("fla", fla)):
        t = ms(fn)
        row[f"{who} ms"] = t
        row[f"{who} TB/s"] = state_bytes / t / 1e9
        row[f"{who} % copy"] = 100 * state_bytes / t / 1e9 / copy_bw
    results.append(row)
    return row


def gate_modes(name, B, T, H, cu, results):
    """Forward and fwd+bwd of our two gate modes on the same pre-activated K3 inputs (bounded: K3's floor declared;
    any-gate: none, as for Kimi Linear's gate), Kimi Linear's gate fused in ours, and fla's matching path:
    pre-activated inputs without its safe gate (its autotuning of that path takes about 3 minutes)."""
    from fla.ops.kda import chunk_kda

    r = raw_inputs(B, T, H)
    pre = [x.detach().requires_grad_() for x in activate(r)]
    raw = [r[n].detach().requires_grad_() for n in ("q", "k", "v", "f", "b")]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    cu_l = None if cu is None else cu_t.long()
    runs = {
        "ours bounded": (lambda: kda_triton(*pre, cu_seqlens=cu_t, gate_min=G_MIN)[0], pre),
        "ours any-gate": (lambda: kda_triton(*pre, cu_seqlens=cu_t)[0], pre),
        "fla pre-act": (lambda: chunk_kda(*pre, cu_seqlens=cu_l)[0], pre),
        "ours kimi fused": (lambda: kda_triton_fused(*raw, r["A_log"], r["dt_bias"], gate="kimi",
                                                     cu_seqlens=cu_t)[0], raw),
    }
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    row = {"shape": name}
    for who, (fn, leaves) in runs.items():
        step = fwd_bwd(fn, leaves, do)
        step()
        with torch.no_grad():
            row[f"{who} fwd"] = ms(fn)
        row[f"{who} fwdbwd"] = ms(step)
        print(f"  {name} {who}: fwd {row[f'{who} fwd']:.3f} ms, fwd+bwd {row[f'{who} fwdbwd']:.3f} ms", flush=True)
    results.append(row)
    return row


def stages(name, B, T, H, cu, tune=False):
    """Time each launch of ours alone: forward (prepare, state pass), backward (prepare, reverse pass, intra),
    pre-activated and fused; the one-pass forward (ops/kda/triton/one_pass.py), alone and after the pair kernel,
    beside the two-kernel one, its outputs checked against them first; KCP's transition at width V + K (the full
    forward on [v | 0] against the state-only pass); with `tune`, warps per kernel, the intra backward's pipeline
    stages and register cap, the reverse pass's V block and the one-pass forward's V block and warps."""
    from openk3.ops.kda.triton import chunk_bwd, chunk_fwd, one_pass
    from openk3.ops.kda.triton.layout import chunk_layout

    r = raw_inputs(B, T, H)
    q, k, v, g, beta = (x.reshape(B * T, H, -1).squeeze(-1).contiguous() for x in activate(r))
    raw = [r[n].reshape(B * T, H, -1).squeeze(-1).contiguous() for n in ("q", "k", "v", "f", "b")]
    gate = chunk_fwd.gate_spec(G_MIN)  # the pre-activated inputs' declared floor: the bounded kernels
    act = chunk_fwd.gate_spec(None, r["A_log"], r["dt_bias"], kimi=False, g_min=G_MIN)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    lay = chunk_layout(B, T, cu_t, "cuda")
    scale = K**-0.5
    saved = chunk_fwd.chunk_kda_fwd(q, k, v, g, beta, scale, None, False, lay, save_states=True, gate=gate)[2]
    h0, pvs, W, *terms, PT, RN = saved
    do = torch.randn_like(v)
    rev = lambda bv=32: chunk_bwd.reverse_pass((W, None, *terms), do, None, False, lay, bv, q.dtype)
    dU, dhs, _ = rev()
    replay = lambda: chunk_bwd.replay_states(h0, pvs, terms[1], terms[3], lay, q.dtype)
    hs = replay()
    intra = lambda *xs, act=gate: chunk_bwd.intra_backward(*xs, scale, hs, pvs, dhs, (PT, RN), do, dU, lay, act)
    bwd = lambda: chunk_bwd.chunk_kda_bwd(q, k, v, g, beta, scale, saved, do, None, False, lay, gate)
    fwd = lambda *xs, act=gate, save=False: chunk_fwd.chunk_kda_fwd(*xs, scale, None, False, lay, save, act)
    row = {"shape": name,
           "prepare": ms(lambda: chunk_fwd.prepare(q, k, v, g, beta, scale, lay, gate)),
           "prepare fused": ms(lambda: chunk_fwd.prepare(*raw, scale, lay, act)),
           "fwd total": ms(lambda: fwd(q, k, v, g, beta)),
           "fwd fused": ms(lambda: fwd(*raw, act=act)),
           "fwd saving states": ms(lambda: fwd(q, k, v, g, beta, save=True)),
           "reverse pass": ms(rev),
           "state replay": ms(replay),
           "intra bwd": ms(lambda: intra(q, k, v, g, beta)),
           "intra bwd fused": ms(lambda: intra(*raw, act=act)),
           "bwd total": ms(bwd)}
    row["state pass"] = row["fwd total"] - row["prepare"]
    one = lambda *xs, act=gate, **launch: one_pass.kda_one_pass_fwd(*xs, scale, None, False, lay, act, **launch)[0]
    for label, xs, spec in (("", (q, k, v, g, beta), gate), (" fused", raw, act)):
        expected = fwd(*xs, act=spec)[0].float()
        for mode, pairs in (("one-pass", False), ("pairs + one-pass", True)):
            got = one(*xs, act=spec, pair_kernel=pairs).float()
            row[f"{mode} fwd{label} rel err"] = ((got - expected).norm() / expected.norm()).item()
            row[f"{mode} fwd{label}"] = ms(lambda xs=xs, spec=spec, pairs=pairs: one(*xs, act=spec, pair_kernel=pairs))
    row.update(transition(activate(r), cu_t))
    print({a: (round(b, 4) if isinstance(b, float) else b) for a, b in row.items()}, flush=True)
    if not tune:
        return
    for bv in (32, 64):
        print(f"  reverse pass BV={bv}: {ms(lambda bv=bv: rev(bv)):.4f}", flush=True)
    for pairs in (False, True):
        for bv in (32, 64, 128):
            for nw in (4, 8):
                t_one = ms(lambda bv=bv, nw=nw, pairs=pairs: one(*raw, act=act, pair_kernel=pairs, block_v=bv,
                                                                 num_warps=nw))
                print(f"  one-pass fwd fused, pair kernel {pairs}, BV={bv} warps={nw}: {t_one:.4f}", flush=True)
    default = dict(chunk_fwd.WARPS)
    for kernel, options in (("prepare", (4,)), ("state", (8,)), ("intra_bwd", (4, 8)), ("state_bwd", (2, 8))):
        for nw in options:
            chunk_fwd.WARPS.update(default, **{kernel: nw})
            t_fwd = ms(lambda: fwd(*raw, act=act))
            print(f"  {kernel} warps={nw}: fwd fused {t_fwd:.4f} bwd {ms(bwd):.4f}", flush=True)
    chunk_fwd.WARPS.update(default)
    launch = dict(chunk_fwd.INTRA_BWD_LAUNCH)
    variants = ({"num_stages": 3}, {"num_stages": 1}, {"num_stages": 1, "maxnreg": 168},
                {"num_stages": 2, "maxnreg": 168})
    for variant in variants:
        chunk_fwd.INTRA_BWD_LAUNCH.clear()
        chunk_fwd.INTRA_BWD_LAUNCH.update(variant)
        print(f"  intra_bwd {variant}: {ms(lambda: intra(*raw, act=act)):.4f} fused", flush=True)
    chunk_fwd.INTRA_BWD_LAUNCH.clear()
    chunk_fwd.INTRA_BWD_LAUNCH.update(launch)


def transition(inputs, cu):
    """KCP's transition (ops/kda/transition.py): the final state from [0 | I] with values [v | 0], by the full
    forward (outputs written, nobody reads them) and by the state-only pass (v itself, no q side, no outputs)."""
    _, k, v, g, beta = inputs
    B, T, H, _ = k.shape
    N = B if cu is None else len(cu) - 1
    eye = torch.eye(K, device="cuda").expand(N, H, K, K)
    start = torch.cat([eye.new_zeros(N, H, K, V), eye], dim=-1)
    padded = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    with torch.no_grad():
        full = lambda: kda_triton(k, k, padded, g, beta, initial_state=start, output_final_state=True,
                                  cu_seqlens=cu, gate_min=G_MIN)
        alone = lambda: kda_final_state_triton(k, v, g, beta, initial_state=start, cu_seqlens=cu, gate_min=G_MIN)
        return {"transition full fwd": ms(full), "transition state only": ms(alone)}


def decode_variants(N, H):
    """Decode kernel at several (BV, num_warps) settings."""
    from openk3.ops.kda.triton import decode

    q, k, g = (torch.randn(N, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v = torch.randn(N, H, V, device="cuda", dtype=torch.bfloat16)
    beta = torch.rand(N, H, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(2 * N, H, K, V, device="cuda")
    slots = torch.randperm(2 * N, device="cuda")[:N].to(torch.int32)
    o, g = torch.empty_like(v), -g.abs()
    for BV, nw in ((64, 4), (64, 2), (32, 4)):
        t = ms(lambda BV=BV, nw=nw: decode._kda_decode_kernel[(N, H, V // BV)](
            q, k, v, g, beta, pool, slots, o, None, None, K**-0.5, H=H, K=K, V=V, T=1, BK=K, BV=BV,
            SAVE_STATES=False, HAS_NUM_TOKENS=False, num_warps=nw))
        print(f"decode N={N} BV={BV} warps={nw}: {t:.4f} ms {2 * N * H * K * V * 4 / t / 1e9:.2f} TB/s", flush=True)


def save_json(path, info, shapes, decodes):
    with open(path, "w") as fh:
        json.dump({"info": info, "shapes": shapes, "decode": decodes}, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kda_bench.json"))
    ap.add_argument("--quick", action="store_true", help="first shape only")
    ap.add_argument("--stages", action="store_true", help="time our launches one by one, then exit")
    ap.add_argument("--tune", action="store_true", help="with --stages: also time warps and V blocks (shapes 0, 2)")
    ap.add_argument("--gate-modes", action="store_true",
                    help="time the bounded and any-gate kernels beside fla's matching paths, then exit")
    ap.add_argument("--shapes", default="0,1,2,3,4", help="indices of the shapes to run")
    ap.add_argument("--fla-shapes", default="0,1,2,3,4", help="indices of the shapes that also run fla")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kda.py needs a CUDA device (the CPU runs the kernels only under TRITON_INTERPRET=1, "
                         "for the tests)")
    picked = [(i, SHAPES[i]) for i in sorted({int(x) for x in args.shapes.split(",") if x})]
    if args.gate_modes:
        rows = [gate_modes(*shape, []) for _, shape in picked]
        print(f"\n{'ms (fwd / fwd+bwd)':<20}" + "".join(f"{w:>19}" for w in rows[0] if w.endswith(" fwd")))
        for r in rows:
            print(f"{r['shape']:<20}" + "".join(f"{r[w]:9.3f}/{r[w[:-4] + ' fwdbwd']:<9.3f}" for w in r
                                                 if w.endswith(" fwd")))
        with open(args.json.replace(".json", "_gates.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
        return
    if args.stages:
        for i, shape in picked:
            stages(*shape, tune=args.tune and i in (0, 2))
        for N in (64, 256):
            decode_variants(N, 32)
        return
    dev = torch.cuda.get_device_properties(0)
    info = {"gpu": dev.name, "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d")}
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        info["fla"] = None
    bw, tflops = ceilings()
    info.update(copy_TBps=bw, gemm_TFLOPs=tflops)
    print(info, flush=True)
    shapes, decodes = [], []
    fla_shapes = {int(x) for x in args.fla_shapes.split(",") if x}
    for i, (name, B, T, H, cu) in picked[:1] if args.quick else picked:
        row = bench_shape(name, B, T, H, cu, shapes, with_fla=i in fla_shapes)
        print({a: (round(b, 4) if isinstance(b, float) else b) for a, b in row.items()}, flush=True)
        save_json(args.json, info, shapes, decodes)  # after every shape: a run cut short keeps what it measured
    for N in (64, 256):
        print(bench_decode(N, 32, decodes, bw), flush=True)
    save_json(args.json, info, shapes, decodes)
    print("\nms; 'fused' = kda_triton_fused (activations in kernel, like fla); 'pre' = pre-activated inputs; "
          "'pass' = kda_activations + kda_triton")
    print(f"{'shape':<20}{'fused':>7}{'fla':>7}{'x fla':>6}{'pre':>7}{'pass':>7}{'sdpa':>7} |{'fused fb':>9}"
          f"{'fla fb':>8}{'x fla':>6}{'pre fb':>7}{'pass fb':>8} | {'cold s o/o+f/f':>16} | {'peak GB o/o+f/f':>16} |"
          f" {'TB/s':>5}{'TF/s':>5}")
    nan = float("nan")
    for r in shapes:
        fla_f, fla_fb, f, fb = r.get("fla fwd", nan), r.get("fla fwdbwd", nan), r["ours+fused fwd"], \
            r["ours+fused fwdbwd"]
        print(f"{r['shape']:<20}{f:7.3f}{fla_f:7.3f}{fla_f / f:6.2f}{r['ours fwd']:7.3f}{r['ours+act fwd']:7.3f}"
              f"{r.get('sdpa fwd', nan):7.3f} |{fb:9.3f}{fla_fb:8.3f}{fla_fb / fb:6.2f}{r['ours fwdbwd']:7.3f}"
              f"{r['ours+act fwdbwd']:8.3f} | {r['ours cold s']:4.1f}/{r['ours+fused cold s']:4.1f}/"
              f"{r.get('fla cold s', nan):5.1f} |"
              f" {r['ours peak GB']:5.2f}/{r['ours+fused peak GB']:5.2f}/{r.get('fla peak GB', nan):5.2f} |"
              f" {r['fused TB/s']:5.2f}{r['fused TFLOP/s']:5.0f}")
    for r in decodes:
        print(f"decode {r['decode']:<16} ours {r['ours ms']:.4f} ms {r['ours TB/s']:.2f} TB/s "
              f"({r['ours % copy']:.0f}% copy)  fla {r['fla ms']:.4f} ms ({r['fla % copy']:.0f}% copy)")
    print(f"copy {bw:.2f} TB/s, bf16 GEMM {tflops:.0f} TFLOP/s; json: {args.json}")


if __name__ == "__main__":
    main()
