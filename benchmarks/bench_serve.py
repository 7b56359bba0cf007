"""Serving under load on loopback: `minigpt serve` against `transformers serve` (with and without its
--continuous-batching) on the same model, with the same clients.

    python benchmarks/bench_serve.py                              # 1, 8 and 32 clients, 20 s each, three sides
    python benchmarks/bench_serve.py --sides minigpt --preset gpt2-124m --dtype auto   # minigpt alone (a TPU)
    python benchmarks/bench_serve.py --sides minigpt --transport inprocess             # no sockets at all
    python benchmarks/bench_serve.py --quick                      # a tiny model, minigpt alone, seconds

The model has random weights (speed does not depend on them) and GPT-2's vocabulary with ChatML's two tokens
(from ../shared/data/gpt2; a small BPE trained on a few sentences where that is absent), written as a minigpt
export; `minigpt export --format hf` makes the transformers checkpoint both transformers sides load. Its shape
is a small Llama (--shape) or a preset's (--preset), float32 on both sides unless --dtype says otherwise.

Each client sends chat requests (one of 16 user messages of 10 to 60 words, greedy, --max-tokens new tokens,
streamed) one after another for --duration seconds. Every side's server is started and given a warm-up round
at every concurrency (so no side compiles or loads inside a window); then each concurrency runs on each side in
turn, so that a change in the machine's other load falls on the sides alike. Per concurrency: generated
tokens/s and requests/s over the window (from the first request to the last one's end), time to first token
(request sent to first text) and inter-token latency (between successive pieces of text, each piece's gap split
over its tokens), p50 and p99. Beside them, `minigpt generate`'s own time per token for the same model (the
compiled decode loop alone, batch 1, streamed as `minigpt generate` streams), measured in this process
before the servers start and again after they stop, the faster of the two. Traffic goes to 127.0.0.1
only and every client stops by itself (--duration); servers are stopped with SIGTERM. Other processes on the
machine slow every side: compare the rows of one run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, SHARED, parser, print_tables, table, write_result

SHAPES = {
    "small": dict(d_model=256, n_layers=4, n_heads=4, d_ff=704, max_seq_len=512),
    "tiny": dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=128),
}
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = [
    "Tom",
    "saw",
    "a",
    "big",
    "red",
    "ball",
    "and",
    "Lily",
    "went",
    "to",
    "the",
    "park",
    "with",
    "her",
    "small",
    "dog",
    "to",
    "play",
    "in",
    "the",
    "sun",
    "all",
    "day",
]
SIDES = ("minigpt", "transformers", "transformers-cb")


# ------------------------------------------------------------------------------------------------ the model


def chat_tokenizer(folder: Path, gpt2: Path) -> Any:
    """GPT-2's byte-level BPE with <|im_start|> and <|im_end|> (the end of a turn), a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from minigpt.data.pretrained_tokenizer import PretrainedTokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if (gpt2 / "vocab.bpe").is_file():
        tok = Tokenizer(models.BPE.from_file(str(gpt2 / "encoder.json"), str(gpt2 / "vocab.bpe")))
    else:
        tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if not (gpt2 / "vocab.bpe").is_file():
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
        tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    tok.add_special_tokens(specials)
    end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    tokenizer = PretrainedTokenizer(tok.to_str(), None, end, [end, eot], CHATML)
    tokenizer.save(folder)
    return tokenizer


