"""The HTTP API, served in this process by uvicorn over the engine, and spoken to by real clients: the official
`openai` package, httpx for raw bodies, and Chromium for the chat page. Greedy replies equal `minigpt chat`'s
and `generate`'s; every bad request is an OpenAI error object; the guard refuses before reading; a full queue
says when to come back; a client that goes away frees its row."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("uvicorn", reason="the serve extra (pip install -e '.[serve]')")

import httpx
import uvicorn

from minigpt.inference.conversation import Conversation
from minigpt.inference.engine import Engine, EngineConfig, Request
from minigpt.inference.generate import SamplingConfig, generate_ids
from minigpt.serve.api import ApiOptions, create_app
from minigpt.serve.service import Service
from minigpt.training.runs import load_model

openai = pytest.importorskip("openai", reason="the openai client (a test-only dependency)")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tom saw a red ball."}]


def _start(app) -> tuple[uvicorn.Server, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def api(chat_run: Path):
    """One engine (2 rows, 4 waiting at most) behind two apps: open, and keyed (API key 's3cret')."""
    setup, params, tok, _ = load_model(chat_run)
    config = EngineConfig(slots=2, prefill_chunk=32, max_queue=4)
    engine = Engine(setup.graphdef, params, max_seq_len=128, stop_ids=tok.stop_ids, config=config).start()
    service = Service(engine, tok, "tiny-chat")
    (server, url), (keyed, keyed_url) = (
        _start(create_app(service, ApiOptions(max_body_bytes=4096, api_key=key))) for key in (None, "s3cret")
    )
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    api = SimpleNamespace(url=url, keyed_url=keyed_url, engine=engine, tok=tok, setup=setup, params=params,
                          service=service, client=client, gates=[])  # fmt: skip
    yield api
    for gate in api.gates:  # a failed test's gate would hold the engine
        gate.open(engine)
    server.should_exit = keyed.should_exit = True
    engine.close()


def _generated(api, ids: list[int], budget: int, **sampling) -> str:
    sampling = SamplingConfig(max_new_tokens=budget, **{"temperature": 0.0, "top_k": 0, **sampling})
    new = generate_ids(api.setup.graphdef, api.params, ids, sampling, eot_id=api.tok.eot_id, max_seq_len=128,
                       stop_ids=api.tok.stop_ids)[0]  # fmt: skip
    return api.tok.decode(new)


def test_the_openai_client_chats_as_minigpt_chat_does_streamed_or_not(api) -> None:
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    reply = Conversation(api.setup, api.params, api.tok, greedy, system="Be brief.").say(
        MESSAGES[1]["content"]
    )
    full = api.client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == reply
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert choice.finish_reason == ("length" if full.usage.completion_tokens == 12 else "stop")
    chunks = list(api.client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12,
                  temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_of_several_prompts_and_samples_are_what_generate_gives(api) -> None:
    prompts = ["Tom saw", "Lily and Ben went to the"]
    out = api.client.completions.create(model="tiny-chat", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        expected = _generated(api, api.service.text_ids(p), 6)
        assert out.choices[2 * i].text == out.choices[2 * i + 1].text == expected
    stream = api.client.completions.create(model="tiny-chat", prompt=prompts, max_tokens=6, temperature=0,
                                           n=2, stream=True)  # fmt: skip
    texts = ["", "", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in out.choices]
    # Sampling with a seed draws what `minigpt generate --seed` draws, whatever else runs beside it.
    seeded = api.client.completions.create(model="tiny-chat", prompt="Tom saw", max_tokens=8, temperature=1.0,
                                           seed=11)  # fmt: skip
    assert seeded.choices[0].text == _generated(
        api, api.service.text_ids("Tom saw"), 8, temperature=1.0, seed=11
    )


def test_a_stop_sequence_ends_the_text_where_it_begins(api) -> None:
    full = api.client.completions.create(model="tiny-chat", prompt="Tom saw", max_tokens=24, temperature=0)
    text = full.choices[0].text
    k = next(
        k
        for k in range(1, len(text) - 2)
        if text.find(text[k : k + 2]) == k and "\ufffd" not in text[k : k + 2]
    )
    stop = text[k : k + 2]
    cut = api.client.completions.create(
        model="tiny-chat", prompt="Tom saw", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[:k] and cut.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in api.client.completions.create(
        model="tiny-chat", prompt="Tom saw", max_tokens=24, temperature=0, stop=stop, stream=True) if c.choices]  # fmt: skip
    assert "".join(pieces) == text[:k]


BAD = [
    (b'{"messages": [', 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({"messages": "hi"}, 400, "messages", "messages"),
    ({"messages": []}, 400, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "robot"),
    ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", "greater than 0"),
    ({"messages": MESSAGES, "max_tokens": 500}, 400, "max_tokens", "context is 128 tokens"),
    ({"messages": [{"role": "user", "content": "red ball " * 200}]}, 400, "messages", "context is 128"),
    ({"messages": MESSAGES, "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"messages": MESSAGES, "model": "gpt-4"}, 404, "model", "not served here"),
]


def test_bad_requests_get_an_openai_error_object_and_one_log_line(api, caplog) -> None:
    caplog.set_level(logging.WARNING, "minigpt.serve")
    for body, status, param, said in BAD:
        caplog.clear()
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(
            api.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (status, param) and said in error["message"], error
        assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
        lines = [rec for rec in caplog.records if rec.name == "minigpt.serve"]
        assert len(lines) == 1 and lines[0].exc_info is None
    r = httpx.post(api.url + "/v1/completions", json={"prompt": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    health = httpx.get(api.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny-chat"
    assert [m.id for m in api.client.models.list()] == ["tiny-chat"]


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole(api) -> None:
    big = json.dumps({"messages": MESSAGES, "user": "x" * 5000}).encode()
    r = httpx.post(
        api.url + "/v1/chat/completions", content=big, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"]["message"]
    chunked = (big[i : i + 1000] for i in range(0, len(big), 1000))  # no Content-Length: counted as it comes
    r = httpx.post(
        api.url + "/v1/chat/completions", content=chunked, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_with_an_api_key_every_v1_route_wants_it(api) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.get(api.keyed_url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(api.keyed_url + "/v1/completions", json={"prompt": "Tom"})
    assert r.status_code == 401
    keyed = openai.OpenAI(base_url=api.keyed_url + "/v1", api_key="s3cret", max_retries=0)
    assert [m.id for m in keyed.models.list()] == ["tiny-chat"]
    assert httpx.get(api.keyed_url + "/health").status_code == 200  # not an API route


class Gate:
    """A request whose hook lets the engine take one step per `step()`: the tests hold the engine still."""

    def __init__(self, api: SimpleNamespace) -> None:
        engine = api.engine
        api.gates.append(self)
        self.permits, self.free, self.calls = threading.Semaphore(0), threading.Event(), 0
        self.request = Request([1, 2, 3], 120, self, temperature=0.0)
        engine.submit(self.request)

    def __call__(self, tokens: list[int], reason: str | None) -> None:
        self.calls += 1
        if not self.free.is_set():
            self.permits.acquire()

    def step(self, n: int = 1) -> None:
        self.permits.release(n)

    def open(self, engine: Engine) -> None:
        self.free.set()
        self.permits.release()
        engine.cancel(self.request)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_a_full_queue_answers_429_with_retry_after(api) -> None:
    gate = Gate(api)
    _until(lambda: gate.calls >= 1, "the gate's first token")  # the engine waits in its hook
    waiting = [Request([1, 2], 5, lambda *_: None, temperature=0.0) for _ in range(4)]
    for r in waiting:
        api.engine.submit(r)
    r = httpx.post(api.url + "/v1/completions", json={"prompt": "Tom", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    for w in waiting:
        api.engine.cancel(w)
    gate.open(api.engine)
    _until(lambda: api.engine.load()["busy"] == 0 and not api.engine.waiting, "an idle engine")


def test_a_client_that_disconnects_mid_stream_frees_its_row_within_one_step(api) -> None:
    gate = Gate(api)
    _until(lambda: gate.calls >= 1, "the gate's first token")
    body = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "stream": True}
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", api.url + "/v1/chat/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the assistant's role: the stream is open
        gate.step(3)
        _until(lambda: len(api.engine.rows) == 2 and api.engine.rows[1].generated >= 2, "two tokens")
    _until(lambda: api.engine.rows[-1].cancelled, "the server to see the client go")
    steps, (streamed,) = api.engine.steps, [x for x in api.engine.rows if x is not gate.request]
    gate.step()
    _until(lambda: api.engine.load()["busy"] == 1, "the row to be freed")
    assert api.engine.steps - steps <= 1 and streamed.generated < 80
    gate.open(api.engine)
    _until(lambda: api.engine.load()["busy"] == 0, "an idle engine")


def test_the_chat_page_streams_a_reply_in_a_real_browser(api) -> None:
    page = httpx.get(api.url + "/").text
    assert '"tiny-chat"' in page and "<script>" in page and "http" not in page.split("<script>")[1]  # no CDN
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (a test-only dependency)")
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("Chromium and its driver are absent (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    profile = tempfile.mkdtemp(prefix="minigpt-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--disable-dev-shm-usage"):  # fmt: skip
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    browser = webdriver.Chrome(options=options, service=service)
    try:
        browser.get(api.url + "/")
        for text in ("Tom saw a red ball.", "And then?"):
            box = browser.find_element("id", "input")
            box.send_keys(text)
            browser.find_element("id", "send").click()
            _until(lambda: browser.execute_script(
                "const m = document.querySelectorAll('.msg.assistant');"
                "return m.length && m[m.length - 1].dataset.state === 'done'"), "the reply")  # fmt: skip
        said = browser.execute_script("return [...document.querySelectorAll('.msg')].map(m => m.className)")
        replies = browser.execute_script(
            "return [...document.querySelectorAll('.msg.assistant span')].map(s => s.textContent)"
        )
        assert said == ["msg user", "msg assistant"] * 2 and all(replies) and "error" not in " ".join(said)
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_a_request_past_the_timeout_gets_504_and_leaves_the_engine(api) -> None:
    """A second app on the same engine with a half-second --request-timeout, while the engine is held."""
    gate = Gate(api)
    _until(lambda: gate.calls >= 1, "the gate's first token")
    server, url = _start(create_app(Service(api.engine, api.tok, "tiny-chat", request_timeout=0.5)))
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Tom", "max_tokens": 5}, timeout=120)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        _until(lambda: all(x.cancelled for x in [*api.engine.waiting, *api.engine.rows] if x is not gate.request),
               "the request to be cancelled")  # fmt: skip
    finally:
        server.should_exit = True
        gate.open(api.engine)
    _until(lambda: api.engine.load()["busy"] == 0, "an idle engine")
