"""The model's wire protocol: tensor names, request parsing, streamed text.

One table (``INPUTS`` / ``OUTPUTS``) is the single source of the tensor names:
``repo.py`` renders ``config.pbtxt`` from it and the python-backend model reads
requests through it. Names follow NVIDIA's tensorrtllm_backend (``text_input``,
``input_ids``, ``max_tokens``, ``temperature``, ``random_seed``, ``stream``,
``end_id``, ``stop_words``, ``bad_words``, ``runtime_top_k``, ``runtime_top_p``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
``min_tokens`` / ``min_length``, ``return_log_probs``, ``num_return_sequences``;
``text_output``, ``output_ids``, ``output_log_probs``, ``sequence_index``) so its clients and Triton's ``generate`` /
``generate_stream`` endpoints work; ``seed``, ``stop_ids``, ``ignore_eos`` and
``min_p`` are ours. The sampling controls and log-probabilities go to the
runtime's ``SamplingParams`` (the eager engine and aoti engines built with the
controlled step apply them; an engine that cannot refuses the request when
``Generator.add`` validates it).

Footguns handled here rather than in the model:

* Triton's ``generate`` endpoint does **not** enforce required inputs: a
  request without ``max_tokens`` reaches the model. Everything is checked here
  and turned into ``RequestError`` (→ an INVALID_ARG response), never an
  exception that would leave a decoupled request without its final response.
* numpy scalars are not ``int``: values are converted to Python types before
  they reach ``Generator.validate``.
* Triton's ``generate`` endpoint turns JSON fields that name no input into
  request *parameters* and would let the model ignore them (``top_p`` sent to a
  model without it): any parameter outside Triton's own ``triton_*`` is refused.
* It also casts JSON integers to the input's type without a range check
  (``4294967297`` arrives as INT32 ``1``). ``check_generate_json`` refuses such
  a body first; ``muse-spark serve``'s HTTP front calls it before forwarding.
* Streaming text: decoding each step's ids alone splits multi-byte characters.
  ``StreamDecoder`` decodes a small window and holds back a trailing U+FFFD
  until the character completes, so the streamed pieces concatenate to the
  text of the whole output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from muse_spark.runtime.generator import RequestError, SamplingParams


MAX_SEQUENCES = 8  # num_return_sequences at most (the OpenAI server's n too)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton config type, e.g. TYPE_INT32
    dims: tuple[int, ...]  # without the batch dimension (max_batch_size is 1)
    optional: bool = False
    doc: str = ""


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "TYPE_STRING", (1,), True, "prompt text (tokenized with the engine's tokenizer)"),
    TensorSpec("input_ids", "TYPE_INT32", (-1,), True, "prompt token ids (instead of text_input)"),
    TensorSpec("max_tokens", "TYPE_INT32", (1,), False, "number of tokens to generate, >= 1"),
    TensorSpec("temperature", "TYPE_FP32", (1,), True, "0 = greedy (default)"),
    TensorSpec("seed", "TYPE_UINT64", (1,), True, "sampling seed (default 0)"),
    TensorSpec("random_seed", "TYPE_UINT64", (1,), True, "tensorrtllm_backend's name for seed"),
    TensorSpec("stream", "TYPE_BOOL", (1,), True, "one response per speculative step (default false)"),
    TensorSpec("end_id", "TYPE_INT32", (1,), True, "end token; replaces the engine's EOS ids"),
    TensorSpec("stop_ids", "TYPE_INT32", (-1,), True, "extra stop token ids (kept in the output)"),
    TensorSpec("stop_words", "TYPE_STRING", (-1,), True,
               "stop words: the output ends with the first one's tokens (kept, as a stop token is)"),
    TensorSpec("bad_words", "TYPE_STRING", (-1,), True, "accepted for compatibility; must be empty"),
    TensorSpec("ignore_eos", "TYPE_BOOL", (1,), True, "do not stop at the engine's EOS ids"),
    # sampling controls (SamplingParams): left out, they change nothing
    TensorSpec("runtime_top_k", "TYPE_INT32", (1,), True, "keep the k most likely tokens (0: all)"),
    TensorSpec("runtime_top_p", "TYPE_FP32", (1,), True, "keep the most likely tokens up to this mass, (0, 1]"),
    TensorSpec("min_p", "TYPE_FP32", (1,), True, "drop tokens below min_p × the most likely one's probability"),
    TensorSpec("repetition_penalty", "TYPE_FP32", (1,), True, "prompt and output tokens: z/r where z > 0, else z·r"),
    TensorSpec("presence_penalty", "TYPE_FP32", (1,), True, "output tokens: − p once a token is out"),
    TensorSpec("frequency_penalty", "TYPE_FP32", (1,), True, "output tokens: − f × its count"),
    TensorSpec("min_tokens", "TYPE_INT32", (1,), True, "stop tokens are held back until this many are out"),
    TensorSpec("min_length", "TYPE_INT32", (1,), True, "tensorrtllm_backend's name for min_tokens"),
    TensorSpec("return_log_probs", "TYPE_BOOL", (1,), True, "output output_log_probs (default false)"),
    TensorSpec("num_return_sequences", "TYPE_INT32", (1,), True,
               f"independent samples of the prompt (seeds seed, seed+1, …), 1 … {MAX_SEQUENCES}; each its own "
               "responses, told apart by sequence_index (default 1)"),
)

OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "TYPE_STRING", (1,), doc="generated text (the step's new text when streaming)"),
    TensorSpec("output_ids", "TYPE_INT32", (-1,), doc="generated ids (the step's new ids when streaming)"),
    TensorSpec("finish_reason", "TYPE_STRING", (1,),
               doc="'stop' | 'length' | 'shutdown' on the final response, else ''"),
    TensorSpec("num_steps", "TYPE_INT32", (1,), doc="speculative steps so far"),
    TensorSpec("accepted_draft_tokens", "TYPE_INT32", (1,), doc="draft tokens accepted so far"),
    TensorSpec("mean_accepted_per_step", "TYPE_FP32", (1,), doc="accepted draft tokens per step"),
    TensorSpec("mean_verified_per_step", "TYPE_FP32", (1,),
               doc="draft tokens sent to the target per step (γ unless a confidence schedule verifies fewer)"),
    TensorSpec("acceptance_per_position", "TYPE_FP32", (-1,), doc="[γ] acceptance rate of each draft position"),
    TensorSpec("sequence_index", "TYPE_INT32", (1,),
               doc="which of the request's num_return_sequences samples the response belongs to (from 0)"),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1,),
               doc="with return_log_probs: each output token's log-probability (the step's new ones when "
                   "streaming); absent otherwise"),
)

@dataclass(frozen=True)
class ParsedRequest:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    n: int = 1  # num_return_sequences

    def sequence_params(self, i: int) -> SamplingParams:
        """Sequence ``i``'s parameters: the request's, with seed + i (modulo 2⁶⁴, as the runtime stores seeds)."""
        if i == 0:
            return self.params
        return SamplingParams(**{**self.params.__dict__, "seed": (self.params.seed + i) % 2**64})


# ---- request parsing ------------------------------------------------------------------------
def _scalar(name: str, arr: np.ndarray):
    if arr.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _int_list(name: str, arr: np.ndarray) -> list[int]:
    if arr.dtype.kind not in "iu":
        raise RequestError(f"{name} must be integers, got {arr.dtype}")
    return [int(x) for x in arr.reshape(-1)]


def _strings(arr: np.ndarray) -> list[str]:
    out = []
    for x in arr.reshape(-1):
        if isinstance(x, bytes):
            try:
                x = x.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(f"text is not valid UTF-8: {e}") from None
        out.append(str(x))
    return out


def check_parameters(parameters: str | dict | None) -> None:
    """Refuse request parameters this model does not have (all but Triton's own ``triton_*``)."""
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters or "{}")
        except json.JSONDecodeError:
            raise RequestError(f"the request parameters are not valid JSON: {parameters[:80]!r}") from None
    unknown = sorted(k for k in (parameters or {}) if not k.startswith("triton_"))
    if unknown:
        known = ", ".join(s.name for s in INPUTS)
        raise RequestError(f"unknown request field{'s' * (len(unknown) > 1)} {', '.join(unknown)}; this model "
                           f"takes {known}")


