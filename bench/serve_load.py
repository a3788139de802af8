"""A load generator for any OpenAI-compatible server (`openk3 serve`, vLLM, SGLang, ...), streamed over HTTP.

    python bench/serve_load.py http://127.0.0.1:8000 --request-rate 12 --num-requests 96 \\
        --prompt-len 1000:11000 --output-len 32:256 --temperature 0.8 --slo ttft=0.5,tpot=0.05 --json out.json
    python bench/serve_load.py URL --max-concurrency 8 --num-requests 64 --prompt-len 60:200 --output-len 256
    python bench/serve_load.py URL --workload agent --prompt-len 8000 --agent-turns 8 --agent-turn-len 500

Arrivals: `--request-rate R` requests a second, Poisson (exponential gaps, the default) or `--arrival fixed`
(gaps of 1/R); `inf` (the default) sends them all at once, or, with `--max-concurrency C`, runs a closed loop: C
clients, each sending its next request when its last one finished. With a finite rate, `--max-concurrency` caps
the requests in flight (an arrival waits for a free slot). `--num-requests N` and / or `--duration S` (no new
request starts after S seconds; those in flight finish) bound the run.

Prompts: real text cut at random places from a corpus (the Python standard library's sources, as
`openk3 train` uses; `--data PATH` for your own), of `--prompt-len` tokens: N, or uniform A:B. With `--tokenizer`
(a tokenizer.json, a checkpoint directory holding one, or `bytes` for openk3's byte-level fallback) a prompt is
the decoded text of a window of N corpus tokens; without it, a probe request measures the server's tokens per
character on the corpus (its `usage.prompt_tokens`; `probe` says how) and a prompt is that many characters: an
average, so a prompt can be some 10% off (more for short ones) where the ratio varies over the text. The same
tokenizer gives the same prompts on every server, for a fair comparison. Either way the report counts the
tokens the server's usage says it received. `--workload agent` runs sessions that grow turn by turn:
each turn resends the whole conversation (the previous replies included) plus `--agent-turn-len` new tokens, so
a server's prefix cache is exercised; `--num-requests` then counts sessions, each of `--agent-turns` requests.
Prompts depend on `--seed` and the request's index only: a second run with the same seed on the same server
finds them in its prefix cache (the report's cached tokens), so warm up with another seed.

Replies: `--output-len` tokens, N or uniform A:B, as `max_tokens`, with `ignore_eos` (vLLM's and openk3's field)
so that every reply runs to its length; a server that refuses the field is run without it (the report says so,
and counts the tokens each reply really had). Sampling: `--temperature`, `--top-p`.

Every request is streamed (`stream_options.include_usage`) through `--endpoint completions` (/v1/completions) or
`chat` (/v1/chat/completions). Times are taken on arrival of each streamed chunk:
- TTFT: from sending the request to its first chunk with text; E2E: to the end of its stream;
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; ITL: the gaps between chunks with text, over all of them
  (a chunk can hold several tokens, e.g. while a server holds back part of a UTF-8 character);
- throughput: finished requests, output tokens and prompt + output tokens, a second of the run (first send to
  last finish); goodput: finished requests a second whose TTFT, TPOT and E2E meet `--slo` (seconds);
- failures: counted by HTTP status, or by the error's name (a dropped connection, a stream that ended badly).
It prints a table, and with `--json PATH` writes the report with one record per request. Before the clock starts:
GET /v1/models (for the model name, unless `--model`), the probe requests (max_tokens 1), and every prompt (a run
bounded by `--duration` alone makes each as it starts).
Needs httpx (the project's `test` extra) and openk3 importable (the corpus, the tokenizers).

Python: `run_load(url, **options)` (the fields of `LoadConfig`) runs the same and returns the report as a dict;
`load(url, config)` is the coroutine, for callers already inside an event loop. The report's keys: see `summarize`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
WORKLOADS = ("text", "agent")
ARRIVALS = ("poisson", "fixed")
SLO_METRICS = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)
STATS = ("mean", *(f"p{q}" for q in PERCENTILES))
ITL_BOUNDS_S = (0.025, 0.05, 0.1)  # the report counts the inter-token gaps longer than these
PROBE_SNIPPET = 512  # characters: the probe prompts are one corpus snippet, then it and more from random places
PROBE_CHARS = (2048, 32768)  # the calibrating probe's size: the longest prompt asked for, within these bounds
REFUSED_FIELD = (400, 422)  # what servers answer a body field they do not know


class LoadError(Exception):
    """A problem stated in one line: an unreachable server, a refused probe, a bad setting."""


@dataclass(frozen=True)
class Lengths:
    """A token count drawn uniformly from [low, high] (low == high: fixed)."""

    low: int
    high: int

    @classmethod
    def parse(cls, value: str | int | Lengths, flag: str) -> Lengths:
        if isinstance(value, Lengths):
            return value
        text = str(value).strip()
        try:
            low, high = (int(p) for p in text.split(":")) if ":" in text else (int(text),) * 2
        except ValueError:
            raise LoadError(f"{flag}: expected N or A:B (token counts), got {value!r}") from None
        if not 1 <= low <= high:
            raise LoadError(f"{flag}: expected 1 <= A <= B, got {value!r}")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def parse_slo(value: str | dict | None) -> dict[str, float]:
    """"ttft=0.5,tpot=0.05,e2e=10" (seconds; any subset) -> {"ttft": 0.5, ...}."""
    if value is None or isinstance(value, dict):
        items = dict(value or {})
    else:
        items = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, eq, bound = part.partition("=")
            try:
                items[name.strip()] = float(bound) if eq else None
            except ValueError:
                raise LoadError(f"--slo: {part!r} is not METRIC=SECONDS") from None
    for name, bound in items.items():
        if name not in SLO_METRICS:
            raise LoadError(f"--slo: unknown metric {name!r} (known: {', '.join(SLO_METRICS)})")
        if bound is None or not bound > 0:
            raise LoadError(f"--slo: {name} needs a bound in seconds > 0, got {bound!r}")
    return {k: float(v) for k, v in items.items()}


@dataclass
class LoadConfig:
    """One run's workload. Each field is the CLI flag of the same name (`--prompt-len` is `prompt_len`)."""

    endpoint: str = "completions"  # "completions" or "chat"
    model: str | None = None  # None: the first model /v1/models lists
    num_requests: int | None = None  # requests (agent: sessions); None: 100 (agent: 1), or unbounded with duration
    duration: float | None = None  # seconds after which no new request (agent: session) starts
    request_rate: float = math.inf  # arrivals a second; inf: all at once, or a closed loop with max_concurrency
    arrival: str = "poisson"  # "poisson" or "fixed" gaps at a finite rate
    max_concurrency: int | None = None  # requests (agent: sessions) in flight at most
    workload: str = "text"  # "text": independent prompts; "agent": sessions that grow turn by turn
    prompt_len: str | int | Lengths = 256  # tokens of each prompt (agent: of a session's first turn): N or "A:B"
    output_len: str | int | Lengths = 128  # max_tokens of each request: N or "A:B"
    agent_turns: int = 4  # requests per agent session
    agent_turn_len: str | int | Lengths = 256  # new tokens each later agent turn adds after the previous reply
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = True  # send ignore_eos (dropped, with a note, when the server refuses the field)
    slo: str | dict | None = None  # "ttft=0.5,tpot=0.05,e2e=10" (seconds) for goodput
    seed: int = 0  # prompts, lengths and Poisson gaps
    tokenizer: str | None = None  # tokenizer.json, a directory holding one, or "bytes"; None: calibrate by probes
    data: str | None = None  # corpus: a text / JSONL file or a directory; None: the standard library's sources
    timeout: float = 3600.0  # seconds a request may take
    api_key: str | None = None  # sent as a bearer token
    progress: bool = False  # a tqdm bar on stderr

    def __post_init__(self):
        self.prompt_len = Lengths.parse(self.prompt_len, "--prompt-len")
        self.output_len = Lengths.parse(self.output_len, "--output-len")
        self.agent_turn_len = Lengths.parse(self.agent_turn_len, "--agent-turn-len")
        self.slo = parse_slo(self.slo)
        self.request_rate = float(self.request_rate)
        choices = {"endpoint": ENDPOINTS, "workload": WORKLOADS, "arrival": ARRIVALS}
        for name, allowed in choices.items():
            if (value := getattr(self, name)) not in allowed:
                raise LoadError(f"--{name.replace('_', '-')}: {value!r} is not one of {', '.join(allowed)}")
        positive = {"request_rate": self.request_rate, "duration": self.duration, "timeout": self.timeout,
                    "num_requests": self.num_requests, "max_concurrency": self.max_concurrency,
                    "agent_turns": self.agent_turns}
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise LoadError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if not self.temperature >= 0:
            raise LoadError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LoadError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.num_requests is None and self.duration is None:
            self.num_requests = 1 if self.workload == "agent" else 100
        if self.num_requests is None and math.isinf(self.request_rate) and self.max_concurrency is None:
            raise LoadError("--duration with --request-rate inf needs --max-concurrency or --num-requests")

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("prompt_len", "output_len", "agent_turn_len"):
            out[name] = str(getattr(self, name))
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        for name in ("api_key", "progress"):
            out.pop(name)
        return out


