"""`doppler serve` against the official `openai` Python client (issue 26).

Starts the server on 127.0.0.1 (a free port) with SmolLM2-135M-Instruct ($DOPPLER_SMOLLM2)
and the binary $DOPPLER_BIN (default target/debug/doppler), then speaks to it as any
OpenAI client would: chat and text completions, streaming and not, stop strings, seeded
sampling, the usage counts, and the error cases (each an OpenAI error object with its
status). Greedy answers are compared across streaming and not, and across requests: the
same request gives the same tokens whatever ran before it.

Run: DOPPLER_SMOLLM2=path/to/SmolLM2-135M-Instruct.Q4_1.gguf python3 -m pytest -q tests/serve
"""
import http.client
import json
import os
import re
import subprocess
import threading
import time

import openai
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
KEY = "test-key"


def start(*extra):
    model = os.environ.get("DOPPLER_SMOLLM2")
    if not model or not os.path.exists(model):
        pytest.skip("DOPPLER_SMOLLM2 is not set to the SmolLM2 GGUF")
    binary = os.environ.get("DOPPLER_BIN", os.path.join(ROOT, "target", "debug", "doppler"))
    proc = subprocess.Popen(
        [binary, "serve", "-m", model, "--port", "0", "-c", "256", "--alias", "smollm2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on http://([\d.]+):(\d+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc, m.group(1), int(m.group(2))


@pytest.fixture(scope="module")
def server():
    proc, host, port = start("--api-key", KEY, "--queue", "0", "--parallel", "2")
    yield host, port
    proc.kill()
    proc.wait()


@pytest.fixture
def client(server):
    host, port = server
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0,
                         timeout=600)


def raw(server, method, path, body=None, headers=None):
    """A request outside the client (bodies it would not send): (status, JSON or text)."""
    host, port = server
    conn = http.client.HTTPConnection(host, port, timeout=600)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    h.update(headers or {})
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    try:
        return r.status, json.loads(data)
    except json.JSONDecodeError:
        return r.status, data


HELLO = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2"]


def test_chat_greedy_streamed_equals_whole(client):
    whole = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=8,
                                           temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=HELLO, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The same request again: the same tokens (each request starts from an empty cache).
    again = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=8,
                                           temperature=0)
    assert again.choices[0].message.content == choice.message.content


def test_greedy_completion_equals_doppler_generate(client):
    # The same prompt through `doppler generate` (another entry point into the library):
    # the same greedy tokens, hence the same text.
    model = os.environ["DOPPLER_SMOLLM2"]
    binary = os.environ.get("DOPPLER_BIN", os.path.join(ROOT, "target", "debug", "doppler"))
    prompt = "The three primary colours are"
    out = subprocess.run(
        [binary, "generate", "-m", model, prompt, "-n", "8", "-c", "256", "--temperature", "0",
         "--top-k", "0", "--top-p", "1", "--min-p", "0", "--json"],
        capture_output=True, text=True, timeout=600, check=True)
    want = json.loads(out.stdout.strip().splitlines()[-1])
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == want["text"]
    assert r.usage.completion_tokens == want["generated_tokens"] + (want["stop"] == "token")
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    # The generated ids as a prompt of token ids (OpenAI's `prompt: [int]`, one prompt in
    # a list too): taken as given, the same continuation as their text.
    ids = want["tokens"]
    by_text = client.completions.create(model="smollm2", prompt=want["text"], max_tokens=6,
                                        temperature=0)
    assert by_text.usage.prompt_tokens == len(ids)
    for prompt in (ids, [ids]):
        by_ids = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6,
                                           temperature=0)
        assert by_ids.usage.prompt_tokens == len(ids)
        assert by_ids.choices[0].text == by_text.choices[0].text


def test_seeded_sampling_repeats(client):
    ask = dict(model="smollm2", messages=HELLO, max_tokens=6, temperature=0.9, top_p=0.95,
               seed=1234)
    a = client.chat.completions.create(**ask).choices[0].message.content
    b = client.chat.completions.create(**ask).choices[0].message.content
    assert a == b


