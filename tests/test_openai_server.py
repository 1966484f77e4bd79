"""``muse-spark serve-openai``: the real server in a subprocess, the real ``openai`` client.

Two servers for the module, each over an eager CPU engine built from a tiny pair:

* ``tiny``: the agreeing pair (it has the chat template ``make_tiny`` writes); every output is
  compared with the runtime in this process (``Generator``, the specification);
* ``plain``: the random pair without its ``tokenizer_config.json`` (no chat template); its draft
  rarely agrees, so a request of a few hundred tokens runs long enough to be cut off (the
  disconnect and shutdown tests).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from muse_spark.builder.build import build_engine
from muse_spark.runtime import Generator, SamplingParams, load_engine, load_tokenizer

START_TIMEOUT = 180
MAX_BATCH = 4


# ---- servers -------------------------------------------------------------------------------------
class Server:
    def __init__(self, engine: Path, log: Path, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # One torch thread: the server and this process share the CPU.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "muse_spark.cli", "serve-openai", "--engine", str(engine), "--port",
                 str(self.port), *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"the server did not become healthy in {START_TIMEOUT} s:\n{self.tail()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", **{"max_retries": 0, "timeout": 120, **kw})

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(srv: Server) -> dict[str, float]:
    """``name{labels}`` (the model label left out) → value."""
    status, text = get(srv.url + "/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r'(\w+)\{model="[^"]*",?(.*)\} (\S+)', line)
        if m:
            out[m[1] + (f"{{{m[2]}}}" if m[2] else "")] = float(m[3])
    return out


def wait_for(predicate, timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def engines(agreeing_pair, random_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    tiny = root / "tiny"
    build_engine(*agreeing_pair, tiny, backend="eager", device="cpu", max_batch=MAX_BATCH, max_seq=256, quiet=True)
    bare = root / "random-pair"  # the random pair without its tokenizer config: an engine without a chat template
    for sub, src in zip(("target", "draft"), random_pair):
        shutil.copytree(src, bare / sub, ignore=shutil.ignore_patterns("tokenizer_config.json"))
    plain = root / "plain"
    build_engine(bare / "target", bare / "draft", plain, backend="eager", device="cpu", max_batch=MAX_BATCH,
                 max_seq=256, quiet=True)
    return tiny, plain


@pytest.fixture(scope="module")
def server(engines, tmp_path_factory):
    srv = Server(engines[0], tmp_path_factory.mktemp("logs") / "tiny.log", "--served-model-name", "tiny",
                 "--max-request-bytes", "100000")
    yield srv
    assert srv.stop() == 0, srv.tail()


@pytest.fixture(scope="module")
def plain_server(engines, tmp_path_factory):
    srv = Server(engines[1], tmp_path_factory.mktemp("logs") / "plain.log", "--exit-timeout", "0")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


class Reference:
    """The runtime in this process: what the server must answer."""

    def __init__(self, engine_dir: Path):
        self.engine = load_engine(engine_dir)
        self.tok = load_tokenizer(self.engine.tokenizer_path)
        self.gen = Generator(self.engine)

    def run(self, ids: list[int], max_tokens: int, **kw):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self.gen.generate([ids], SamplingParams(max_tokens=max_tokens, **kw))[0]
        finally:
            torch.set_num_threads(n)

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def complete(self, prompt: str, max_tokens: int) -> tuple[str, list[int], object]:
        ids = self.tok.encode(prompt).ids
        req = self.run(ids, max_tokens)
        return self.text(req.output), ids, req


@pytest.fixture(scope="module")
def ref(engines):
    return Reference(engines[0])


def stream_text(chunks, chat: bool) -> tuple[str, list]:
    chunks = list(chunks)
    pieces = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices]
    return "".join(pieces), chunks


# ---- the models and the texts ----------------------------------------------------------------------
def test_the_models_list_names_the_served_model(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_a_greedy_completion_is_the_generators_output(client, ref):
    text, ids, req = ref.complete("Hello", 24)
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 24, len(ids) + 24)
    # the prompt as token ids, and as a list holding one prompt
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0).choices[0].text == text
    assert client.completions.create(model="tiny", prompt=["Hello"], max_tokens=24,
                                     temperature=0).choices[0].text == text


def test_a_chat_completion_renders_the_engines_template(client, ref):
    # make_tiny's template: <|bos|>, "role: content" and a newline per message, then "assistant: "
    prompt = "<|bos|>system: be brief\nuser: hi\nassistant: "
    ids = ref.tok.encode(prompt).ids
    assert ids[0] == ref.tok.token_to_id("<|bos|>")
    req = ref.run(ids, 20)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text(req.output)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 20)
    # content as a list of text parts; max_completion_tokens
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    r2 = client.chat.completions.create(model="tiny", messages=parts, max_completion_tokens=20, temperature=0)
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_streamed_completions_and_chats_concatenate_to_the_whole_text(client):
    whole = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=30, temperature=0)
    text, chunks = stream_text(client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}), chat=False)
    assert text == whole.choices[0].text
    assert len(chunks) > 3  # one chunk per speculative step, not one at the end
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": "stream me"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=25, temperature=0)
    text, chunks = stream_text(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=25, temperature=0, stream=True), chat=True)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_sampling_with_a_seed_is_the_generators_output(client, ref):
    ids = ref.tok.encode("Hello").ids
    req = ref.run(ids, 20, temperature=0.9, seed=1234)
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=20, temperature=0.9, seed=1234)
    assert r.choices[0].text == ref.text(req.output)


# ---- stop strings --------------------------------------------------------------------------------
def _stop_across_a_step(ref, prompt: str, max_tokens: int = 60) -> tuple[str, str, str]:
    """(the greedy text, a stop string spanning two speculative steps, the text before it)."""
    text, _, req = ref.complete(prompt, max_tokens)
    assert len(text) == len(req.output)  # (one character per token: printable bytes)
    ends = []
    for s in req.steps:
        ends.append((ends[-1] if ends else 1) + len(s.emitted))  # (token 0 comes from the prefill)
    for end in ends[1:-1]:
        stop = text[end - 2:end + 1]  # two characters of one step and one of the next
        if len(stop) == 3 and text.find(stop) == end - 2:
            return text, stop, text[:end - 2]
    pytest.fail(f"no stop string spans a step boundary in {text!r} (steps {ends})")


def test_a_stop_string_cuts_the_text_exactly_before_it(client, ref):
    text, stop, before = _stop_across_a_step(ref, "Hello")
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=60, temperature=0,
                                  stop=[stop, "never in this text \u2603"])
    assert r.choices[0].text == before and r.choices[0].finish_reason == "stop"
    # the tokens generated through the one that completed the stop string
    assert r.usage.completion_tokens == len(before) + len(stop)
    streamed, chunks = stream_text(client.completions.create(
        model="tiny", prompt="Hello", max_tokens=60, temperature=0, stop=stop, stream=True), chat=False)
    # (the stop string's start, at the end of a step, was held back until the next step showed it)
    assert streamed == before and chunks[-1].choices[0].finish_reason == "stop"
    # the first occurrence wins; a stop string at the very start leaves nothing
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=60, temperature=0, stop=text[:2])
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"


def test_a_stop_string_in_a_chat(client, ref):
    ids = ref.tok.encode("<|bos|>user: hi\nassistant: ").ids
    text = ref.text(ref.run(ids, 40).output)
    stop = text[10:13]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                       temperature=0, stop=stop)
    assert r.choices[0].message.content == text[:text.find(stop)] and r.choices[0].finish_reason == "stop"


# ---- log-probabilities and n ------------------------------------------------------------------------
def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-4 for x, y in zip(a, b))


def _alike(a, b) -> bool:
    """Equal, the floats within 1e-4 (the same tokens computed in another request)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_alike(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_alike(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-4
    return a == b


def _lp_stream(chunks, chat: bool) -> dict:
    """The log-probabilities of a stream's chunks, concatenated (completions: the four lists; chat: content)."""
    out: dict = {"content": []} if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if not c.choices or c.choices[0].logprobs is None:
            continue
        lp = c.choices[0].logprobs
        for key in out:
            out[key] += [x.model_dump() if hasattr(x, "model_dump") else x for x in getattr(lp, key) or []]
    return out


def test_completion_logprobs_are_the_generators(client, ref):
    ids = ref.tok.encode("Hello").ids
    req = ref.run(ids, 24, logprobs=3)
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0, logprobs=3)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == ref.text(req.output)  # (asking for logprobs changes no token)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 24
    assert lp.tokens == [ref.tok.decode([t], skip_special_tokens=False) for t in req.output]
    assert _close(lp.token_logprobs, [x for x, _ in req.logprobs])
    for got, (mine, top) in zip(lp.top_logprobs, req.logprobs):
        want = {}
        for t, v in top:
            want.setdefault(ref.tok.decode([t], skip_special_tokens=False), v)
        assert got.keys() == want.keys() and _close([got[k] for k in want], list(want.values()))
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(24)]  # (one character a token here)
    # streamed: the chunks' log-probabilities concatenate to the whole answer's
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0, logprobs=3,
                                            stream=True))
    assert len(chunks) > 3 and _alike(_lp_stream(chunks, chat=False), lp.model_dump())
    # logprobs 0: each token's own log-probability (its top_logprobs hold just itself)
    r0 = client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0, logprobs=0)
    assert r0.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert [list(d) for d in r0.choices[0].logprobs.top_logprobs] == [[t] for t in lp.tokens]


