"""`minigpt serve`: a run behind OpenAI's HTTP API, with continuous batching and a chat page."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import tyro

from minigpt.commands.flags import read_flags
from minigpt.config import ConfigError
from minigpt.config.serving import EngineConfig


@dataclasses.dataclass(frozen=True)
class ServeArgs:
    """Serve a run over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models) with a chat page
    at /, decoding every request in flight together. A run directory being trained is served read-only, from
    its newest complete checkpoint; a LoRA run serves its adapters folded into the weights."""

    run: Annotated[str, tyro.conf.arg(help="run directory written by `minigpt train`, or an export file")]
    host: str = "127.0.0.1"
    """Address to listen on; anything but loopback should come with --api-key."""
    port: int = 8000
    """Port to listen on (0: any free port, printed when ready)."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on every /v1 route (default: $MINIGPT_API_KEY, else none)."""
    name: str | None = None
    """The model's name in the API (default: the run directory's name)."""
    engine: EngineConfig = EngineConfig()
    max_body_bytes: int = 1 << 20
    """Request bodies larger than this are refused (413)."""
    request_timeout: float = 600.0
    """Seconds a request may take before it is ended (504, or an error event in a stream)."""
    grace: float = 5.0
    """On SIGTERM or Ctrl-C, seconds the requests in flight get to finish before they are ended."""
    warmup: bool = True
    """Compile the decode step and prompt reading for every batch shape before taking requests (the first
    requests then never wait for a compilation; later starts read them from the compilation cache)."""
    access_log: bool = False
    """Log every request (uvicorn's access log); errors are logged either way, one line each."""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check(a: ServeArgs, key: str | None) -> None:
    if not 0 <= a.port <= 65535:
        raise ConfigError(f"--port must be 0 to 65535, got {a.port}")
    if a.max_body_bytes < 1024 or a.request_timeout <= 0 or a.grace < 0:
        raise ConfigError("--max-body-bytes must be >= 1024, --request-timeout > 0 and --grace >= 0")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError("minigpt serve needs FastAPI and uvicorn: pip install 'minigpt[serve]'") from None
    if not _loopback(a.host) and not key:
        print(f"minigpt: warning: serving on {a.host} without --api-key: anyone who can reach this machine "
              "can use the model (set --api-key or MINIGPT_API_KEY)", file=sys.stderr, flush=True)  # fmt: skip


def parse(args: list[str]) -> ServeArgs:
    return read_flags(lambda: tyro.cli(ServeArgs, args=args, prog="minigpt serve"))


def load() -> Callable[[ServeArgs], None]:
    return _serve


def _serve(a: ServeArgs) -> None:
    from minigpt.inference.engine import Engine
    from minigpt.serve import server
    from minigpt.serve.api import ApiOptions, create_app
    from minigpt.serve.service import Service
    from minigpt.training.runs import folded, load_model

    key = a.api_key or os.environ.get("MINIGPT_API_KEY") or None
    _check(a, key)
    try:
        sock = server.bind(a.host, a.port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {a.host}:{a.port} ({e.strerror or e}); choose another --port "
                          "or --host") from None  # fmt: skip
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("minigpt serve: %(message)s"))
    logging.getLogger("minigpt.serve").addHandler(handler)
    logging.getLogger("minigpt.serve").propagate = False
    setup, params, tokenizer, step = load_model(a.run)
    graphdef, params = folded(setup.cfg.model, params)
    cfg = setup.cfg.model
    engine = Engine(
        graphdef, params, max_seq_len=cfg.max_seq_len, stop_ids=tokenizer.stop_ids, config=a.engine
    )
    name = a.name or Path(a.run).resolve().name
    service = Service(engine.start(a.warmup), tokenizer, name, a.request_timeout)
    app = create_app(service, ApiOptions(api_key=key, max_body_bytes=a.max_body_bytes))
    print(
        f"minigpt serve: {name} (step {step}, context {cfg.max_seq_len}, {a.engine.slots} slots)", flush=True
    )
    server.serve(app, engine, sock, a.grace, a.access_log)