_INT_RANGES = {"TYPE_INT32": (-(2**31), 2**31 - 1), "TYPE_UINT64": (0, 2**64 - 1)}


def check_generate_json(body: bytes) -> str | None:
    """The error of a ``generate`` JSON body whose integers do not fit their input's type, else None.

    (Bodies that are not JSON objects are left to Triton, which answers them itself.)"""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    for spec in INPUTS:
        bounds = _INT_RANGES.get(spec.dtype)
        if bounds is None or spec.name not in payload:
            continue
        stack = [payload[spec.name]]
        while stack:
            v = stack.pop()
            if isinstance(v, list):
                stack.extend(v)
            elif isinstance(v, int) and not isinstance(v, bool) and not bounds[0] <= v <= bounds[1]:
                return (f"{spec.name} value {v} does not fit its type {spec.dtype[5:]} "
                        f"[{bounds[0]}, {bounds[1]}]")
    return None


def parse_request(get: Callable[[str], np.ndarray | None], tokenizer, parameters=None) -> ParsedRequest:
    """Build the prompt and sampling parameters of one request.

    ``get(name)`` returns the input tensor as a numpy array, or None when the
    request lacks it; ``parameters`` are the request's parameters (a dict or
    Triton's JSON string). Raises ``RequestError`` with a client-facing
    message. The limits that need the engine (vocabulary, sequence length) are
    checked by ``Generator.add``.
    """
    check_parameters(parameters)
    text, ids = get("text_input"), get("input_ids")
    if text is not None and ids is not None:
        raise RequestError("give either text_input or input_ids, not both")
    if text is None and ids is None:
        raise RequestError("the request has no prompt: send text_input (text) or input_ids (token ids)")
    if ids is not None:
        prompt = _int_list("input_ids", ids)
    else:
        if tokenizer is None:
            raise RequestError("this engine has no tokenizer: send input_ids instead of text_input")
        (prompt_text,) = _strings(np.asarray([_scalar("text_input", text)], dtype=object))
        prompt = tokenizer.encode(prompt_text).ids
    if not prompt:
        raise RequestError("the prompt is empty")

    max_tokens = get("max_tokens")
    if max_tokens is None:
        raise RequestError("max_tokens is required")
    max_tokens = _scalar("max_tokens", max_tokens)
    if not isinstance(max_tokens, (np.integer, int)):
        raise RequestError(f"max_tokens must be an integer, got {max_tokens!r}")

    temperature = get("temperature")
    temperature = 0.0 if temperature is None else float(_scalar("temperature", temperature))

    seed, rseed = get("seed"), get("random_seed")
    seed = None if seed is None else int(_scalar("seed", seed))
    rseed = None if rseed is None else int(_scalar("random_seed", rseed))
    if seed is not None and rseed is not None and seed != rseed:
        raise RequestError(f"seed ({seed}) and random_seed ({rseed}) disagree; send one of them")
    seed = seed if seed is not None else (rseed if rseed is not None else 0)

    stream = get("stream")
    stream = False if stream is None else bool(_scalar("stream", stream))
    ignore_eos = get("ignore_eos")
    ignore_eos = False if ignore_eos is None else bool(_scalar("ignore_eos", ignore_eos))

    stop: list[int] = []
    sequences: tuple[tuple[int, ...], ...] = ()
    end_id = get("end_id")
    if end_id is not None:
        stop.append(int(_scalar("end_id", end_id)))
        ignore_eos = True  # end_id replaces the engine's EOS, as in tensorrtllm_backend
    if get("stop_ids") is not None:
        stop += _int_list("stop_ids", get("stop_ids"))
    if get("stop_words") is not None:
        single, sequences = _stop_words(_strings(get("stop_words")), tokenizer)
        stop += single
    if get("bad_words") is not None and any(_strings(get("bad_words"))):
        raise RequestError("bad_words is not supported by this model (send an empty string or leave it out)")

    n = get("num_return_sequences")
    if n is not None:
        n = _scalar("num_return_sequences", n)
        if not isinstance(n, (np.integer, int)) or not 1 <= int(n) <= MAX_SEQUENCES:
            raise RequestError(f"num_return_sequences must be an integer in [1, {MAX_SEQUENCES}], got {n!r}")
    params = SamplingParams(max_tokens=int(max_tokens), temperature=temperature, seed=seed,
                            stop_token_ids=tuple(stop), ignore_eos=ignore_eos, stop_sequences=sequences,
                            **_controls(get))
    return ParsedRequest(prompt, params, stream, 1 if n is None else int(n))