def build_model(work: Path, args) -> tuple[Path, Path | None, str]:
    """(the minigpt export, its transformers checkpoint or None, a description of the model)."""
    from flax import nnx

    from minigpt.config import DataConfig, ModelConfig, get_preset, to_dict
    from minigpt.nn.model import GPT, count_params
    from minigpt.training.checkpoint import write_export
    from minigpt.training.trainer import build

    tokenizer = chat_tokenizer(work / "tokenizer", Path(args.shared) / "gpt2")
    if args.preset:
        model = dataclasses.replace(get_preset(args.preset).model, dropout=0.0)
    else:
        model = ModelConfig(norm="rmsnorm", position="rope", activation="swiglu", bias=False,
                            tie_embeddings=False, **SHAPES[args.shape])  # fmt: skip
    model = dataclasses.replace(model, vocab_size=tokenizer.vocab_size, dtype=args.dtype)
    data = DataConfig(
        seq_len=min(128, model.max_seq_len), tokenizer="hf", hf_tokenizer=str(work / "tokenizer")
    )
    cfg = dataclasses.replace(get_preset("finetune"), model=model, data=data, run_dir=str(work / "run"))
    setup = build(cfg, optimizer=False)
    params = nnx.split(GPT(setup.cfg.model, nnx.Rngs(0)))[1]
    export = work / "model.npz"
    write_export(export, params, {**to_dict(setup.cfg), "step": 0}, work / "tokenizer")
    m = setup.cfg.model
    about = (f"{args.preset or args.shape} shape: d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
             f"d_ff {m.d_ff}, context {m.max_seq_len}, vocab {m.vocab_size}, {count_params(params) / 1e6:.1f}M "
             f"parameters, {m.dtype}")  # fmt: skip
    hf = None
    if any(s != "minigpt" for s in args.sides):
        hf = work / "hf"
        cmd = [
            sys.executable,
            "-m",
            "minigpt.cli",
            "export",
            "--run",
            str(export),
            "--format",
            "hf",
            "--out",
            str(hf),
        ]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
    return export, hf, about


def generate_per_token(export: Path, tokens: int) -> float:
    """`minigpt generate`'s seconds per new token at batch 1, streamed (its default): end-of-text ignored, the
    fastest of three calls after one that compiles."""
    from minigpt.inference.generate import SamplingConfig, generate_ids
    from minigpt.training.runs import load_model

    setup, params, tok, _ = load_model(export)
    prompt = tok.encode_chat(f"<|im_start|>user\n{' '.join(WORDS[:30])}<|im_end|>\n<|im_start|>assistant\n")
    sampling = SamplingConfig(max_new_tokens=tokens, temperature=0.0)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        generate_ids(setup.graphdef, params, prompt, sampling, eot_id=-1, max_seq_len=setup.cfg.model.max_seq_len,
                     on_token=lambda *_: None)  # fmt: skip
        times.append(time.perf_counter() - t0)
    return min(times[1:]) / tokens


# ------------------------------------------------------------------------------------------------ servers


class Side:
    """A server process on loopback: started, waited for, stopped with SIGTERM."""

    def __init__(self, name: str, export: Path, hf: Path | None, args) -> None:
        self.name, self.log = (
            name,
            tempfile.NamedTemporaryFile("w+", prefix=f"bench-serve-{name}-", delete=False),  # noqa: SIM115
        )
        if name == "minigpt":
            cmd = [sys.executable, "-m", "minigpt.cli", "serve", "--run", str(export), "--port", "0", "--name",
                   "model", "--engine.slots", str(max(args.clients)), "--engine.max-queue", "1024",
                   "--engine.prefill-chunk", str(args.prefill_chunk)]  # fmt: skip
            self.model = "model"
        else:
            exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
            self.port = _free_port()
            cmd = [exe, "serve", str(hf), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                   "--dtype", args.dtype, "--log-level", "warning"]  # fmt: skip
            cmd += ["--continuous-batching"] if name == "transformers-cb" else []
            self.model = str(hf)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        self.url = self._wait(args.start_timeout)

    def _wait(self, timeout: float) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            if self.name == "minigpt":
                found = re.search(r"ready on (http://\S+)", Path(self.log.name).read_text())
                if found:
                    return found.group(1)
            else:
                try:
                    if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                        return f"http://127.0.0.1:{self.port}"
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start within {timeout:g} s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ clients


def messages(i: int) -> list[dict[str, str]]:
    """The i-th of 16 user messages, 10 to 60 words."""
    n = 10 + (i % 16) * 50 // 15
    return [{"role": "user", "content": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))}]