def test_completions_stop_at_a_stop_string(client):
    r = client.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=12,
                                  temperature=0, stop=[","])
    assert r.object == "text_completion"
    assert "," not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt="One, two, three,", max_tokens=12, temperature=0, stop=[","],
        stream=True))
    assert streamed == r.choices[0].text


def test_errors_are_openai_error_objects(client, server):
    host, port = server
    nokey = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nokey.models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=HELLO, temperature=3)
    assert e.value.body["param"] == "temperature"
    # A prompt longer than the context (-c 256).
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="word " * 400, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    # Token ids outside the vocabulary; two prompts in one request.
    for prompt in ([1, -1], [1, 49152], [[1], [2]], ["a", "b"]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="smollm2", prompt=prompt, max_tokens=2)
        assert e.value.body["param"] == "prompt", prompt
    # Bodies no client sends: not JSON, a wrong type, an unknown field, 9 MB.
    for body in [b"{not json", json.dumps({"messages": "hi"}).encode(),
                 json.dumps({"messages": HELLO, "frobnicate": 1}).encode()]:
        status, err = raw(server, "POST", "/v1/chat/completions", body)
        assert status == 400, (status, err)
        assert err["error"]["type"] == "invalid_request_error"
    # 9 MB: refused from its Content-Length with a 413 (a client still sending may see the
    # connection closed first instead); the server goes on serving.
    try:
        status, err = raw(server, "POST", "/v1/chat/completions", b"[" + b"1," * (9 << 19) + b"1]")
        assert status == 413 and err["error"]["code"] == "request_too_large"
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert raw(server, "GET", "/health")[0] == 200
    status, _ = raw(server, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401


def test_queue_full_is_429_and_a_cancelled_stream_frees_the_model(client, server):
    # --parallel 2 --queue 0: while two requests run, the next is refused.
    streams = [client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=60,
                                              temperature=0, stream=True) for _ in range(2)]
    for stream in streams:
        it = iter(stream)
        next(it)
        next(it)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=2)
    _, metrics = raw(server, "GET", "/metrics")
    assert re.search(r"^doppler_active_sequences 2$", metrics, re.M), metrics
    assert int(re.search(r"^doppler_kv_pages_in_use (\d+)", metrics, re.M).group(1)) > 0
    for stream in streams:
        stream.close()   # the clients go away mid-stream
    deadline = time.time() + 120
    while True:
        _, metrics = raw(server, "GET", "/metrics")
        active = int(re.search(r"^doppler_active_sequences (\d+)", metrics, re.M).group(1))
        if active == 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert active == 0
    r = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=2,
                                       temperature=0)
    assert r.choices[0].message.content
    _, metrics = raw(server, "GET", "/metrics")
    assert re.search(r"^doppler_queue_depth 0$", metrics, re.M)
    assert re.search(r"^doppler_kv_tokens_in_use 0$", metrics, re.M)
    assert re.search(r"^doppler_kv_pages_in_use 0$", metrics, re.M)


def test_null_options_and_top_p_zero(client, server):
    # SDKs that write every field send nulls; top_p 0 keeps the most likely token (greedy).
    status, body = raw(server, "POST", "/v1/chat/completions", json.dumps(
        {"model": "smollm2", "messages": HELLO, "max_tokens": 4, "stream": None,
         "stream_options": None, "temperature": None, "top_p": 0}).encode())
    assert status == 200, body
    greedy = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=4,
                                            temperature=0)
    assert body["choices"][0]["message"]["content"] == greedy.choices[0].message.content
    # /metrics needs the key; the scheme is case-insensitive.
    assert raw(server, "GET", "/metrics", headers={"Authorization": ""})[0] == 401
    assert raw(server, "GET", "/metrics", headers={"Authorization": f"bearer {KEY}"})[0] == 200


def test_health_needs_no_key(server):
    status, body = raw(server, "GET", "/health", headers={"Authorization": ""})
    assert status == 200 and body == {"status": "ok"}