# input → (SamplingParams field, Python type); the runtime checks the values (Generator.validate)
_CONTROLS = {"runtime_top_k": ("top_k", int), "runtime_top_p": ("top_p", float), "min_p": ("min_p", float),
             "repetition_penalty": ("repetition_penalty", float), "presence_penalty": ("presence_penalty", float),
             "frequency_penalty": ("frequency_penalty", float), "min_tokens": ("min_tokens", int)}


def _controls(get: Callable[[str], np.ndarray | None]) -> dict:
    """The sampling controls and log-probabilities a request sets, as ``SamplingParams`` fields."""
    out = {}
    for name, (field, kind) in _CONTROLS.items():
        arr = get(name)
        if arr is not None:
            value = _scalar(name, arr)
            if kind is int and not isinstance(value, (np.integer, int)):
                raise RequestError(f"{name} must be an integer, got {value!r}")
            out[field] = kind(value)
    min_length = get("min_length")
    if min_length is not None:
        value = _scalar("min_length", min_length)
        if not isinstance(value, (np.integer, int)):
            raise RequestError(f"min_length must be an integer, got {value!r}")
        if "min_tokens" in out and out["min_tokens"] != int(value):
            raise RequestError(f"min_tokens ({out['min_tokens']}) and min_length ({int(value)}) disagree; "
                               f"send one of them")
        out["min_tokens"] = int(value)
    wanted = get("return_log_probs")
    if wanted is not None and bool(_scalar("return_log_probs", wanted)):
        out["logprobs"] = 0  # (each token's own log-probability; no alternatives)
    return out