async def http_request(client, url: str, model: str, i: int, max_tokens: int) -> dict:
    """One streamed chat request: when it was sent, when each piece of text came, the tokens generated."""
    body = {"model": model, "messages": messages(i), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    sent, pieces, tokens = time.perf_counter(), [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                if (c.get("delta") or {}).get("content"):
                    pieces.append(time.perf_counter())
    return {"sent": sent, "pieces": pieces, "tokens": tokens if tokens is not None else len(pieces),
            "end": time.perf_counter()}  # fmt: skip


async def inprocess_request(service, i: int, max_tokens: int) -> dict:
    """The same request through the service, without HTTP (`--transport inprocess`)."""
    from minigpt.serve.protocol import ChatRequest

    req = ChatRequest(messages=messages(i), max_tokens=max_tokens, temperature=0)
    ids = service.chat_ids(req.messages)
    sent, pieces = time.perf_counter(), []
    choices = service.start([ids], [service.budget(ids, max_tokens, "messages")], req)
    async for _, delta in service.events(choices):
        if delta:
            pieces.append(time.perf_counter())
    return {"sent": sent, "pieces": pieces, "tokens": len(choices[0].ids), "end": time.perf_counter()}


async def load(send, clients: int, duration: float, max_tokens: int) -> list[dict]:
    """`clients` clients sending requests back to back until `duration` has passed."""
    stop, done = time.perf_counter() + duration, []

    async def client(c: int) -> None:
        i = c
        while time.perf_counter() < stop:
            done.append(await send(i, max_tokens))
            i += clients

    await asyncio.gather(*(client(c) for c in range(clients)))
    return done


def summarise(done: list[dict]) -> dict[str, float]:
    """Tokens/s and requests/s over the window; time to first text and inter-token latency, p50 and p99."""
    window = max(d["end"] for d in done) - min(d["sent"] for d in done)
    ttft = sorted(d["pieces"][0] - d["sent"] for d in done if d["pieces"])
    gaps = []
    for d in done:  # a piece's gap split over the tokens it brought (a request's tokens over its pieces)
        per = max(d["tokens"] - 1, 1) / max(len(d["pieces"]) - 1, 1)
        gaps += [(b - a) / per for a, b in zip(d["pieces"], d["pieces"][1:], strict=False)]
    q = lambda xs, p: (
        statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else (xs or [0])[0]
    )
    return {"requests": len(done), "tokens": sum(d["tokens"] for d in done), "window_s": window,
            "tokens_per_s": sum(d["tokens"] for d in done) / window, "requests_per_s": len(done) / window,
            "ttft_p50_ms": 1e3 * q(ttft, 50), "ttft_p99_ms": 1e3 * q(ttft, 99),
            "itl_p50_ms": 1e3 * q(gaps, 50), "itl_p99_ms": 1e3 * q(gaps, 99)}  # fmt: skip


# ------------------------------------------------------------------------------------------------ the run


async def warm(send, args) -> None:
    """A round at every concurrency (one request per client): no side compiles or loads inside a window."""
    for n in args.clients:
        await asyncio.gather(*(send(i, args.max_tokens) for i in range(n)))


async def run_sides(export: Path, hf: Path | None, args) -> dict[str, dict[int, dict]]:
    """Every side started and warmed, then each concurrency measured on each side in turn (the sides take
    turns level by level, so a change in the machine's other load falls on them alike)."""
    import httpx

    if args.transport == "inprocess":
        senders, sides = {"minigpt": _inprocess_sender(export, args)}, []
    else:
        sides, senders = [], {}
        limits = httpx.Limits(max_connections=max(args.clients) + 4)
        client = httpx.AsyncClient(timeout=600, limits=limits)
    try:
        for name in args.sides if args.transport == "http" else []:
            print(f"starting {name}", flush=True)
            side = Side(name, export, hf, args)
            sides.append(side)
            senders[name] = lambda i, m, side=side: http_request(client, side.url, side.model, i, m)
        for send in senders.values():
            await warm(send, args)
        results: dict[str, dict[int, dict]] = {name: {} for name in senders}
        for n in args.clients:
            for name, send in senders.items():
                results[name][n] = r = summarise(await load(send, n, args.duration, args.max_tokens))
                print(f"{name}, {n} clients: " + ", ".join(f"{k} {v:,.1f}" for k, v in r.items()), flush=True)
        return results
    finally:
        for side in sides:
            side.stop()
        if args.transport == "http":
            await client.aclose()


def _inprocess_sender(export: Path, args):
    from minigpt.inference.engine import Engine, EngineConfig
    from minigpt.serve.service import Service
    from minigpt.training.runs import load_model

    setup, params, tok, _ = load_model(export)
    config = EngineConfig(slots=max(args.clients), max_queue=1024, prefill_chunk=args.prefill_chunk)
    engine = Engine(setup.graphdef, params, max_seq_len=setup.cfg.model.max_seq_len, stop_ids=tok.stop_ids,
                    config=config).start(warmup=True)  # fmt: skip
    service = Service(engine, tok, "model")
    return lambda i, m: inprocess_request(service, i, m)


def parse_args():
    p = parser(__doc__)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per concurrency and side")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (fewer at <|im_end|>)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small", help="a small Llama's shape")
    p.add_argument("--preset", default="", help="a preset's model shape instead (e.g. gpt2-124m)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--transport", choices=["http", "inprocess"], default="http",
                   help="inprocess: minigpt's service called directly, no sockets (minigpt alone)")  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, default=256, help="minigpt's --engine.prefill-chunk")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--shared", default=str(SHARED), help="the shared data folder (gpt2/ for the vocabulary)")
    args = p.parse_args()
    if args.quick:
        args.sides, args.clients, args.duration, args.max_tokens, args.shape = (
            ["minigpt"],
            [1, 4],
            1.0,
            8,
            "tiny",
        )
    if args.transport == "inprocess" and args.sides != ["minigpt"]:
        p.error("--transport inprocess runs minigpt alone: add --sides minigpt")
    if any(s != "minigpt" for s in args.sides) and not (
        shutil.which("transformers") or (Path(sys.executable).parent / "transformers").exists()
    ):
        p.error("transformers serve is not installed (pip install -e '.[test]'), or pass --sides minigpt")
    return args


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        export, hf, about = build_model(Path(tmp), args)
        per_token = generate_per_token(export, args.max_tokens)
        print(f"{about}; minigpt generate: {1e3 * per_token:.2f} ms per token", flush=True)
        results = asyncio.run(run_sides(export, hf, args))
        per_token = min(per_token, generate_per_token(export, args.max_tokens))  # again; the faster counts
    write(args, about, per_token, results, load_before)


