"""`specbeam serve` driven as editors and chat UIs drive it: the official openai client (and raw HTTP where the
wire matters) against a server on 127.0.0.1 holding a small chat model with its draft and the shipped en->de
translation pair. Answers equal the Engine's for the same request (speculation on), streamed or whole; requests
at once equal each alone; a client that leaves stops its generation; every bad input is OpenAI's error object
with a 4xx, and the server goes on after it."""
import json
import shutil
import socket
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from specbeam_edge import Engine  # noqa: E402
from specbeam_edge.shipped import shipped  # noqa: E402

from specbeam_apps.serve.app import Server, build  # noqa: E402
from specbeam_apps.serve.models import ModelSpec, Registry, Served  # noqa: E402
from specbeam_edge.online import Batcher  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """The shipped prose/code pair with a chat template: a chat model with its draft."""
    base = tmp_path_factory.mktemp("chatpair")
    out = []
    for part in ("target", "draft"):
        folder = base / part
        shutil.copytree(shipped("text", part), folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        out.append(str(folder))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server on a free port in this process (uvicorn in a thread), stopped by stop()."""

    def __init__(self, registry, **server):
        self.registry = registry
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.web = uvicorn.Server(uvicorn.Config(build(Server(registry, **server)), host="127.0.0.1",
                                                 port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.web.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.web.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self):
        self.web.should_exit = True
        self.thread.join(10)
        self.registry.close()


def _load(spec: ModelSpec) -> Served:
    engine = Engine(spec.model, draft=spec.draft)
    return Served(spec.name, engine, Batcher(engine, max_batch_size=4, max_waiting=4))


@pytest.fixture(scope="module")
def server(chat_pair):
    reg = Registry([ModelSpec(chat_pair[0], chat_pair[1], "text"),
                    ModelSpec(str(shipped("ende", "target")), str(shipped("ende", "draft")), "ende")], _load)
    reg.start()
    assert reg.wait(300), reg.error
    srv = Running(reg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def engine_of(server, name="text") -> Engine:
    return server.registry.models[name].engine


def prompt_ids(server, messages):
    eng = engine_of(server)
    return eng.encode(eng.tokenizer.apply_chat_template(messages))


MESSAGES = [{"role": "system", "content": "You write short code."},
            {"role": "user", "content": "Write a function that adds two numbers."}]


def test_greedy_and_beam_equal_the_engine(server, client):
    eng, ids = engine_of(server), prompt_ids(server, MESSAGES)
    r = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=24, temperature=0)
    plain = eng.generate(ids, num_beams=1, max_new_tokens=24, speculative=None)[0]
    assert r.choices[0].message.content == plain.text
    assert r.choices[0].finish_reason == plain.hypotheses[0].finish_reason
    assert r.usage.prompt_tokens == len(ids)
    timings = r.model_extra["timings"]
    assert timings["draft_passes"] > 0, "the draft did not draft: the comparison is plain with plain"
    assert timings["target_passes"] < r.usage.completion_tokens
    r = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=20, n=2,
                                       extra_body={"use_beam_search": True, "best_of": 3})
    beams = eng.generate(ids, num_beams=3, num_return_sequences=2, max_new_tokens=20, speculative=None)[0]
    assert [c.message.content for c in r.choices] == [h.text for h in beams.hypotheses]
    assert [c.index for c in r.choices] == [0, 1]


def test_completions_take_the_prompt_as_written(server, client):
    eng = engine_of(server)
    r = client.completions.create(model="text", prompt="def add(a, b):", max_tokens=16, temperature=0)
    want = eng.generate(eng.encode("def add(a, b):", raw=True), num_beams=1, max_new_tokens=16,
                        speculative=None)[0]
    assert r.choices[0].text == want.text and r.object == "text_completion"
    r = client.completions.create(model="text", prompt=["def add(a, b):", "import os"], max_tokens=8,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == \
        eng.generate(eng.encode("def add(a, b):", raw=True), num_beams=1, max_new_tokens=8)[0].text


def _sse(server, path, body, headers=None):
    """The raw events of a streamed answer: [parsed JSON objects], and whether [DONE] ended them."""
    events, done = [], False
    with httpx.stream("POST", server.url + path, json=body, headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            assert not done, "an event after [DONE]"
            if line == "data: [DONE]":
                done = True
            else:
                events.append(json.loads(line[6:]))
    return events, done


@pytest.mark.parametrize("beams", [1, 3])
def test_stream_shape_and_text(server, beams):
    eng, ids = engine_of(server), prompt_ids(server, MESSAGES)
    extra = {"use_beam_search": True, "best_of": beams} if beams > 1 else {"temperature": 0}
    body = dict(model="text", messages=MESSAGES, max_tokens=24, stream=True,
                stream_options={"include_usage": True}, **extra)
    events, done = _sse(server, "/v1/chat/completions", body)
    assert done
    assert len({e["id"] for e in events}) == 1 and all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    body_events = events[1:-1]
    assert all(e["usage"] is None for e in body_events)
    reasons = [c["finish_reason"] for e in body_events for c in e["choices"] if c["finish_reason"]]
    last = [e for e in body_events if any(c["finish_reason"] for c in e["choices"])][-1]
    assert last["timings"]["target_passes"] > 0        # the engine's figures, as llama-server's last chunk
    want = eng.generate(ids, num_beams=beams, max_new_tokens=24, speculative=None)[0]
    assert reasons == [want.hypotheses[0].finish_reason]
    text = "".join(c["delta"].get("content") or "" for e in body_events for c in e["choices"])
    assert text == want.text
    if beams > 1:   # the shared prefix streams before the search ends: more than one piece of text
        assert sum(1 for e in body_events for c in e["choices"] if c["delta"].get("content")) > 1


def test_openai_client_streams(server, client):
    stream = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    r = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=16, temperature=0)
    assert text == r.choices[0].message.content


def test_seeded_sampling_is_reproducible(server, client):
    ask = dict(model="text", messages=MESSAGES, max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    a = client.chat.completions.create(**ask).choices[0].message.content
    b = client.chat.completions.create(**ask).choices[0].message.content
    assert a == b
    eng, ids = engine_of(server), prompt_ids(server, MESSAGES)
    # the shipped draft is int8 with dynamic activation scales (not batch-invariant): a seeded sample runs plain,
    # so that its seed gives one answer at any load (test_concurrent_requests_equal_alone)
    assert not eng.draft.cfg.raw.get("batch_invariant")
    want = eng.generate(ids, num_beams=1, do_sample=True, temperature=0.9, top_p=0.95, seed=7, max_new_tokens=16,
                        speculative=None)
    assert a == want[0].text


def test_stop_strings(server, client):
    full = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=32, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[:text.find(stop)]
    r = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=32, temperature=0, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    events, _ = _sse(server, "/v1/chat/completions", dict(model="text", messages=MESSAGES, max_tokens=32,
                                                          temperature=0, stop=stop, stream=True))
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == cut


def test_logprobs(server, client):
    r = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:           # greedy: every token is the best one there
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0


def test_concurrent_requests_equal_alone(server, client):
    asks = [dict(messages=[{"role": "user", "content": f"Write about {w}."}], max_tokens=20, temperature=0)
            for w in ("files", "lists", "numbers", "loops", "tests", "strings")]
    asks[1].update(temperature=None, extra_body={"use_beam_search": True, "best_of": 3})
    asks[2].update(temperature=0.8, seed=3)
    alone = [client.chat.completions.create(model="text", **a).choices[0].message.content for a in asks]
    got = [None] * len(asks)

    def one(i):
        got[i] = client.chat.completions.create(model="text", **asks[i]).choices[0].message.content
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone


def _watch_requests(server, monkeypatch):
    """The engine requests the server prepares from now on."""
    eng, seen = engine_of(server), []
    real = eng.request

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]
    monkeypatch.setattr(eng, "request", spy)
    return seen


def _stopped(server, seen, limit):
    batcher = server.registry.models["text"].batcher
    deadline = time.time() + 30
    while batcher.load != (0, 0):
        assert time.time() < deadline, "the request still runs after its client left"
        time.sleep(0.05)
    [p] = seen
    assert p.cancelled
    assert p.answer_tokens(p.job.search.state) < limit


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_stops_its_generation(server, monkeypatch, stream):
    seen = _watch_requests(server, monkeypatch)
    body = dict(model="text", messages=MESSAGES, max_tokens=400, min_tokens=400, temperature=0, stream=stream)
    if stream:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 3:
                    break          # leaves after a few events
    else:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.4)
    _stopped(server, seen, 400)


BAD = [
    ("not json", None, 400, "invalid_json"),
    ({"model": "text", "messages": MESSAGES, "max_tokens": "ten"}, None, 400, "invalid_type"),
    ({"model": "text", "messages": MESSAGES, "max_tokens": 0}, None, 400, "invalid_type"),
    ({"model": "text", "messages": MESSAGES, "max_tokens": 100000}, None, 400, "context_length_exceeded"),
    ({"model": "text", "messages": [{"role": "user", "content": "word " * 700}]}, None, 400,
     "context_length_exceeded"),
    ({"model": "text", "messages": "hello"}, None, 400, None),
    ({"model": "text", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400, None),
    ({"model": "nope", "messages": MESSAGES}, None, 404, "model_not_found"),
    ({"model": "text", "messages": MESSAGES, "n": 2, "use_beam_search": True, "best_of": 9000}, None, 400, None),
    ({"model": "text", "messages": MESSAGES, "temperature": -1}, None, 400, "invalid_type"),
    ({"model": "text", "messages": MESSAGES, "stop": [""]}, None, 400, "invalid_type"),
    ({"model": "text", "prompt": ""}, "/v1/completions", 400, None),
    ({"model": "text", "prompt": [99999999]}, "/v1/completions", 400, None),
]


@pytest.mark.parametrize("body,path,status,code", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_an_openai_error(server, client, body, path, status, code):
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    r = httpx.post(server.url + (path or "/v1/chat/completions"), content=data,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "Traceback" not in r.text and err["type"]
    if code:
        assert err["code"] == code, err
    # the server goes on
    ok = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_unknown_fields_are_ignored(server, client):
    r = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=4, temperature=0,
                                       presence_penalty=0.0, user="me", extra_body={"cache_prompt": True})
    bare = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].message.content == bare.choices[0].message.content      # accepted and without effect


def test_unknown_route_and_models(server, client):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert sorted(m.id for m in client.models.list().data) == ["ende", "text"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_translate_libretranslate_shape(server):
    eng = engine_of(server, "ende")
    texts = ["Click the Save button to store the document.", "Open the file menu."]
    r = httpx.post(server.url + "/translate", json={"q": texts[0], "source": "en", "target": "de"}, timeout=120)
    assert r.status_code == 200
    assert r.json()["translatedText"] == eng.generate(texts[0])[0].text
    r = httpx.post(server.url + "/translate", json={"q": texts, "source": "en", "target": "de",
                                                    "alternatives": 2}, timeout=120).json()
    want = [eng.generate(t, num_return_sequences=3, num_beams=4)[0] for t in texts]
    assert r["translatedText"] == [w.text for w in want]
    assert r["alternatives"] == [[h.text for h in w.hypotheses[1:]] for w in want]
    r = httpx.post(server.url + "/translate", json={"q": texts[0], "source": "en", "target": "de",
                                                    "glossary": {"document": "Akte"}}, timeout=120).json()
    assert "Akte" in r["translatedText"]
    bad = httpx.post(server.url + "/translate", json={"q": [], "source": "en", "target": "de"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "q"


def test_key_and_body_size(chat_pair):
    reg = Registry([ModelSpec(chat_pair[0], "none", "text")], lambda s: _load(ModelSpec(s.model, None, s.name)))
    reg.start()
    assert reg.wait(120)
    srv = Running(reg, api_key=KEY, max_body=4096)
    try:
        body = {"model": "text", "messages": MESSAGES, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        big = dict(body, messages=[{"role": "user", "content": "x" * 5000}])
        r = httpx.post(srv.url + "/v1/chat/completions", json=big, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 413 and r.json()["error"]["message"]
    finally:
        srv.stop()


def test_health_is_503_while_loading(chat_pair):
    gate = threading.Event()

    def slow(spec):
        gate.wait(60)
        return _load(ModelSpec(spec.model, None, spec.name))
    reg = Registry([ModelSpec(chat_pair[0], None, "text")], slow)
    reg.start()
    srv = Running(reg)
    try:
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "text", "messages": MESSAGES})
        assert r.status_code == 503 and r.json()["error"]["message"]
        gate.set()
        assert reg.wait(60)
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        gate.set()
        srv.stop()


def test_the_command(chat_pair, tmp_path):
    """`python -m apps.serve` as a user starts it: listening at once, /health 503 then 200, an answer, a warning
    for every interface without a key, a clean exit on SIGINT; a model that cannot load ends it in one line."""
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "apps.serve", "--model", f"chat={chat_pair[0]}", "--draft",
                             chat_pair[1], "--port", str(port), "--host", "0.0.0.0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline
            time.sleep(0.2)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4).choices[0].message.content
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "without --api_key" in err and "Traceback" not in err
    finally:
        proc.kill()
    bad = subprocess.run([sys.executable, "-m", "apps.serve", "--model", str(tmp_path / "nothing"), "--port",
                          str(_free_port())], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no such folder" in bad.stderr and "Traceback" not in bad.stderr


def test_a_full_queue_is_429_with_retry_after(server, client, monkeypatch):
    from specbeam_edge.online import QueueFull

    batcher = server.registry.models["text"].batcher
    real, calls = batcher.submit, []

    def full(prepared, emit):
        calls.append(prepared)
        raise QueueFull("12 requests are in flight (at most 4 run and 8 wait)")
    monkeypatch.setattr(batcher, "submit", full)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "text", "messages": MESSAGES})
    assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
    assert calls and calls[0].cancelled
    monkeypatch.setattr(batcher, "submit", real)
    assert client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=2).choices


def test_kv_memory_admits_what_fits(server, client, monkeypatch):
    served = server.registry.models["text"]
    ids = prompt_ids(server, MESSAGES)
    monkeypatch.setattr(served, "kv_tokens", len(ids) + 10)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "text", "messages": MESSAGES, "max_tokens": 11, "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_memory_exceeded"
    # without max_tokens the answer gets the room the budget leaves
    r = client.chat.completions.create(model="text", messages=MESSAGES, temperature=0, extra_body={"min_tokens": 10})
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
