"""The OpenAI API's requests and responses for ``muse-spark serve-openai`` (``openai_server.py``).

Everything a request is checked for before it reaches the scheduler, so a bad
request gets its 400 before a response (or an event stream) starts and touches
nothing else:

* **Shapes** by pydantic models in strict mode (``"5"`` is not an integer, ``true``
  is not a token id); unknown fields are collected and judged next.
* **Sampling controls** (``top_p``, ``top_k``, ``min_p``, the penalties, ``min_tokens``) and
  log-probabilities (completions' ``logprobs: N``, chat's ``logprobs: true`` with
  ``top_logprobs: N``) go to the runtime (``SamplingParams``; an engine that cannot apply them
  refuses with a 400). ``n`` (1 … ``MAX_N``) asks for that many independent samples.
* **Parameters the engine does not implement** (tools, ``best_of``, ``logit_bias``, …) are refused
  with a 400 naming the parameter,
  never ignored: a client asking for nucleus sampling must not silently get
  plain sampling. A parameter at its neutral value (``top_p: 1``,
  ``presence_penalty: 0``, ``null``) changes nothing and is taken. Fields
  that do not change the output (``user``, ``metadata``, …) are taken and
  ignored. Any other field is refused as unknown.
* **Values** against the engine: the prompt's token ids in the vocabulary,
  prompt + ``max_tokens`` (+ γ draft slots) within the engine's window —
  ``Generator.validate``, the runtime's own check, run before submission.

Defaults follow OpenAI's: ``temperature`` 1 (sampling; send 0 for greedy),
``max_tokens`` 16 for completions and the rest of the window for chat, a fresh
random ``seed`` per request unless one is given.

Chat prompts are rendered from the engine's ``tokenizer_config.json``
``chat_template`` with jinja2 as ``transformers`` renders them: a sandboxed
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter and the ``raise_exception`` and
``strftime_now`` helpers; the variables ``messages``, ``add_generation_prompt``
(true) and the tokenizer config's special tokens (``bos_token``, ``eos_token``,
…). The rendered text is tokenized without adding special tokens (the template
writes them).

``TextStream`` turns a request's tokens into text one token at a time and
applies the stop strings: the text is cut exactly before the first stop string
(wherever the step boundaries fall), and while streaming, the tail that could
still become a stop string is held back until it cannot. With log-probabilities
it also keeps where each token's text starts, so a token is reported once its
text is handed out, and a token wholly cut off by a stop string never is.
``TokenText`` gives one token's text and bytes for the log-probabilities.
"""

from __future__ import annotations

import bisect
import datetime
import json
import math
import re
import secrets
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, ValidationError

from muse_spark.runtime.generator import RequestError, SamplingParams
from muse_spark.serving.protocol import StreamDecoder

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 8  # choices per request (each one a request of its own to the scheduler)
MAX_LOGPROBS = 20  # the most likely tokens reported at each position (OpenAI's limit)