def test_logprobs_stop_at_a_stop_string(client, ref):
    """Tokens cut off by a stop string are not reported, streamed or not."""
    text, stop, before = _stop_across_a_step(ref, "Hello")
    kw = dict(model="tiny", prompt="Hello", max_tokens=60, temperature=0, stop=stop, logprobs=2)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == before and "".join(lp.tokens) == before
    streamed = _lp_stream(client.completions.create(**kw, stream=True), chat=False)
    assert _alike(streamed, lp.model_dump())


def test_chat_logprobs_are_the_generators(client, ref):
    ids = ref.tok.encode("<|bos|>user: hi\nassistant: ").ids
    req = ref.run(ids, 20, logprobs=2)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0, logprobs=True,
              top_logprobs=2)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == ref.text(req.output)
    assert len(content) == r.usage.completion_tokens == 20
    for got, token, (mine, top) in zip(content, req.output, req.logprobs):
        assert got.token == ref.tok.decode([token], skip_special_tokens=False)
        assert got.bytes == list(got.token.encode()) and abs(got.logprob - mine) < 1e-4
        assert [a.token for a in got.top_logprobs] == [ref.tok.decode([t], skip_special_tokens=False) for t, _ in top]
        assert _close([a.logprob for a in got.top_logprobs], [v for _, v in top])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert _alike(_lp_stream(chunks, chat=True)["content"], [c.model_dump() for c in content])
    # without top_logprobs: each token's own, no alternatives
    r = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert [c.top_logprobs for c in r.choices[0].logprobs.content] == [[]] * 20