def test_logprobs_chat_stream_and_legacy(client):
    ask = dict(model="smollm2", messages=HELLO, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**ask).choices[0]
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **ask)
    choice = r.choices[0]
    # The host's argmax over the logits picks what the GPU's greedy path picked.
    assert choice.message.content == plain.message.content
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens - (choice.finish_reason == "stop")
    assert b"".join(bytes(t.bytes) for t in content).decode() == choice.message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.logprob <= 0 and t.top_logprobs[0].token == t.token   # greedy: the top one
        assert t.top_logprobs[0].logprob == t.logprob
        assert all(a.logprob >= b.logprob for a, b in zip(t.top_logprobs, t.top_logprobs[1:]))
    # Streamed: the same entries, chunk by chunk.
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True,
                                                 **ask))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    # Text completions' legacy form: logprobs N.
    t = client.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=4,
                                  temperature=0, logprobs=2).choices[0]
    lp = t.logprobs
    assert "".join(lp.tokens) == t.text and len(lp.token_logprobs) == len(lp.tokens)
    # Characters, as OpenAI and vLLM count them.
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) == 2 and max(d.values()) == p for d, p in zip(lp.top_logprobs, lp.token_logprobs))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(top_logprobs=30, logprobs=True, **ask)
    assert e.value.body["param"] == "top_logprobs"


def test_penalties_and_logit_bias(client):
    ask = dict(model="smollm2", prompt="One, two, three,", max_tokens=12, temperature=0)
    # Token 28 (",") pushed by +100 is every token.
    forced = client.completions.create(logit_bias={"28": 100}, logprobs=0, **ask).choices[0]
    assert set(forced.logprobs.tokens) == {","}
    # The greedy answer repeats ","; a frequency penalty of 2 a use changes it (the
    # arithmetic itself: doppler's unit tests in infer::sample).
    plain = client.completions.create(logprobs=0, **ask).choices[0]
    assert plain.logprobs.tokens.count(",") >= 3
    pen = client.completions.create(frequency_penalty=2.0, logprobs=0, **ask).choices[0]
    assert pen.text != plain.text
    assert pen.logprobs.tokens.count(",") < plain.logprobs.tokens.count(",")
    for bad in [dict(frequency_penalty=2.5), dict(presence_penalty=-3),
                dict(logit_bias={"999999": 1}), dict(logit_bias={"5": 101})]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**ask, **bad)
        assert e.value.body["param"] == next(iter(bad))


SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]},
                                  "maxItems": 2},
                         "capital": {"type": "boolean"}},
          "required": ["city", "population", "tags"]}


def test_json_mode_and_json_schema_parse(client):
    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    for seed in (1, 2):
        r = client.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=80, temperature=0.8, seed=seed,
            response_format={"type": "json_object"}).choices[0]
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.message.content), dict)
        r = client.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=80, temperature=0.8, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        v = json.loads(c.message.content)
        assert list(v)[:3] == ["city", "population", "tags"] and set(v) <= set(SCHEMA["properties"])
        assert isinstance(v["city"], str) and len(v["city"]) <= 24
        assert isinstance(v["population"], int) and not isinstance(v["population"], bool)
        assert len(v["tags"]) <= 2 and set(v["tags"]) <= {"big", "old", "coastal"}
        assert isinstance(v.get("capital", True), bool)
    # Streamed, the same text as whole (greedy).
    ask = dict(model="smollm2", messages=msgs, max_tokens=40, temperature=0,
               response_format={"type": "json_object"})
    whole = client.chat.completions.create(**ask).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **ask) if c.choices)
    assert streamed == whole
    # What the grammar cannot express is refused, naming it.
    for fmt, word in [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a+"}}}, "pattern"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name"),
        ({"type": "yaml"}, "yaml"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2,
                                           response_format=fmt)
        assert e.value.body["param"] == "response_format" and word in e.value.body["message"]