def _stop_words(words: list[str], tokenizer) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
    """Stop words → (the one-token words' ids: stop tokens; the longer words' token sequences), each
    word tokenized alone, as tensorrtllm_backend matches them (on the output's tokens)."""
    words = [w for w in words if w]
    if words and tokenizer is None:
        raise RequestError("this engine has no tokenizer: send stop_ids instead of stop_words")
    single, sequences = [], []
    for w in words:
        ids = tokenizer.encode(w, add_special_tokens=False).ids
        if not ids:
            raise RequestError(f"stop word {w!r} has no tokens")
        if len(ids) == 1:
            single.append(ids[0])
        else:
            sequences.append(tuple(ids))
    return single, tuple(sequences)


# ---- responses ------------------------------------------------------------------------------
def response_arrays(ids: list[int], text: str, finish_reason: str | None, stats: dict,
                    log_probs: list[float] | None = None, sequence_index: int = 0) -> dict[str, np.ndarray]:
    """The output tensors of one response, each with the batch dimension 1 (``output_log_probs``
    only with ``log_probs``)."""
    extra = {} if log_probs is None else {
        "output_log_probs": np.array(log_probs, dtype=np.float32).reshape(1, len(log_probs))}
    return {
        "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
        "output_ids": np.array([ids], dtype=np.int32).reshape(1, len(ids)),
        "finish_reason": np.array([[(finish_reason or "").encode()]], dtype=np.object_),
        "num_steps": np.array([[stats["steps"]]], dtype=np.int32),
        "accepted_draft_tokens": np.array([[stats["accepted_draft_tokens"]]], dtype=np.int32),
        "mean_accepted_per_step": np.array([[stats["mean_accepted_per_step"]]], dtype=np.float32),
        "mean_verified_per_step": np.array([[stats["mean_verified_per_step"]]], dtype=np.float32),
        "acceptance_per_position": np.array([stats["acceptance_per_position"]], dtype=np.float32),
        "sequence_index": np.array([[sequence_index]], dtype=np.int32),
        **extra,
    }


class StreamDecoder:
    """Incremental detokenization: ``push(all ids so far)`` → the new text.

    Decodes only a window ``ids[prefix:]`` (the last emitted piece is kept as
    context so tokenizers that merge across the boundary still agree) and holds
    back text ending in U+FFFD — an incomplete UTF-8 character — until more ids
    arrive or the request finishes (``final=True`` flushes everything).
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.prefix = 0  # start of the decode window
        self.read = 0  # ids before this are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return "".join(f"{t} " for t in ids)
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int], final: bool = False) -> str:
        if len(ids) <= self.read and not final:
            return ""
        seen = self._decode(ids[self.prefix:self.read])
        text = self._decode(ids[self.prefix:])
        if not final and (len(text) <= len(seen) or text.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(ids)
        return text[len(seen):]

    def full(self, ids: list[int]) -> str:
        return self._decode(ids)