class ApiError(Exception):
    """An error answer in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- request shapes ---------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # (padding against length side channels: none is sent)


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # (name, tool_calls, …: the template's to use)
    role: str
    content: str | list[ContentPart] | None = None


class _Common(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # (the extra fields are judged by _check_extra)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # (an extension, as in vLLM: do not stop at the end-of-sequence token)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the top N at each token (0 … 20), and each token's own



class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # (with logprobs: true) the top N at each token, 0 … 20


# What a field of a union must be, said once (pydantic reports every member of the union).
_UNION_SHAPES = {
    "prompt": "prompt must be a string or a list of token ids (or a list holding one of those)",
    "stop": "stop must be a string or a list of strings",
    "content": "a message's content must be a string or a list of content parts",
}

# Parameters the engine does not implement, with the values that ask for nothing (taken as absent).
# Types count: `true` is not the number 1.
_NEUTRAL: dict[str, tuple] = {
    "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "frequency_penalty": (0,), "presence_penalty": (0,),
    "repetition_penalty": (1,), "best_of": (1,), "echo": (False,), "logit_bias": ({},), "suffix": ("",),
    "top_logprobs": (0,), "min_tokens": (0,), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "store": (False,), "stop_token_ids": ([],), "bad_words": ([],), "prediction": (), "audio": (),
    "reasoning_effort": (), "web_search_options": (), "verbosity": (), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "structured_outputs": (), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,),
}
# Fields that do not change what is generated: taken and ignored.
_IGNORED = frozenset({"user", "metadata", "parallel_tool_calls", "service_tier", "safety_identifier",
                      "prompt_cache_key"})


def _same(value, neutral) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


# Sampling controls the runtime implements (SamplingParams; the eager engine and aoti engines built with the
# controlled step), taken from the body.
_CONTROLS = ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens")


def _controls(extra: dict[str, Any]) -> dict[str, Any]:
    """The sampling controls a request sets (``top_k`` −1, OpenAI's and vLLM's "all", is 0 here)."""
    out = {}
    for name in _CONTROLS:
        value = extra.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(f"{name} must be a number, got {json.dumps(value)[:40]}", param=name)
        if name in ("top_k", "min_tokens"):
            if value != int(value):
                raise invalid(f"{name} must be an integer, got {value}", param=name)
            value = int(value)
        out[name] = 0 if name == "top_k" and value == -1 else value
    return out


def _check_extra(extra: dict[str, Any], neutral: dict[str, tuple]) -> None:
    for name, value in extra.items():
        if value is None or name in _IGNORED or name in _CONTROLS:
            continue
        if name not in neutral:
            raise invalid(f"unknown parameter {name!r}: this server does not know it (and does not ignore "
                          f"what it does not know)", param=name, code="unknown_parameter")
        if not any(_same(value, v) for v in neutral[name]):
            took = " or ".join(json.dumps(v) for v in neutral[name])
            raise invalid(f"{name} is not supported by this server yet (got {json.dumps(value)}; "
                          + (f"send {took} or leave it out)" if took else "leave it out)"),
                          param=name, code="unsupported_parameter")


def _validate(cls: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return cls.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"]]
        if not loc:
            if err["type"] == "json_invalid":
                raise invalid(f"the request body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}") \
                    from None
            raise invalid(f"the request body must be a JSON object ({err['msg']})") from None
        members = [p for p in loc if p in ("str", "int", "float", "bool") or "[" in p]  # (a union's members)
        param = ".".join(p for p in loc if p not in members) or None
        union = next((i for i, p in enumerate(loc) if p in _UNION_SHAPES), None) if members else None
        if union is not None:
            raise invalid(_UNION_SHAPES[loc[union]], param=".".join(loc[:union + 1])) from None
        if err["type"] == "missing":
            raise invalid(f"{param} is required", param=param) from None
        if err["type"] == "extra_forbidden":
            raise invalid(f"unknown parameter {param!r}", param=param, code="unknown_parameter") from None
        got = err.get("input")
        shown = json.dumps(got)[:80] if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
        raise invalid(f"{param}: {err['msg'][:1].lower()}{err['msg'][1:]} (got {shown})", param=param) from None


# ---- the served model -------------------------------------------------------------------------
class ChatTemplate:
    """A ``tokenizer_config.json`` chat template, compiled once."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.template = env.from_string(source)  # (a syntax error raises TemplateSyntaxError)
        self.special_tokens = special_tokens

    @classmethod
    def from_config(cls, config: dict) -> ChatTemplate | None:
        """The config's ``chat_template`` (a named list: the one called ``default``), or None."""
        source = config.get("chat_template")
        if isinstance(source, list):
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str) or not source:
            return None
        special = {}
        for key, value in config.items():
            if key.endswith("_token"):
                value = value.get("content") if isinstance(value, dict) else value  # (a serialized AddedToken)
                if isinstance(value, str):
                    special[key] = value
        return cls(source, special)

    def render(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except _TemplateRaised as e:
            raise invalid(f"the chat template refused these messages: {e}", param="messages") from None
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise invalid(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                          param="messages") from None


class _TemplateRaised(Exception):
    pass


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the name clients use, the engine's limits and text tools."""

    name: str
    generator: Any  # the scheduler's Generator (its validate(): vocabulary and window)
    tokenizer: Any  # a tokenizers.Tokenizer, or None
    chat_template: ChatTemplate | None
    max_seq: int
    gamma: int


@dataclass(frozen=True)
class ParsedRequest:
    prompt: list[int]
    params: SamplingParams  # the first choice's (choice i samples with seed + i: ``choice_params``)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1

    def choice_params(self, i: int) -> SamplingParams:
        """Choice ``i``'s parameters: the request's, with seed + i (modulo 2⁶⁴, as the runtime stores seeds)."""
        if i == 0:
            return self.params
        seed = (self.params.seed + i) % 2**64
        return SamplingParams(**{**self.params.__dict__, "seed": seed})


def parse_completion(body: bytes, served: ServedModel) -> ParsedRequest:
    r = _validate(CompletionRequest, body)
    _common_checks(r, served, _NEUTRAL)
    if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {r.logprobs}", param="logprobs")
    prompt = r.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid(f"a list of {len(prompt)} prompts is not supported: send one prompt per request",
                          param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if served.tokenizer is None:
            raise invalid("this engine has no tokenizer: send the prompt as a list of token ids", param="prompt")
        ids = served.tokenizer.encode(prompt).ids
    else:
        ids = list(prompt)
    if not ids:
        raise invalid("the prompt is empty", param="prompt")
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if r.max_tokens is None else r.max_tokens
    return _finish(r, ids, max_tokens, served, "prompt", logprobs=r.logprobs)


def parse_chat(body: bytes, served: ServedModel) -> ParsedRequest:
    r = _validate(ChatCompletionRequest, body)
    _common_checks(r, served, _NEUTRAL)
    if r.top_logprobs is not None:
        if not 0 <= r.top_logprobs <= MAX_LOGPROBS:
            raise invalid(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {r.top_logprobs}",
                          param="top_logprobs")
        if not r.logprobs and r.top_logprobs > 0:
            raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (r.top_logprobs or 0) if r.logprobs else None
    if served.chat_template is None:
        raise invalid(f"the model {served.name!r} has no chat template (its engine has no tokenizer_config.json "
                      f"with a chat_template): use /v1/completions with a prompt", param="messages",
                      code="no_chat_template")
    if served.tokenizer is None:
        raise invalid("this engine has no tokenizer, so chat messages cannot be tokenized: use /v1/completions "
                      "with token ids", param="messages")
    if not r.messages:
        raise invalid("messages is empty: send at least one message", param="messages")
    messages = [_message(i, m) for i, m in enumerate(r.messages)]
    text = served.chat_template.render(messages)
    ids = served.tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise invalid("the chat template rendered these messages as an empty prompt", param="messages")
    max_tokens = r.max_completion_tokens
    if r.max_tokens is not None:
        if max_tokens is not None and max_tokens != r.max_tokens:
            raise invalid(f"max_tokens ({r.max_tokens}) and max_completion_tokens ({max_tokens}) disagree; send "
                          f"one of them", param="max_completion_tokens")
        max_tokens = r.max_tokens
    if max_tokens is None:  # the rest of the window
        max_tokens = served.max_seq - served.gamma - len(ids)
        if max_tokens < 1:
            raise invalid(f"the prompt is {len(ids)} tokens, which leaves no room to generate in the engine's "
                          f"window of {served.max_seq} tokens ({served.gamma} of them draft slots)",
                          param="messages", code="context_length_exceeded")
    return _finish(r, ids, max_tokens, served, "messages", name="max_completion_tokens", logprobs=logprobs)


def _message(i: int, m: ChatMessage) -> dict:
    out = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        parts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise invalid(f"messages[{i}]: content parts of type {part.type!r} are not supported (text only)",
                              param=f"messages.{i}.content", code="unsupported_parameter")
            parts.append(part.text)
        out["content"] = "".join(parts)
    elif m.content is None:
        out["content"] = ""
    return out


def _common_checks(r: _Common, served: ServedModel, neutral: dict[str, tuple]) -> None:
    if r.model is not None and r.model != served.name:
        raise ApiError(404, f"the model {r.model!r} does not exist; this server serves {served.name!r}",
                       param="model", code="model_not_found")
    _check_extra(r.model_extra or {}, neutral)
    if r.n is not None and not 1 <= r.n <= MAX_N:
        raise invalid(f"n must be an integer in [1, {MAX_N}], got {r.n}", param="n")
    if r.stream_options is not None and not r.stream:
        raise invalid("stream_options is only allowed with stream: true", param="stream_options")


def _finish(r: _Common, ids: list[int], max_tokens: int, served: ServedModel, prompt_param: str,
            name: str = "max_tokens", logprobs: int | None = None) -> ParsedRequest:
    if max_tokens < 1:
        raise invalid(f"{name} must be at least 1, got {max_tokens}", param=name)
    temperature = 1.0 if r.temperature is None else r.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid(f"temperature must be a finite number >= 0, got {temperature}", param="temperature")
    seed = secrets.randbits(63) if r.seed is None else r.seed
    if not -(2**63) <= seed < 2**64:
        raise invalid(f"seed must be a 64-bit integer, got {seed}", param="seed")
    stop = (r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ())
    controls = _controls(r.model_extra or {})
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature), seed=seed,
                            ignore_eos=bool(r.ignore_eos), logprobs=logprobs, **controls)
    try:
        served.generator.validate(ids, params)  # (the vocabulary, the window, the controls: the runtime's checks)
    except RequestError as e:
        message = str(e)
        window = "exceeds the engine's maximum sequence length" in message
        param = next((c for c in controls if message.startswith(c)), None)
        if "sampling controls" in message:
            param = next(iter(controls), "logprobs" if logprobs is not None else None)
        raise invalid(message, param=param or prompt_param,
                      code="context_length_exceeded" if window else None) from None
    include_usage = bool(r.stream_options and r.stream_options.include_usage)
    return ParsedRequest(ids, params, tuple(s for s in stop if s), bool(r.stream), include_usage, r.n or 1)


