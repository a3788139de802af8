"""`openk3 serve`: the OpenAI-compatible server (FastAPI under uvicorn) over the continuous-batching engine.

    openk3 serve --preset k3-tiny --port 8000            # random-init weights (seeded): a demo / test server
    openk3 serve --ckpt runs/k3-tiny --port 8000         # a training run's latest checkpoint (or a step-* dir)

Once it accepts requests it prints one line with the URL, the model, its dtype, whether decode runs as CUDA graphs,
the capacity (latent-cache tokens, sequences, the longest sequence) and the prefix-cache settings. The host and
port are checked (and the socket bound) before the model loads.

The tokenizer is the checkpoint's tokenizer.json when it has one, else the byte-level fallback
(`openk3.tokenizer`; a warning for a checkpoint whose vocabulary is larger: it was likely trained with one).
The prefix cache's hash block / page default to K3's ratio scaled to the context
(h=16, P=192 for toy contexts; h=512, P=6144 at 1M). On a GPU the engine serves bf16 by default, decodes with
Triton kernels over its paged latent cache and KDA state pool, captures the decode step as CUDA graphs at start-up
(the time is printed), and sizes the latent cache from the memory left after the weights
(--gpu-memory-utilization, as vLLM does); a sequence whose pages run out is preempted and resumed later.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import re
import socket
import sys
from pathlib import Path

from openk3.cli_options import (
    ShowDefaultsRaw,
    add_kda_options,
    check_triton,
    float_in,
    int_at_least,
    resolve_device,
)
from openk3.config import PRESETS
from openk3.serve.capacity import CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS
from openk3.serve.speculation import DEFAULT_K


def build_engine(args: argparse.Namespace):
    """The model, tokenizer and engine the arguments describe; returns (engine, model name)."""
    import torch

    from openk3.build import build_model, load_model
    from openk3.config import get_preset
    from openk3.model import configure_kda
    from openk3.serve.engine import Engine, EngineConfig
    from openk3.serve.scheduler import SchedulerConfig
    from openk3.tokenizer import ByteTokenizer, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    dtype = serving_dtype(args.dtype, device)
    if args.ckpt:  # straight onto the device, shard by shard; MXFP4-stored experts stay packed unless told
        from openk3.checkpoints import resolve_checkpoint

        ckpt = resolve_checkpoint(args.ckpt)
        model, report = load_model(ckpt, device, dtype, quantization=args.quantization)
        name, ckpt_dir = args.model_name or Path(args.ckpt).name, str(ckpt)
    else:  # constructed on the device in its dtype (no host copy)
        model, report = build_model(get_preset(args.preset), device, dtype, quantization=args.quantization)
        name, ckpt_dir = args.model_name or args.preset, None
    print(f"openk3 serve: {report.line()}", file=sys.stderr, flush=True)
    configure_kda(model, backend=args.kda_backend)
    tokenizer = load_tokenizer(ckpt_dir, model.config.vocab_size)
    if ckpt_dir is not None and isinstance(tokenizer, ByteTokenizer) and model.config.vocab_size > tokenizer.vocab_size:
        print(f"openk3 serve: warning: {ckpt_dir} has no tokenizer.json, so text is read and written byte by byte "
              f"(ids 0-{tokenizer.vocab_size - 1} of the model's {model.config.vocab_size}); a model trained with a "
              "tokenizer needs its tokenizer.json beside the weights", file=sys.stderr, flush=True)
    draft, speculative = None, args.speculative
    if speculative is None:  # the default: auto when the checkpoint holds a draft, else off
        from openk3.draft import has_draft

        speculative = "auto" if ckpt_dir is not None and has_draft(ckpt_dir) else 0
    drafts = DEFAULT_K if speculative == "auto" else speculative
    if drafts:
        from openk3.draft import load_draft

        if ckpt_dir is None:
            raise ValueError("--speculative needs --ckpt: a checkpoint (or run directory) of `openk3 draft`")
        draft = load_draft(model, ckpt_dir)
    config = EngineConfig(
        prefix_cache=not args.no_prefix_cache, hash_block=args.hash_block, page_size=args.page_size,
        cache_bytes=None if args.cache_mb is None else int(args.cache_mb * (1 << 20)),
        host_cache_bytes=int(args.host_cache_mb * (1 << 20)),
        disk_cache_dir=args.disk_cache_dir, disk_cache_bytes=int(args.disk_cache_mb * (1 << 20)),
        checkpoint_every=args.checkpoint_every, prefill_chunk_blocks=args.prefill_chunk_blocks,
        kv_pages=args.kv_pages, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, kernels=args.kernels, cuda_graphs=not args.no_cuda_graphs,
        compile_decode=not args.no_compile, compile_prefill=args.compile_prefill, seed=args.seed,
        short_prefill_tokens=args.short_prefill, prefill_split_tokens=args.prefill_split,
        speculative=drafts, auto_speculation=speculative == "auto",
        scheduler=SchedulerConfig(
            max_running=args.max_num_seqs, max_queue=args.max_queue,
            prefill_tokens_per_step=args.max_num_batched_tokens),
    )
    engine = Engine(model, tokenizer, config, draft)
    if engine.startup_seconds:
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in engine.startup_seconds.items())
        print(f"openk3 serve: engine started in {sum(engine.startup_seconds.values()):.1f} s ({phases})",
              file=sys.stderr, flush=True)
    runner = engine.runner
    if runner.graphs:
        steps = runner.captured()
        others = f" (and the {', '.join(n for n in steps if n != 'decode')} steps)" if len(steps) > 1 else ""
        print(f"openk3 serve: CUDA graphs for decode batches {steps.get('decode')}{others} captured in "
              f"{runner.capture_seconds:.2f} s", file=sys.stderr, flush=True)
        if runner.piecewise is not None:
            print(f"openk3 serve: prefill forwards of up to {runner.piecewise.buckets[-1]} tokens replay their "
                  f"per-token work from CUDA graphs ({len(runner.piecewise.buckets)} token buckets)",
                  file=sys.stderr, flush=True)
    elif runner.graph_error:
        print(f"openk3 serve: decoding eagerly, CUDA graphs off ({runner.graph_error})", file=sys.stderr, flush=True)
    if drafts:
        chosen = "chosen per step (--speculative auto)" if engine.policy is not None else "every step"
        print(f"openk3 serve: speculative decoding with the checkpoint's draft: rounds of {drafts} drafts, {chosen}",
              file=sys.stderr, flush=True)
    return engine, name


def serving_dtype(name: str, device):
    """--dtype: auto is bfloat16 on a GPU (the fast path) and the weights' own dtype elsewhere; None: keep it."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads, so that an address that cannot be
    served fails in a second with one line naming the flag; port 0 picks a free port."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host}: not an address of this machine ({exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a TIME_WAIT port is free
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        flag = "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
        raise ValueError(f"{flag}: cannot listen on {host} port {port}: {exc.strerror}") from None
    return sock


