"""An OpenAI request body -> the engine's settings, checked field by field: a wrong field is an ApiError (OpenAI's
error object, a 4xx), never a traceback. Fields clients send that this engine has no use for are accepted and
ignored (tools, response_format, user, presence/frequency penalties, ...), as llama-server and vLLM do.

Search: greedy by default (num_beams 1, whatever the folder's translation default); `temperature` > 0 samples;
`use_beam_search` (vLLM's name) runs exact beam search with `best_of` (or `num_beams`, or `n`) beams and returns
`n` of them; `length_penalty` and `early_stopping` as transformers. Speculation never changes the answer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOPS = 4            # OpenAI's limit
MAX_N = 16               # choices a request may ask for
MAX_TOP_LOGPROBS = 20    # OpenAI's limit (chat); completions' logprobs: 5


class ApiError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "invalid_request_error"
                                                                                        if status < 500 else
                                                                                        "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Call:
    """One request's settings, checked: `overrides` are GenerationConfig fields; `max_tokens` None means the rest
    of the context; `samples` the requests to run per prompt (n independent samples), `per_request` the choices
    each returns (beams)."""
    model: str | None
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    n: int = 1
    samples: int = 1
    per_request: int = 1
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    overrides: dict = field(default_factory=dict)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def get(body: dict, name: str, check, what: str, default=None):
    """body[name] when present and not null, checked by `check`; else default."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ApiError(400, f"'{name}' must be {what}, got {value!r:.60}", param=name, code="invalid_type")
    return value


def integer(body, name, low, high=None, default=None):
    what = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
    return get(body, name, lambda v: _is_int(v) and v >= low and (high is None or v <= high), what, default)


def number(body, name, low, high, default=None, low_open=False):
    what = f"a number {'>' if low_open else '>='} {low} and <= {high}"
    return get(body, name, lambda v: _is_number(v) and (v > low if low_open else v >= low) and v <= high, what,
               default)


def boolean(body, name, default=False):
    return get(body, name, lambda v: isinstance(v, bool), "true or false", default)


def stops(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them",
                       param="stop", code="invalid_type")
    return list(dict.fromkeys(stop))


def parse(body, chat: bool) -> Call:
    """The checked settings of a /v1/chat/completions (chat) or /v1/completions body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    model = get(body, "model", lambda v: isinstance(v, str), "a string")
    call = Call(model, stream=boolean(body, "stream"), stop=stops(body))
    options = get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    call.include_usage = boolean(options, "include_usage")
    call.max_tokens = integer(body, "max_completion_tokens", 1, default=integer(body, "max_tokens", 1))
    call.n = integer(body, "n", 1, MAX_N, 1)
    if chat:
        call.logprobs = boolean(body, "logprobs")
        call.top_logprobs = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
        if call.top_logprobs and not call.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        top = integer(body, "logprobs", 0, 5)
        call.logprobs, call.top_logprobs = top is not None, top or 0
    call.overrides = search(body, call)
    return call


def search(body: dict, call: Call) -> dict:
    """GenerationConfig overrides of the body: greedy, beam search (use_beam_search) or sampling (temperature >
    0); n beams returned, or n samples."""
    temperature = number(body, "temperature", 0, 2)
    top_p = number(body, "top_p", 0, 1, low_open=True)
    top_k = integer(body, "top_k", -1)
    seed = integer(body, "seed", 0, 2**63 - 1)
    out: dict = {}
    min_tokens = integer(body, "min_tokens", 0)
    if min_tokens:
        out["min_new_tokens"] = min_tokens
    penalty = number(body, "repetition_penalty", 0, 10, low_open=True)
    if penalty is not None and penalty != 1.0:
        out["repetition_penalty"] = penalty
    num_beams = integer(body, "num_beams", 1, default=1)
    if boolean(body, "use_beam_search") or num_beams > 1:
        beams = max(call.n, integer(body, "best_of", 1, default=1), num_beams)
        out.update(num_beams=beams, num_return_sequences=call.n, do_sample=False,
                   length_penalty=number(body, "length_penalty", -10, 10, default=1.0))
        early = get(body, "early_stopping", lambda v: isinstance(v, bool) or v == "never", "true, false or 'never'")
        if early is not None:
            out["early_stopping"] = early
        call.per_request = call.n
        return out
    if temperature is not None and temperature > 0:
        out.update(num_beams=1, do_sample=True, temperature=temperature)
        if top_p is not None:
            out["top_p"] = top_p
        if top_k is not None and top_k > 0:
            out["top_k"] = top_k
        if seed is not None:
            out["seed"] = seed
        call.samples = call.n          # n independent samples (seeds seed, seed + 1, ...)
        return out
    out.update(num_beams=1, do_sample=False)     # greedy: its n answers are one answer n times
    call.per_request = call.n
    return out