# ---- text ---------------------------------------------------------------------------------------
class TextStream:
    """One request's text, token by token, cut at its stop strings.

    ``feed(output)`` decodes the tokens not seen yet (``StreamDecoder``: a multi-byte character split
    across tokens comes out whole). With stop strings it decodes them one at a time and looks for the
    stop strings in the text each token adds (with the tail before it, so a stop string spanning
    tokens or steps is found); at the first match the text is cut just before it, ``stopped`` is set
    and ``tokens`` says how many tokens it took. ``take()`` hands out the text not handed out yet,
    holding back a tail that is the start of a stop string until the request finishes.

    ``offsets=True`` (log-probabilities) decodes one token at a time too and keeps, per token, the
    length of the text before it (``offsets``: where its text starts; a token that only begins a
    multi-byte character starts where the character does). ``reportable(final)`` → how many tokens
    are out: those whose text starts before the end of the text handed out; at the end all of them,
    unless a stop string cut the text: then the ones wholly after the cut are never out."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), offsets: bool = False):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = stop
        self.longest = max((len(s) for s in stop), default=0)
        self.text = ""
        self.tokens = 0  # tokens decoded into text (up to the one that completed a stop string)
        self.sent = 0  # characters of text handed out by take()
        self.stopped = False
        self.offsets: list[int] | None = [] if offsets else None

    @property
    def per_token(self) -> bool:
        """Whether tokens are decoded one at a time (stop strings or offsets), as they come."""
        return bool(self.stop) or self.offsets is not None

    def feed(self, output: list[int], final: bool = False) -> None:
        if not self.per_token:  # (nothing to look for: a step's tokens at once, a whole output in one go)
            if final and self.tokens == 0:
                self.text = self.decoder.full(output)
            else:
                self.text += self.decoder.push(output, final=final)
            self.tokens = len(output)
            return
        while self.tokens < len(output) and not self.stopped:
            self.tokens += 1
            if self.offsets is not None:
                self.offsets.append(len(self.text))
            self._add(self.decoder.push(output[:self.tokens]))
        if final and not self.stopped:
            self._add(self.decoder.push(output, final=True))  # (flushes a held-back incomplete character)

    def _add(self, piece: str) -> None:
        if not piece:
            return
        if not self.stop:
            self.text += piece
            return
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def reportable(self, final: bool) -> int:
        """Tokens whose log-probabilities may go out now (after ``take``; needs ``offsets``)."""
        if final and not self.stopped:
            return self.tokens
        return bisect.bisect_left(self.offsets, self.sent)

    def _held_back(self) -> int:
        """The length of the longest tail of the text that a stop string starts with."""
        if not self.stop:
            return 0
        tail = self.text[max(self.sent, len(self.text) - self.longest + 1):]
        for k in range(len(tail), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return k
        return 0


# ---- log-probabilities ----------------------------------------------------------------------------
FLOOR_LOGPROB = -9999.0  # what a token the sampling controls ruled out (log 0) is reported as: JSON has no -inf


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte as a printable character (the printable bytes as
    themselves, the others from U+0100 on, in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # a byte-fallback token (SentencePiece style)


class TokenText:
    """One token's text (its id decoded alone, special tokens shown) and its bytes: a byte-level
    BPE token's or a byte-fallback token's own bytes (a token holding part of a multi-byte character
    has bytes though its text alone is U+FFFD), else its text's UTF-8. Without a tokenizer a token
    is ``token_id:N``."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.byte_level = tokenizer is not None and type(tokenizer.decoder).__name__ == "ByteLevel"
        self.special = set()
        if tokenizer is not None and hasattr(tokenizer, "get_added_tokens_decoder"):
            self.special = set(tokenizer.get_added_tokens_decoder())
        self.get = lru_cache(maxsize=1 << 16)(self._get)

    def _get(self, token: int) -> tuple[str, list[int]]:
        if self.tok is None:
            text = f"token_id:{token}"
            return text, list(text.encode())
        text = self.tok.decode([token], skip_special_tokens=False)
        piece = self.tok.id_to_token(token)
        if piece is not None and token not in self.special:
            m = _BYTE_TOKEN.match(piece)
            if m:
                return text, [int(m[1], 16)]
            if self.byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return text, [_BYTE_OF_CHAR[c] for c in piece]
        return text, list(text.encode("utf-8"))


def _finite(lp: float) -> float:
    return lp if lp > FLOOR_LOGPROB else FLOOR_LOGPROB


def completion_logprobs(entries: list[tuple], tokens: TokenText) -> dict:
    """The legacy completions ``logprobs`` object of ``entries`` (token, logprob, top, text offset):
    ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token {text: logprob} of the top N and the
    token itself; of several tokens with one text, the likelier) and ``text_offset``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp, top, offset in entries:
        text = tokens.get(token)[0]
        alternatives: dict[str, float] = {}
        for t, v in [*top, (token, lp)]:
            alternatives.setdefault(tokens.get(t)[0], _finite(v))
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(lp))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
    return out


def chat_logprobs(entries: list[tuple], tokens: TokenText) -> dict:
    """The chat ``logprobs`` object of ``entries`` (token, logprob, top, text offset): ``content``, one
    {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]} per token."""
    def one(token: int, lp: float) -> dict:
        text, raw = tokens.get(token)
        return {"token": text, "logprob": _finite(lp), "bytes": raw}

    return {"content": [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]}
                        for token, lp, top, _ in entries], "refusal": None}