def write(
    args, about: str, per_token: float, results: dict[str, dict[int, dict]], load_before: float
) -> None:
    rows = []
    for side, levels in results.items():
        for n, r in levels.items():
            rows.append([side, n, r["requests"], r["tokens"], f"{r['tokens_per_s']:,.1f}", f"{r['requests_per_s']:.2f}",
                         f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p99_ms']:.1f}", f"{r['itl_p50_ms']:.2f}",
                         f"{r['itl_p99_ms']:.2f}"])  # fmt: skip
    columns = ["server", "clients", "requests", "tokens", "tokens/s", "requests/s", "TTFT p50 ms", "TTFT p99 ms",
               "ITL p50 ms", "ITL p99 ms"]  # fmt: skip
    load_after = os.getloadavg()[0]
    note = (f"Model: {about}. {args.duration:g} s of load per row after a warm-up round; chat requests of 10-60 "
            f"words, greedy, up to {args.max_tokens} new tokens, streamed; transport {args.transport}. minigpt "
            f"generate (batch 1, streamed): {1e3 * per_token:.2f} ms per token. 1-minute load average "
            f"{load_before:.1f} before, {load_after:.1f} after.")  # fmt: skip
    tables = [table(columns, rows, note=note)]
    print_tables(tables)
    write_result(args, "bench_serve", "Serving: minigpt serve against transformers serve", tables,
                 headlines=headlines(results, per_token), data={"args": vars(args), "model": about,
                 "generate_ms_per_token": 1e3 * per_token, "results": results})  # fmt: skip


def headlines(results: dict[str, dict[int, dict]], per_token: float) -> list[str]:
    out = []
    ours = results.get("minigpt", {})
    peers = {s: r for s, r in results.items() if s != "minigpt"}
    top = max(ours, default=None)
    if top is not None and peers and all(top in r for r in peers.values()):
        best = max(peers, key=lambda s: peers[s][top]["tokens_per_s"])
        theirs, mine = peers[best][top], ours[top]
        out.append(f"minigpt serve generates {mine['tokens_per_s']:,.0f} tokens/s for {top} concurrent chat streams, "
                   f"{mine['tokens_per_s'] / theirs['tokens_per_s']:.1f}x transformers serve at its best ({best}), "
                   f"with p99 time to first token {mine['ttft_p99_ms']:,.0f} ms against "
                   f"{theirs['ttft_p99_ms']:,.0f} ms")  # fmt: skip
    if 1 in ours:
        itl = ours[1]["itl_p50_ms"]
        out.append(f"A single stream from minigpt serve gets a token every {itl:.2f} ms (p50), "
                   f"{itl / (1e3 * per_token):.2f}x minigpt generate's own {1e3 * per_token:.2f} ms")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