def test_a_shared_system_prompt_is_computed_once(client, server):
    """Requests whose prompts start with the same system prompt share its KV pages: the
    usage reports the cached prompt tokens (OpenAI's prompt_tokens_details.cached_tokens,
    whole pages of 16), the metrics count them, and the answer is the one computed
    without them (the first time the same request ran, before anything was cached)."""
    system = "You answer in one short sentence and never use lists. " * 4
    def ask(user):
        r = client.chat.completions.create(
            model="smollm2", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
        details = r.usage.prompt_tokens_details
        return r.choices[0].message.content, r.usage.prompt_tokens, details.cached_tokens
    first, n, cached0 = ask("Name a colour.")
    assert n > 48 and cached0 % 16 == 0
    other, _, cached = ask("Count to three.")
    assert cached >= 32 and cached % 16 == 0, cached
    again, _, cached = ask("Name a colour.")
    assert cached >= 48 and again == first
    _, metrics = raw(server, "GET", "/metrics")
    m = re.search(r"^doppler_prompt_tokens_cached_total (\d+)$", metrics, re.M)
    assert m and int(m.group(1)) >= 80, metrics


def test_load_every_answer_equals_the_request_alone():
    """16 concurrent streams, 64 requests (chat and text, greedy and seeded, stop strings,
    every 10th cancelled after its first chunk; three in four plain, whose tokens the GPU
    chooses and whose steps are chained, one in four with log-probabilities, sampled on
    the host): each finished answer, text and log-probabilities, is bit for bit the same
    request's answer when it runs alone; steps were chained; afterwards nothing is held."""
    proc, host, port = start("--queue", "64")
    try:
        c = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="-", max_retries=0,
                          timeout=600)
        prompts = ["Count to five.", "Name a colour.", "One, two,", "Hello in Spanish:"]

        # Short prompts and answers: lavapipe runs a request in about a second.
        # Worker w runs requests 4w .. 4w + 3 in turn, so the requests running together
        # mostly share i % 4: rounds of plain requests (chained steps) and one round with
        # log-probabilities (the host samples; no chaining while one runs).
        def ask(i):
            a = dict(model="smollm2", max_tokens=2 + i % 3, seed=i,
                     temperature=0.8 if i % 8 < 4 else 0)
            if i % 4 == 1:
                a["messages"] = [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": prompts[i % 4]}]
            else:
                a["prompt"] = prompts[i % 4]
            if i % 4 == 2:
                a["stop"] = [","]
            if i % 4 == 3:
                a.update(max_tokens=1 + i % 3, logprobs=1, temperature=0 if i % 8 < 4 else 0.8)
            return a

        def run(i, cancel=False):
            a = ask(i)
            chat = "messages" in a
            make = c.chat.completions.create if chat else c.completions.create
            if a.get("logprobs") is True:
                a["top_logprobs"] = 1
            stream = make(stream=True, **a)
            text, lps = "", []
            for n, ch in enumerate(stream):
                if cancel and n >= 1:
                    stream.close()
                    return None
                if not ch.choices:
                    continue
                choice = ch.choices[0]
                if chat:
                    text += choice.delta.content or ""
                    if choice.logprobs and choice.logprobs.content:
                        lps += [(t.token, t.logprob) for t in choice.logprobs.content]
                else:
                    text += choice.text
                    if choice.logprobs:
                        lps += list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs))
            return text, lps

        results = {}

        def worker(w):
            for k in range(4):
                i = w * 4 + k
                results[i] = run(i, cancel=(i % 10 == 9))

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert len(results) == 64
        for i, got in sorted(results.items()):
            if got is None:
                continue
            assert got == run(i), i
        _, metrics = raw((host, port), "GET", "/metrics", headers={"Authorization": ""})
        for name in ("queue_depth", "active_sequences", "kv_tokens_in_use", "kv_pages_in_use"):
            assert re.search(rf"^doppler_{name} 0$", metrics, re.M), (name, metrics)
        chained = re.search(r"^doppler_chained_steps_total (\d+)$", metrics, re.M)
        assert chained and int(chained.group(1)) > 0, metrics
    finally:
        proc.kill()
        proc.wait()