def test_token_bytes_of_a_split_character():
    """A byte-level token holding part of a multi-byte character: its text alone is U+FFFD, its bytes its own."""
    from muse_spark.builder.pair import make_tokenizer
    from muse_spark.serving.openai_protocol import TokenText

    tok = make_tokenizer(300)
    tokens = TokenText(tok)
    ids = tok.encode("é").ids
    assert len(ids) == 2 and [tokens.get(t)[0] for t in ids] == ["\ufffd", "\ufffd"]
    assert sum((tokens.get(t)[1] for t in ids), []) == list("é".encode())
    assert tokens.get(tok.token_to_id("<|eos|>")) == ("<|eos|>", list(b"<|eos|>"))
    assert tokens.get(tok.encode(" ").ids[0]) == (" ", [32])
    assert TokenText(None).get(7) == ("token_id:7", list(b"token_id:7"))


def test_n_choices_are_the_generators_with_seeds_seed_plus_i(client, plain_server, engines, ref):
    # (the random pair: its target is far from certain, so different seeds give different texts at temperature 1)
    plain, plain_ref = plain_server.client(), Reference(engines[1])
    ids = plain_ref.tok.encode("Hello").ids
    want = [plain_ref.text(plain_ref.run(ids, 20, temperature=1.0, seed=77 + i, ignore_eos=True).output)
            for i in range(3)]
    assert len(set(want)) == 3  # (the three choices' seeds really give three texts)
    kw = dict(model="plain", prompt="Hello", max_tokens=20, temperature=1.0, seed=77, n=3,
              extra_body={"ignore_eos": True})
    r = plain.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 60)
    # streamed: the choices' chunks interleave, each with its index
    chunks = list(plain.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == want
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 60
    # chat, with logprobs: each choice has its own
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = ref.tok.encode("<|bos|>user: hi\nassistant: ").ids
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=5, n=2,
                                       logprobs=True)
    for i, c in enumerate(r.choices):
        req = ref.run(chat_ids, 12, temperature=1.0, seed=5 + i, logprobs=0)
        assert c.index == i and c.message.content == ref.text(req.output)
        assert _close([x.logprob for x in c.logprobs.content], [x for x, _ in req.logprobs])
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1.0,
                                                 seed=5, n=2, stream=True))
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].delta.role) == [0, 1]
    assert ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
            for i in range(2)] == [c.message.content for c in r.choices]
    # greedy: every choice is the same text
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0, n=2)
    assert r.choices[0].text == r.choices[1].text