def engine_description(engine) -> str:
    """The engine as the ready line states it: device, dtype, CUDA graphs, capacity, the prefix cache's settings."""
    device = next(engine.model.parameters()).device
    cache = engine.prefix_cache
    if cache is None:
        settings = "prefix cache off"
    else:
        c, mib = cache.config, lambda n: f"{n / (1 << 20):g} MiB" if n else "off"
        settings = (f"prefix cache: hash block {c.hash_block}, page {c.page_size} tokens, device {mib(c.device_bytes)}"
                    f", host {mib(c.host_bytes)}, disk {mib(c.disk_bytes) if c.disk_dir else 'off'}")
    dtype = str(engine.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    graphs = "CUDA graphs" if engine.runner.graphs else "eager decode"
    cap = engine.capacity
    capacity = (f"capacity {cap.tokens:,} tokens, {engine.config.scheduler.max_running} sequences, "
                f"{engine.max_model_len:,} tokens a sequence")
    return f"on {device}, {dtype}, {graphs}; {capacity}; {settings}"


def ready_line(sock: socket.socket, name: str, description: str) -> str:
    """One line for the operator once the server accepts requests: the URL, the model, `engine_description`."""
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
    return f"openk3 serve: ready at {url} (model {name!r} {description}); chat page at {url.removesuffix('/v1')}/"


def check_options(args: argparse.Namespace) -> None:
    """What the flags must agree on, checked before the model loads (ValueError naming the flag)."""
    if args.ckpt:  # a missing or empty --ckpt is one line here, not a failed engine process's traceback
        from openk3.checkpoints import resolve_checkpoint

        resolve_checkpoint(args.ckpt)
    device = resolve_device(args.device)
    check_triton(device, "--kernels", args.kernels)
    check_triton(device, "--kda-backend", args.kda_backend)
    if args.page_size is not None:
        hash_block = args.hash_block or default_hash_block(args)
        if args.page_size % hash_block:
            raise ValueError(f"--page-size {args.page_size} must be a multiple of the hash block ({hash_block}, "
                             "--hash-block)")
    if args.disk_cache_dir is not None:
        if not args.host_cache_mb:
            raise ValueError("--disk-cache-dir needs a host tier above it: set --host-cache-mb too")
        try:
            os.makedirs(args.disk_cache_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--disk-cache-dir {args.disk_cache_dir}: cannot use it as a directory "
                             f"({exc.strerror})") from None


def default_hash_block(args: argparse.Namespace) -> int:
    """The hash block the engine picks for the context (--max-model-len, else the model's), read from the preset
    or the checkpoint's config.json."""
    from openk3.serve.engine import default_block_sizes

    context = args.max_model_len
    if context is None and args.ckpt:
        from openk3.checkpoints import resolve_checkpoint
        from openk3.interop import config_from_json
        from openk3.interop.files import read_config

        context = config_from_json(read_config(resolve_checkpoint(args.ckpt)))[0].max_seq_len
    elif context is None:
        from openk3.config import get_preset

        context = get_preset(args.preset).max_seq_len
    return default_block_sizes(context)[0]


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from openk3.serve.api import create_app
    from openk3.serve.core import keep_startup_objects, release_startup_objects, stop_signals_handled_by
    from openk3.serve.vision import RemoteImages

    check_options(args)
    sock = listen_socket(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.engine_process:
        from openk3.serve.core import ProcessCore

        core, name = ProcessCore.start_process(args, build_engine, engine_description)
        description = core.info.ready
    else:
        engine, name = build_engine(args)
        core, description = engine, engine_description(engine)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                print(ready_line(sock, name, description), flush=True)

        def capture_signals(self):
            """uvicorn's, without raising the signal again after the graceful shutdown: SIGINT and SIGTERM are
            how the server is stopped, so it exits with status 0 (not a KeyboardInterrupt, not status -15)."""
            return stop_signals_handled_by(self.handle_exit)

    remote = RemoteImages() if args.allow_remote_images else None
    config = uvicorn.Config(create_app(core, name, remote), host=args.host, port=args.port, log_level=args.log_level)
    keep_startup_objects()
    try:
        Server(config).run(sockets=[sock])
    finally:
        if args.engine_process:
            core.stop()  # (the app's shutdown has stopped it, unless uvicorn was forced out by a second Ctrl-C)
        release_startup_objects()
    return 0


def speculative_drafts(value: str) -> int | str:
    """--speculative: auto, or K >= 0 drafts per round (0: off)."""
    if value == "auto":
        return value
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be auto or a number of drafts K >= 0, got {value!r}")
    return int(value)


def tcp_port(value: str) -> int:
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535; 0 picks a free one)")
    return int(value)


HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def listen_host(value: str) -> str:
    """An IP address or a syntactically valid host name (whether it is this machine's is checked at bind time)."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if len(value) > 253 or not HOST_NAME.fullmatch(value) or value.replace(".", "").isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is neither an IP address nor a host name")
    return value


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server with the K3 hybrid prefix cache",
                              description=__doc__, formatter_class=ShowDefaultsRaw)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default="k3-tiny",
                        help=f"random-init model of this preset: {', '.join(sorted(PRESETS))} (default k3-tiny)")
    source.add_argument("--ckpt", help="checkpoint directory (or a training run directory: its latest)")
    p.add_argument("--model-name", help="the name clients pass as `model` (default: preset or checkpoint dir)")
    p.add_argument("--host", type=listen_host, default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=tcp_port, default=8000, help="TCP port (default 8000; 0: a free one)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random-init weights and of the requests that set none")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--threads", type=int_at_least(0), default=0, help="torch CPU threads (0: as many as torch picks)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and caches (auto: bfloat16 on a GPU, as built or stored on a CPU)")
    p.add_argument("--quantization", choices=["none", "mxfp4"], default=None,
                   help="routed experts kept MXFP4 in memory (4-bit values and a scale per 32, dequantized inside "
                        "the expert GEMMs); none: plain. Default: as stored (an MXFP4 checkpoint stays packed, a "
                        "preset is plain)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the hybrid prefix cache")
    p.add_argument("--hash-block", type=int_at_least(1), default=None,
                   help="tokens per hash block h (default: by context)")
    p.add_argument("--page-size", type=int_at_least(1), default=None,
                   help="tokens per physical page P, a multiple of h (default 12 h)")
    p.add_argument("--checkpoint-every", type=int_at_least(1), default=None,
                   help="hash blocks between KDA checkpoints during prefill (default: 1, every boundary, on CPU; "
                        "512 tokens on a GPU)")
    p.add_argument("--prefill-chunk-blocks", type=int_at_least(1), default=None,
                   help="hash blocks per prefill forward at most (checkpoints inside it are taken in the same pass; "
                        "default 12 on CPU, 16384 tokens on a GPU)")
    p.add_argument("--cache-mb", type=float_in(0, open_low=True), default=None,
                   help="prefix cache device tier (MiB; default: a fifth of the cache memory on a GPU, 256 on CPU; "
                        "--no-prefix-cache turns the cache off)")
    p.add_argument("--host-cache-mb", type=float_in(0), default=0, help="prefix cache host tier (MiB, 0: off)")
    p.add_argument("--disk-cache-dir", default=None,
                   help="prefix cache disk tier directory (created if missing; needs --host-cache-mb)")
    p.add_argument("--disk-cache-mb", type=float_in(0), default=1024, help="prefix cache disk tier (MiB)")
    p.add_argument("--max-num-seqs", "--max-running", dest="max_num_seqs", type=int_at_least(1), default=128,
                   help="sequences running (decoded together) at most; also the largest CUDA-graph batch "
                        "(default 128)")
    p.add_argument("--max-model-len", type=int_at_least(2), default=None, metavar="N",
                   help="tokens of one sequence (prompt + reply) at most (default: the model's max_seq_len; the "
                        "MLA layers are NoPE, so a longer context only needs memory)")
    p.add_argument("--gpu-memory-utilization", type=float_in(0, 1, open_low=True), default=0.9, metavar="F",
                   help="fraction of the GPU's memory for weights, activations and the caches: the latent cache "
                        "gets what is left (default 0.9)")
    p.add_argument("--max-queue", type=int_at_least(1), default=1024, help="waiting requests before 429s")
    p.add_argument("--max-num-batched-tokens", "--prefill-tokens", dest="max_num_batched_tokens",
                   type=int_at_least(1), default=None, metavar="N",
                   help="prompt tokens prefilled per engine step, beside the decode batch: lower keeps decoding "
                        "smoother while long prompts arrive, higher gives a faster first token (default "
                        f"{CPU_BATCHED_TOKENS} on CPU, {GPU_BATCHED_TOKENS} on a GPU)")
    p.add_argument("--kv-pages", type=int_at_least(2), default=None,
                   help="physical pages of the MLA latent pool (default: from memory on a GPU, see "
                        "--gpu-memory-utilization; a fixed 131,072 tokens plus the cache on CPU)")
    p.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"],
                   help="decode kernels: triton (the GPU path, CUDA only), torch (the reference); auto: by device")
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on a GPU (no CUDA graphs)")
    p.add_argument("--no-compile", action="store_true",
                   help="capture the decode step without torch.compile (faster start-up, slower decode)")
    p.add_argument("--compile-prefill", action="store_true",
                   help="also torch.compile the FFN, norm and AttnRes units that prefill runs (GPU; dynamic shapes; "
                        "experimental: on an H200 prefills of new shapes recompiled inside a 32-client run, "
                        "bench/RESULTS.md)")
    p.add_argument("--short-prefill", type=int_at_least(0), default=None, metavar="N",
                   help="prompt chunks of at most N tokens prefill together in one CUDA-graph step (default 256 on a "
                        "GPU with CUDA graphs and without speculative decoding; 0: off)")
    p.add_argument("--prefill-split", type=int_at_least(0), default=None, metavar="N",
                   help="while sequences decode, a prefill forward of T tokens replayed from the prefill graphs runs "
                        "over ceil(T / N) engine steps, decode steps between its pieces, so one long prompt does not "
                        "stall the others' tokens for its whole forward (default 1024 on a GPU; 0: off)")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs in chat requests (10 s and 20 MiB at most each, no redirects); "
                        "by default only inline data: URLs are accepted")
    p.add_argument("--speculative", type=speculative_drafts, default=None, metavar="K|auto",
                   help="speculative decoding with the checkpoint's draft (`openk3 draft`), the target's distribution "
                        "kept exactly: K drafted tokens per verification at every step, or auto: rounds of "
                        f"{DEFAULT_K} drafts or plain decoding, chosen per step from the measured acceptance and the "
                        "batch size (default: auto when the checkpoint holds a draft, else off; 0: off)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own (the default), so that the HTTP server's Python work "
                        "overlaps the engine's steps instead of taking turns with them on one GIL")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="the server's and the engine's log records from this level up")
    add_kda_options(p)
    p.set_defaults(func=run_serve)