# ---- prompts ------------------------------------------------------------------------------------------------

def cyclic(seq, start: int, n: int):
    """n items of `seq` (a str or list) from `start`, wrapping around its end as often as needed."""
    if start + n <= len(seq):
        return seq[start:start + n]
    return (seq * ((start + n) // len(seq) + 1))[start:start + n]


def load_tokenizer(spec: str):
    from openk3.tokenizer import ByteTokenizer, TextTokenizer

    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
    if not path.is_file():
        raise LoadError(f"--tokenizer: {path} is not a tokenizer.json file (or pass 'bytes')")
    return TextTokenizer.from_file(path)


class PromptSource:
    """Text of about n tokens cut from the corpus at a random place: a window of n corpus tokens when a tokenizer
    is given (decoded; re-encoding it can differ by a token at the window's edges), else n / tokens_per_char
    characters (the server's ratio, measured by `probe`)."""

    def __init__(self, corpus: str, tokenizer=None):
        self.corpus, self.tokenizer = corpus, tokenizer
        self.ids = tokenizer.encode_plain(corpus) if tokenizer is not None else None

    def text(self, rng: random.Random, n: int, tokens_per_char: float | None = None) -> tuple[str, int | None]:
        """(the text, its token count by the local tokenizer, or None without one: then tokens_per_char is needed)."""
        if self.ids is not None:
            text = self.tokenizer.decode_plain(cyclic(self.ids, rng.randrange(len(self.ids)), n))
            return text, len(self.tokenizer.encode_plain(text))
        chars = max(1, round(n / tokens_per_char))
        return cyclic(self.corpus, rng.randrange(len(self.corpus)), chars), None


@functools.lru_cache(maxsize=2)
def prompt_source(data: str | None, tokenizer: str | None) -> PromptSource:
    """Cached: a script calls run_load once a row, and tokenizing the corpus takes seconds."""
    return PromptSource(load_corpus(data), load_tokenizer(tokenizer) if tokenizer else None)


def load_corpus(data: str | None) -> str:
    from openk3.train.data import load_documents

    try:
        docs = load_documents(data)
    except (OSError, ValueError) as exc:
        raise LoadError(str(exc)) from None
    return "\n\n".join(d.text for d in docs)


@dataclass
class Job:
    """One arrival: a text request, or an agent session (its first prompt, then each later turn's new text)."""

    index: int
    texts: list[str]
    local_tokens: list[int | None]
    targets: list[int]
    output_lens: list[int]


def make_job(index: int, cfg: LoadConfig, source: PromptSource, tokens_per_char: float) -> Job:
    rng = random.Random(f"{cfg.seed}:{index}")  # a job's text depends on the seed and its index only
    turns = cfg.agent_turns if cfg.workload == "agent" else 1
    targets = [cfg.prompt_len.sample(rng)] + [cfg.agent_turn_len.sample(rng) for _ in range(turns - 1)]
    texts, local = zip(*(source.text(rng, n, tokens_per_char) for n in targets))
    return Job(index, list(texts), list(local), targets, [cfg.output_len.sample(rng) for _ in range(turns)])


# ---- one streamed request -----------------------------------------------------------------------------------

@dataclass
class Record:
    """One request's outcome. Times in seconds; `start` from the run's start. status: "ok", an HTTP status, or an
    error's name."""

    job: int
    turn: int  # 1: a text request, or an agent session's first
    start: float
    status: str = "ok"
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int | None = None  # the server's usage (None when it reported none)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where reported
    output_tokens: int | None = None  # the server's usage, else the chunks with text
    prompt_target: int = 0  # tokens asked for (agent: of this turn's new text only)
    prompt_local: int | None = None  # the local tokenizer's count of that text (None without --tokenizer)
    output_target: int = 0
    chunks: int = 0  # stream chunks with text (a chunk can carry several tokens)
    error: str | None = None
    itl: list[float] = field(default_factory=list, repr=False)
    reply: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tpot(self) -> float | None:
        if not self.ok or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def export(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("itl", "reply")}
        return {**out, "tpot": self.tpot}


def error_text(response_body: bytes) -> str:
    try:
        body = json.loads(response_body)
        message = body.get("error", body) if isinstance(body, dict) else body
        message = message.get("message", message) if isinstance(message, dict) else message
    except ValueError:
        message = response_body.decode(errors="replace")
    return " ".join(str(message).split())[:300]


async def stream_request(client, url: str, payload: dict, chat: bool, record: Record, t0: float) -> Record:
    """Send one streamed request; fill `record` from its chunks (times from `t0`, the run's start)."""
    sent = time.perf_counter()
    record.start = sent - t0
    try:
        await read_stream(client, url, payload, chat, record, sent)
    except httpx.HTTPError as exc:
        record.status, record.error = type(exc).__name__, str(exc)[:300]
    except ValueError as exc:  # a chunk that is not JSON
        record.status, record.error = "bad_chunk", str(exc)[:300]
    if record.e2e is None:  # a failure: the time it took to fail
        record.e2e = time.perf_counter() - sent
    return record


async def read_stream(client, url: str, payload: dict, chat: bool, record: Record, sent: float) -> None:
    """The request and its server-sent events: text chunks (their arrival times), the usage chunk, [DONE]."""
    pieces, last, end_reason, done = [], None, None, False
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            record.status, record.error = str(response.status_code), error_text(await response.aread())
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            now, chunk = time.perf_counter(), json.loads(data)
            if "error" in chunk:
                record.status, record.error = "stream_error", error_text(data.encode())
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
                record.prompt_tokens, record.output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                end_reason = choice.get("finish_reason") or end_reason
                if text:
                    if last is None:
                        record.ttft = now - sent
                    else:
                        record.itl.append(now - last)
                    last = now
                    pieces.append(text)
    record.e2e = time.perf_counter() - sent
    if not done or end_reason in ("error", "cancelled"):
        record.status = "stream_error"
        record.error = f"finish_reason {end_reason}" if done else "the stream ended without [DONE]"
        return
    record.reply, record.chunks = "".join(pieces), len(pieces)
    record.ttft = record.e2e if record.ttft is None else record.ttft  # a reply without text: its first byte is its end
    if record.output_tokens is None:
        record.output_tokens = record.chunks


# ---- the run ------------------------------------------------------------------------------------------------

class Runner:
    """Sends the jobs of one LoadConfig to one server and collects their Records."""

    def __init__(self, client, base: str, cfg: LoadConfig, model: str, ignore_eos: bool):
        self.client, self.cfg, self.model, self.ignore_eos = client, cfg, model, ignore_eos
        self.url, self.chat = base + ENDPOINTS[cfg.endpoint], cfg.endpoint == "chat"
        self.records: list[Record] = []
        self.t0 = 0.0
        self.bar = None

    def payload(self, prompt: str | list[dict], max_tokens: int) -> dict:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": self.cfg.temperature,
                "top_p": self.cfg.top_p, "stream": True, "stream_options": {"include_usage": True}}
        body["messages" if self.chat else "prompt"] = prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def run_job(self, job: Job) -> None:
        """A text request, or an agent session: each turn sends the conversation so far plus the turn's new text;
        a failed turn ends its session."""
        conversation: list[dict] | str = [] if self.chat else ""
        for turn, (text, local, target, max_tokens) in enumerate(
                zip(job.texts, job.local_tokens, job.targets, job.output_lens)):
            if self.chat:
                conversation = [*conversation, {"role": "user", "content": text}]
            else:
                conversation = f"{conversation}\n\n{text}" if turn else text
            record = Record(job.index, turn + 1, 0.0, prompt_target=target, prompt_local=local,
                            output_target=max_tokens)
            await stream_request(self.client, self.url, self.payload(conversation, max_tokens), self.chat, record,
                                 self.t0)
            self.records.append(record)
            if self.bar is not None:
                self.bar.update()
            if not record.ok:
                return
            if self.chat:
                conversation = [*conversation, {"role": "assistant", "content": record.reply}]
            else:
                conversation += record.reply

    async def run(self, make: Callable[[int], Job]) -> float:
        """Start jobs on the arrival schedule until the count or the duration is reached; returns the run's
        wall time (first send to last finish)."""
        cfg = self.cfg
        rng = random.Random(f"{cfg.seed}:arrivals")
        slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        tasks, offset, index = [], 0.0, 0
        self.t0 = time.perf_counter()

        def expired() -> bool:
            return cfg.duration is not None and time.perf_counter() - self.t0 >= cfg.duration

        async def guarded(job: Job) -> None:
            try:
                await self.run_job(job)
            finally:
                if slots is not None:
                    slots.release()

        while cfg.num_requests is None or index < cfg.num_requests:
            delay = self.t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            if expired():
                break
            tasks.append(asyncio.create_task(guarded(make(index))))
            index += 1
            if not math.isinf(cfg.request_rate):
                offset += rng.expovariate(cfg.request_rate) if cfg.arrival == "poisson" else 1 / cfg.request_rate
        await asyncio.gather(*tasks)
        ends = [r.start + (r.e2e or 0.0) for r in self.records]
        return max(ends, default=0.0) - min((r.start for r in self.records), default=0.0)


async def fetch_model(client, base: str) -> str:
    response = await client.get(base + "/v1/models")
    if response.status_code != 200:
        raise LoadError(f"GET {base}/v1/models answered {response.status_code}: {error_text(response.content)}; "
                        "pass --model")
    models = response.json().get("data") or []
    if not models:
        raise LoadError(f"{base}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def probe_request(runner: Runner, text: str) -> httpx.Response:
    """One unstreamed request of max_tokens 1; a refused ignore_eos is dropped for the rest of the run."""
    prompt = [{"role": "user", "content": text}] if runner.chat else text
    while True:
        body = {**runner.payload(prompt, 1), "stream": False}
        del body["stream_options"]
        response = await runner.client.post(runner.url, json=body)
        if response.status_code in REFUSED_FIELD and runner.ignore_eos and "ignore_eos" in response.text:
            runner.ignore_eos = False
            continue
        return response


def probe_usage(runner: Runner, response: httpx.Response) -> dict:
    if response.status_code != 200:
        raise LoadError(f"the server answered {response.status_code} to a probe request on {runner.url}: "
                        f"{error_text(response.content)}")
    usage = response.json().get("usage") or {}
    if not isinstance(usage.get("prompt_tokens"), int):
        raise LoadError(f"the server's reply to a probe request on {runner.url} has no usage.prompt_tokens")
    return usage


async def probe(runner: Runner, corpus: str, calibrate: bool) -> tuple[float | None, list[dict]]:
    """Before the run: a snippet of the corpus as a prompt (the server answers at all, and takes ignore_eos, else
    the run goes without it); to `calibrate`, then that snippet with more from random places, and the server's
    tokens per character on the corpus is the slope between the two prompts' usage (an average over the corpus,
    without the chat template's or a BOS token's share). The second prompt has as many characters as the longest
    prompt asked for has tokens (within PROBE_CHARS; a token spans a character or more), halved while the server
    refuses it as too long. Returns (tokens per character or None, the probes' usage)."""
    rng = random.Random(f"{runner.cfg.seed}:probe")
    snippet = lambda: cyclic(corpus, rng.randrange(len(corpus)), PROBE_SNIPPET)
    first = snippet()
    usages = [probe_usage(runner, await probe_request(runner, first))]
    if not calibrate:
        return None, usages
    chars = min(max(runner.cfg.prompt_len.high, PROBE_CHARS[0]), PROBE_CHARS[1])
    more = [snippet() for _ in range(chars // PROBE_SNIPPET - 1)]
    while True:
        response = await probe_request(runner, first + "".join(more))
        if response.status_code not in (400, 413) or PROBE_SNIPPET * (len(more) + 1) <= PROBE_CHARS[0]:
            break
        more = more[:len(more) // 2]
    usages.append(probe_usage(runner, response))
    slope = (usages[1]["prompt_tokens"] - usages[0]["prompt_tokens"]) / (PROBE_SNIPPET * len(more))
    if not slope > 0:
        raise LoadError(f"probe prompts of {PROBE_SNIPPET} and {PROBE_SNIPPET * (len(more) + 1)} characters counted "
                        f"{[u['prompt_tokens'] for u in usages]} tokens: cannot calibrate; pass --tokenizer")
    return slope, usages


async def load(url: str, config: LoadConfig) -> dict:
    """The coroutine behind `run_load`."""
    cfg, base = config, url.rstrip("/").removesuffix("/v1")
    source = prompt_source(cfg.data, cfg.tokenizer)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout, connect=30.0), limits=limits,
                                 headers=headers) as client:
        try:
            model = cfg.model or await fetch_model(client, base)
            runner = Runner(client, base, cfg, model, cfg.ignore_eos)
            tokens_per_char, probe_usage = await probe(runner, source.corpus, calibrate=source.ids is None)
        except httpx.HTTPError as exc:
            raise LoadError(f"cannot reach {base}: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            raise LoadError(f"{base} answered a probe with something that is not JSON ({exc})") from None
        jobs: dict[int, Job] = {}

        def make(index: int) -> Job:
            if index not in jobs:
                jobs[index] = make_job(index, cfg, source, tokens_per_char)
            return jobs[index]

        for index in range(cfg.num_requests or 0):  # built before the clock starts
            make(index)
        turns = cfg.agent_turns if cfg.workload == "agent" else 1
        total = cfg.num_requests * turns if cfg.num_requests and cfg.duration is None else None
        # the measuring process's own pauses must not count as the server's: a full collection walks every object
        # Python tracks (with torch imported, as bench/serve_gpu.py has it, ~175k: 76 ms on a 2-core CPU, longer
        # than the 50 ms inter-token SLO), so what exists before the clock starts is frozen out of the collector
        gc.collect()
        gc.freeze()
        try:
            with tqdm(total=total, unit="req", disable=not cfg.progress, file=sys.stderr, leave=False) as runner.bar:
                duration = await runner.run(make)
        finally:
            gc.unfreeze()
    tokens = f"tokenizer {cfg.tokenizer}" if cfg.tokenizer else f"calibrated {tokens_per_char:.4g} tok/char"
    return summarize(runner.records, duration, cfg, {"url": base, "model": model, "ignore_eos": runner.ignore_eos,
                                                     "prompt_lengths": tokens,
                                                     "tokens_per_char": tokens_per_char, "probe_usage": probe_usage})


def run_load(url: str, config: LoadConfig | None = None, **options) -> dict:
    """Run one workload against the server at `url` (http://host:port, with or without /v1) and return the report
    (`summarize`'s dict). Give a LoadConfig, or its fields as keywords: run_load(url, max_concurrency=8,
    num_requests=64, prompt_len="60:200", output_len=256, temperature=0.8, top_p=0.95). Raises LoadError (one line)
    for a bad field, an unreachable server or a refused probe; the requests' own failures are counted instead."""
    if config is None:
        config = LoadConfig(**options)
    elif options:
        raise TypeError("run_load: pass a LoadConfig or its fields as keywords, not both")
    return asyncio.run(load(url, config))


# ---- the report ---------------------------------------------------------------------------------------------

def distribution(values: list[float]) -> dict | None:
    """mean, p50, p90, p99 (linear interpolation), or None for no values."""
    if not values:
        return None
    return {"mean": float(np.mean(values)), **{f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}}


def meets(record: Record, slo: dict[str, float]) -> bool:
    """Finished within every bound (a one-token reply has no TPOT and meets any TPOT bound)."""
    values = {"ttft": record.ttft, "e2e": record.e2e, "tpot": record.tpot}
    return record.ok and all(values[k] is None or values[k] <= bound for k, bound in slo.items())


def summarize(records: list[Record], duration: float, cfg: LoadConfig, meta: dict) -> dict:
    """The report: meta (`url`, `model`, `ignore_eos` as sent, `prompt_lengths` how they were made,
    `tokens_per_char` calibrated or None, `probe_usage`), the `config`, counts (`completed`, `failed`, `failures`
    and `failure_examples` by status), token totals (from the server's usage; `cached_tokens` None when the server
    reports none), `duration_s`, `request_throughput` (req/s), `output_tok_per_s`, `total_tok_per_s`,
    distributions {mean, p50, p90, p99} in seconds of `ttft_s`, `tpot_s`, `itl_s`, `e2e_s` (None with no data),
    `itl_over_s` (the fraction of gaps longer than 25 / 50 / 100 ms), `tokens_per_chunk` (ITL is per chunk with
    text: above 1, a gap spans several tokens), `goodput` (with --slo),
    `turns` (agent: per-turn means), and `requests` (one record each, in start order)."""
    records = sorted(records, key=lambda r: r.start)
    done = [r for r in records if r.ok]
    failures: dict[str, int] = {}
    examples: dict[str, str] = {}  # each status's first error message
    for r in records:
        if not r.ok:
            failures[r.status] = failures.get(r.status, 0) + 1
            examples.setdefault(r.status, r.error or "")
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    report = {
        **meta,
        "config": cfg.as_dict(),
        "completed": len(done), "failed": len(records) - len(done), "failures": failures,
        "failure_examples": examples,
        "usage_reported": bool(done) and all(r.prompt_tokens is not None for r in done),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "cached_tokens": sum(cached) if cached else None,
        "request_throughput": rate(len(done)),
        "output_tok_per_s": rate(output_tokens), "total_tok_per_s": rate(prompt_tokens + output_tokens),
        "ttft_s": distribution([r.ttft for r in done]),
        "tpot_s": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl_s": distribution(gaps := [gap for r in done for gap in r.itl]),
        "itl_over_s": {str(bound): sum(g > bound for g in gaps) / len(gaps) if gaps else None
                       for bound in ITL_BOUNDS_S},
        "tokens_per_chunk": output_tokens / chunks if (chunks := sum(r.chunks for r in done)) else None,
        "e2e_s": distribution([r.e2e for r in done]),
    }
    if cfg.slo:
        good = sum(meets(r, cfg.slo) for r in done)
        report["goodput"] = {"slo_s": cfg.slo, "requests": good, "req_per_s": rate(good),
                             "fraction": good / len(records) if records else None}
    if cfg.workload == "agent":
        report["turns"] = [turn_summary(t, [r for r in done if r.turn == t]) for t in range(1, cfg.agent_turns + 1)]
    report["requests"] = [r.export() for r in records]
    return report


def turn_summary(turn: int, records: list[Record]) -> dict:
    def mean(values):
        values = [v for v in values if v is not None]
        return float(np.mean(values)) if values else None

    return {"turn": turn, "completed": len(records), "prompt_tokens": mean([r.prompt_tokens for r in records]),
            "cached_tokens": mean([r.cached_tokens for r in records]), "ttft_s": mean([r.ttft for r in records]),
            "tpot_s": mean([r.tpot for r in records])}


def format_report(report: dict) -> str:
    cfg = report["config"]
    arrivals = (f"{cfg['arrival']} {cfg['request_rate']}/s" if cfg["request_rate"] != "inf"
                else "all at once" if not cfg["max_concurrency"] else "closed loop")
    if cfg["max_concurrency"]:
        arrivals += f", at most {cfg['max_concurrency']} in flight"
    kind = (f"agent sessions of {cfg['agent_turns']} turns (+{cfg['agent_turn_len']} tokens a turn)"
            if cfg["workload"] == "agent" else "text prompts")
    fmt = lambda x, scale=1.0, spec=".1f": "-" if x is None else format(x * scale, spec)
    lines = [
        f"{report['url']}  model {report['model']}  {ENDPOINTS[cfg['endpoint']]}",
        f"workload    {kind}; {arrivals}; prompts {cfg['prompt_len']} tokens ({report['prompt_lengths']}), "
        f"replies {cfg['output_len']} ({'ignore_eos' if report['ignore_eos'] else 'ignore_eos refused'}), "
        f"temperature {cfg['temperature']}, top_p {cfg['top_p']}",
        f"requests    {report['completed']} finished, {report['failed']} failed"
        + "".join(f"; {n} x {status} ({report['failure_examples'][status]})"
                  for status, n in sorted(report["failures"].items())),
        f"duration    {fmt(report['duration_s'], spec='.2f')} s",
        f"throughput  {fmt(report['request_throughput'], spec='.2f')} req/s, "
        f"{fmt(report['output_tok_per_s'])} output tok/s, {fmt(report['total_tok_per_s'])} total tok/s",
        f"tokens      prompt {report['prompt_tokens']:,} (cached "
        f"{'-' if report['cached_tokens'] is None else format(report['cached_tokens'], ',')}), "
        f"output {report['output_tokens']:,} ({fmt(report['tokens_per_chunk'], spec='.2f')} a chunk with text)"
        + ("" if report["usage_reported"] else " (no usage from the server: output tokens are the chunks with text)"),
        f"{'(ms)':<10}" + "".join(f"{k:>10}" for k in STATS),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = report[f"{name}_s"] or {}
        lines.append(f"{name.upper():<10}" + "".join(f"{fmt(d.get(k), 1e3):>10}" for k in STATS))
    if "goodput" in report:
        g = report["goodput"]
        bounds = ", ".join(f"{k} <= {v:g} s" for k, v in g["slo_s"].items())
        lines.append(f"goodput     {fmt(g['req_per_s'], spec='.2f')} req/s ({g['requests']} requests within {bounds})")
    for t in report.get("turns", []):
        lines.append(f"turn {t['turn']:<6} prompt {fmt(t['prompt_tokens'], spec='.0f')} tokens, cached "
                     f"{fmt(t['cached_tokens'], spec='.0f')}, TTFT {fmt(t['ttft_s'], 1e3)} ms, "
                     f"TPOT {fmt(t['tpot_s'], 1e3)} ms ({t['completed']} finished)")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve_load.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = LoadConfig()
    p.add_argument("url", help="the server, http://HOST:PORT (a /v1 suffix is fine)")
    p.add_argument("--endpoint", choices=list(ENDPOINTS), default=d.endpoint,
                   help="completions (default): /v1/completions with a text prompt; chat: /v1/chat/completions "
                   "with messages")
    p.add_argument("--model", help="the model name to send (default: the first one GET /v1/models lists)")
    p.add_argument("--num-requests", type=int, help="requests to send (agent workload: sessions); default 100 "
                   "(agent: 1) unless --duration is given")
    p.add_argument("--duration", type=float, help="seconds after which no new request (session) starts")
    p.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="arrivals a second; inf (default): all at once, or a closed loop of --max-concurrency clients")
    p.add_argument("--arrival", choices=ARRIVALS, default=d.arrival,
                   help="gaps between arrivals at a finite rate: exponential (Poisson process, default) or 1/rate")
    p.add_argument("--max-concurrency", type=int, help="requests (sessions) in flight at most; with rate inf: "
                   "that many clients, each sending its next request when its last one finished")
    p.add_argument("--workload", choices=WORKLOADS, default=d.workload,
                   help="text (default): independent prompts; agent: sessions resending the whole conversation "
                   "each turn")
    p.add_argument("--prompt-len", default=str(d.prompt_len),
                   help="prompt tokens (agent: the first turn's): N, or A:B drawn uniformly (default %(default)s)")
    p.add_argument("--output-len", default=str(d.output_len),
                   help="max_tokens of each request: N, or A:B uniformly (default %(default)s)")
    p.add_argument("--agent-turns", type=int, default=d.agent_turns,
                   help="requests in each agent session (default %(default)s)")
    p.add_argument("--agent-turn-len", default=str(d.agent_turn_len),
                   help="new tokens each later agent turn adds after the previous reply: N or A:B "
                   "(default %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass (default 1)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=d.ignore_eos,
                   help="ask the server to run every reply to max_tokens (default; dropped if the server refuses "
                   "the field)")
    p.add_argument("--slo", help="goodput bounds in seconds, e.g. ttft=0.5,tpot=0.05,e2e=20 (any of the three)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds prompts, lengths and Poisson gaps (default 0)")
    p.add_argument("--tokenizer", help="a tokenizer.json, a directory holding one, or 'bytes' (openk3's byte-level "
                   "fallback): prompts of exact token windows; default: calibrate characters per token by probes")
    p.add_argument("--data", help="prompt corpus: a text or JSONL file, or a directory (as openk3 train --data); "
                   "default: the Python standard library's sources")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds one request may take (default %(default)s)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--json", metavar="PATH", help="write the report (with one record per request) to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> dict:
    """The command line: prints the table (and writes --json); exits 2 for a LoadError, 1 when no request
    finished."""
    args = parser().parse_args(argv)
    names = {f.name for f in fields(LoadConfig)}
    options = {k: v for k, v in vars(args).items() if k in names and v is not None}
    try:
        report = run_load(args.url, LoadConfig(**options, progress=not args.no_progress))
    except LoadError as exc:
        print(f"serve_load: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if report["completed"] == 0:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