# ---- many clients ------------------------------------------------------------------------------
def test_concurrent_clients_get_their_solo_outputs(server, client, ref):
    jobs = [("Hello", 40, False), ("The quick brown fox", 25, True), ("a", 60, False), ("zz top", 33, True),
            ("in flight", 48, False), ("batching", 17, True), ("one more", 52, False), ("last", 29, True)]
    expected = [ref.complete(p, n)[0] for p, n, _ in jobs]
    results: dict[int, object] = {}

    def run(i: int, prompt: str, n: int, stream: bool) -> None:
        try:
            if stream:
                results[i] = stream_text(client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                                                   temperature=0, stream=True), chat=False)[0]
            else:
                results[i] = client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                                       temperature=0).choices[0].text
        except Exception as e:  # (reported below, with the others)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results.get(i) for i in range(len(jobs))] == expected


# ---- errors --------------------------------------------------------------------------------------
def _error(excinfo) -> dict:
    """The error object of an answer (the client takes it from OpenAI's {"error": {...}} shape)."""
    e = excinfo.value
    assert e.body == {"message": e.body["message"], "type": e.type, "param": e.param, "code": e.code}
    return e.body


@pytest.mark.parametrize("kw, param, says", [
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
    ({"top_p": 1.5}, "top_p", "top_p must be a number in [0.0, 1.0]"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be a number in [-2.0, 2.0]"),
    ({"frequency_penalty": "x"}, "frequency_penalty", "frequency_penalty must be a number"),
    ({"logprobs": 21}, "logprobs", "logprobs must be an integer in [0, 20], got 21"),
    ({"best_of": 3}, "best_of", "best_of is not supported"),
    ({"n": 9}, "n", "n must be an integer in [1, 8], got 9"),
    ({"n": 0}, "n", "n must be an integer in [1, 8], got 0"),
    ({"extra_body": {"top_k": -5}}, "top_k", "top_k must be an integer in [0, 259]"),
    ({"extra_body": {"min_tokens": 1.5}}, "min_tokens", "min_tokens must be an integer"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", "unknown parameter 'frobnicate'"),
    ({"temperature": -1}, "temperature", "temperature must be a finite number >= 0"),
    ({"prompt": [1, 2, 999]}, "prompt", "outside the vocabulary [0, 259)"),
    ({"prompt": ["one", "two"]}, "prompt", "a list of 2 prompts is not supported"),
    ({"prompt": [7] * 250}, "prompt", "exceeds the engine's maximum sequence length 256"),
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"max_tokens": 250}, "prompt", "exceeds the engine's maximum sequence length"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
])
def test_a_bad_completion_request_is_a_400_naming_its_parameter(client, kw, param, says):
    args = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400
    err = _error(e)
    assert says in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"


def test_neutral_values_of_unsupported_parameters_are_taken(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, top_p=1,
                                  presence_penalty=0, frequency_penalty=0, n=1, user="someone",
                                  extra_body={"top_k": -1})
    assert r.choices[0].finish_reason == "length"


def test_sampling_controls_reach_the_runtime(client):
    """top_k 1 samples the most likely token whatever the temperature: the greedy text; a penalty changes
    the text, and the same request twice gives the same text (seeded)."""
    greedy = client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0)
    top1 = client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=1.0, seed=3,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    kw = dict(model="tiny", prompt="Hello", max_tokens=24, temperature=0.9, seed=5, top_p=0.8, presence_penalty=1.5,
              extra_body={"repetition_penalty": 1.4, "min_p": 0.05})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 24


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="Hello", max_tokens=4)
    assert e.value.status_code == 404 and _error(e)["code"] == "model_not_found" and "'gpt-4o'" in _error(e)["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_bad_chat_requests_are_400s(client):
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": []}, "messages is empty"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "content parts of type 'image_url' are not supported"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role is required"),
        ({"messages": hi, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"messages": hi, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in [0, 20]"),
        ({"messages": hi, "n": 9}, "n must be an integer in [1, 8]"),
        ({"messages": hi, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools is not supported"),
        ({"messages": hi, "max_tokens": 5, "max_completion_tokens": 6}, "disagree"),
        ({"messages": [{"role": "user", "content": "x" * 300}]}, "leaves no room to generate"),
    ]
    for kw, says in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", **kw)
        assert says in _error(e)["message"], (kw, _error(e))


def test_bad_bodies_and_paths(server):
    status, body = post(server.url + "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(server.url + "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = post(server.url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": "5"}).encode())
    assert status == 400 and body["error"]["param"] == "max_tokens" and "integer" in body["error"]["message"]
    status, body = post(server.url + "/v1/completions", json.dumps({"prompt": 5}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    # over --max-request-bytes (100000 here): 413
    status, body = post(server.url + "/v1/completions", json.dumps({"prompt": "x" * 200_000}).encode())
    assert status == 413 and "--max-request-bytes" in body["error"]["message"]
    status, body = get(server.url + "/v1/nowhere")
    assert status == 404 and json.loads(body)["error"]["message"] == "no route /v1/nowhere"


def test_an_engine_without_a_chat_template_refuses_chats(plain_server):
    client = plain_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    err = _error(e)
    assert "has no chat template" in err["message"] and err["code"] == "no_chat_template"
    assert client.completions.create(model="plain", prompt="hi", max_tokens=4).usage.completion_tokens >= 1


def test_the_server_keeps_serving_after_errors(server, client, ref):
    before = metrics(server)
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="Hello", max_tokens=0)
    text, _, _ = ref.complete("Hello", 12)
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0).choices[0].text == text
    after = metrics(server)
    rejected = 'muse_spark_requests_total{outcome="rejected"}'
    assert after[rejected] == before[rejected] + 3
    assert get(server.url + "/health") == (200, '{"status":"ok"}')


# ---- health, metrics, disconnects, shutdown -----------------------------------------------------
def test_health_and_metrics(server, client):
    assert get(server.url + "/health") == (200, '{"status":"ok"}')
    client.completions.create(model="tiny", prompt="metrics", max_tokens=30, temperature=0)
    status, text = get(server.url + "/metrics")
    assert status == 200 and "# TYPE muse_spark_requests_total counter" in text
    # (the gauges follow the scheduler's loop, a moment after the answer)
    wait_for(lambda: metrics(server)["muse_spark_free_slots"] == MAX_BATCH, what="the slot to be free")
    m = metrics(server)
    assert m['muse_spark_requests_total{outcome="completed"}'] >= 1
    assert m["muse_spark_generated_tokens_total"] >= 30 and m["muse_spark_prompt_tokens_total"] >= 7
    assert m["muse_spark_active_requests"] == 0 and m["muse_spark_waiting_requests"] == 0
    assert m["muse_spark_draft_length"] == 5
    by_position = [m[f'muse_spark_accepted_draft_tokens_by_position_total{{position="{k}"}}'] for k in range(1, 6)]
    # a draft is accepted only after the ones before it: the counts fall with the position, and add up
    assert by_position == sorted(by_position, reverse=True) and by_position[0] > 0
    assert sum(by_position) == m["muse_spark_accepted_draft_tokens_total"]
    assert m["muse_spark_accepted_draft_tokens_total"] <= 5 * m["muse_spark_steps_total"]
    assert m["muse_spark_verified_draft_tokens_total"] == 5 * m["muse_spark_steps_total"]  # (the schedule 'off')


def _open_stream(srv: Server, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion, read up to its first event."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    body = {"model": "plain", "prompt": [40, 41, 42], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")
    return conn, resp


def test_a_client_that_goes_away_frees_its_slot(plain_server):
    before = metrics(plain_server)
    streams = [_open_stream(plain_server, 240) for _ in range(MAX_BATCH)]  # every slot taken
    for conn, resp in streams:
        conn.sock.shutdown(socket.SHUT_RDWR)
        resp.close()
        conn.close()
    # a non-streamed request whose client gives up
    with pytest.raises(openai.APITimeoutError):
        plain_server.client(timeout=0.5).completions.create(model="plain", prompt=[50, 51], max_tokens=240,
                                                            temperature=0, extra_body={"ignore_eos": True})
    cancelled = 'muse_spark_requests_total{outcome="cancelled"}'
    wait_for(lambda: metrics(plain_server)[cancelled] == before[cancelled] + MAX_BATCH + 1, what="the cancellations")
    wait_for(lambda: metrics(plain_server)["muse_spark_free_slots"] == MAX_BATCH, what="the slots to be freed")
    assert metrics(plain_server)['muse_spark_requests_total{outcome="completed"}'] == \
        before['muse_spark_requests_total{outcome="completed"}']
    # at full concurrency again: every request runs to its end
    client = plain_server.client()
    outs: list = [None] * MAX_BATCH

    def run(i):
        outs[i] = client.completions.create(model="plain", prompt=[60 + i], max_tokens=20, temperature=0,
                                            extra_body={"ignore_eos": True}).usage.completion_tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(MAX_BATCH)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outs == [20] * MAX_BATCH


def test_shutdown_ends_a_running_stream_with_its_text(plain_server):
    """SIGTERM (here with --exit-timeout 0): the running request ends at once with finish reason
    'shutdown' and the text it has, then the server exits cleanly. (The last test of the module:
    it stops this server.)"""
    conn, resp = _open_stream(plain_server, 240)
    plain_server.proc.send_signal(signal.SIGTERM)
    rest = resp.read()
    conn.close()
    events = [json.loads(line[6:]) for line in rest.split(b"\n") if line.startswith(b"data: {")]
    assert events and events[-1]["choices"][0]["finish_reason"] == "shutdown", rest[-500:]
    assert b"data: [DONE]" in rest
    assert plain_server.proc.wait(60) == 0, plain_server.tail()


# ---- the text of a request, without a server ------------------------------------------------------
def test_text_stream_cuts_at_stop_strings_and_keeps_characters_whole():
    from muse_spark.builder.pair import make_tokenizer
    from muse_spark.serving.openai_protocol import TextStream

    tok = make_tokenizer(259)
    ids = tok.encode("héllo wörld, wörld").ids  # byte tokens: é and ö are two tokens each
    assert len(ids) > len("héllo wörld, wörld")

    def run(stop, step=3):
        ts, pieces = TextStream(tok, stop), []
        for end in range(step, len(ids) + step, step):
            ts.feed(ids[:end], final=end >= len(ids))
            pieces.append(ts.take(final=end >= len(ids) or ts.stopped))
            if ts.stopped:
                break
        return ts, pieces

    ts, pieces = run(())
    assert "".join(pieces) == "héllo wörld, wörld" and "\ufffd" not in "".join(pieces)
    ts, pieces = run(("wö",))  # the first occurrence, its bytes split across feeds
    assert "".join(pieces) == "héllo " and ts.stopped and ts.tokens == len(tok.encode("héllo wö").ids)
    assert all("w" not in p for p in pieces)  # "w" (a start of the stop string) was held back, never sent
    ts, pieces = run(("xyz", ", w"), step=1)
    assert "".join(pieces) == "héllo wörld" and ts.stopped


def test_text_stream_offsets_say_which_tokens_are_out():
    from muse_spark.builder.pair import make_tokenizer
    from muse_spark.serving.openai_protocol import TextStream

    tok = make_tokenizer(259)
    ids = tok.encode("aé, wörld").ids  # é and ö: two byte tokens each
    ts = TextStream(tok, offsets=True)
    ts.feed(ids[:2])  # "a" and the first byte of é: only "a" is out
    assert ts.take() == "a" and ts.offsets == [0, 1] and ts.reportable(False) == 1
    ts.feed(ids, final=True)
    assert ts.take(final=True) == "é, wörld" and ts.text == "aé, wörld" and ts.reportable(True) == len(ids)
    assert ts.offsets == [0, 1, 1, 2, 3, 4, 5, 5, 6, 7, 8]  # (both bytes of a character start where it does)
    # a stop string: the tokens wholly in it or after it are never out
    ts = TextStream(tok, (", w",), offsets=True)
    ts.feed(ids[:5])
    assert ts.take() == "aé" and ts.reportable(False) == 3  # ("," might begin the stop string: held back)
    ts.feed(ids, final=True)
    assert ts.stopped and ts.take(final=True) == "" and ts.text == "aé" and ts.reportable(True) == 3


def test_a_server_on_paged_kv_caches_answers_concurrent_requests_as_the_generator(engines, ref, tmp_path):
    """`serve-openai --kv-cache-tokens`: a pool smaller than the slots' windows (requests wait for blocks or
    are preempted), concurrent completions each the Generator's own output, the pool stated at startup."""
    import concurrent.futures

    srv = Server(engines[0], tmp_path / "paged.log", "--served-model-name", "tiny", "--kv-cache-tokens", "320",
                 "--kv-block-size", "16")
    try:
        client = srv.client()
        prompts = ["Hello", "The sky is", "Once upon a time", "1 2 3", "Paged caches", "A B C D"]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=60,
                                                                        temperature=0), prompts))
        for prompt, r in zip(prompts, answers):
            assert r.choices[0].text == ref.complete(prompt, 60)[0], prompt
        assert "KV: paged, a pool of 320 positions in blocks of 16" in srv.tail()
    finally:
        assert srv.stop() == 0, srv.tail()
