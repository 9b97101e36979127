"""A chat template from a model folder rendered as transformers renders it (jinja2's immutable sandbox, its
filters and globals), within limits: a template is code, so a render runs in a thread of its own under
RENDER_SECONDS and RENDER_CHARS, and every failure is one line (ChatTemplateError) naming the template."""
from __future__ import annotations

import functools
import json
import re
import threading
from datetime import datetime

from ..config import ModelFolderError


class ChatTemplateError(ModelFolderError):
    """A model folder's chat template that failed to render (an error it raises, a sandbox refusal, a render
    over its time or output limit); the message is one line naming the template."""


# A chat template renders within these limits (a template is code from the model folder: a nested loop spins, a
# string multiplied by 10**8 aborts the process in the tokenizer): seconds, and characters of output or of any one
# value it builds. A real template renders in milliseconds, and its output must fit the context.
RENDER_SECONDS = 5.0
RENDER_CHARS = 4_000_000


class _RenderTimeout(BaseException):
    """Raised inside a render thread that ran past RENDER_SECONDS (a BaseException: a template cannot catch it)."""


def render(template, where: str, variables: dict) -> str:
    """template.render(variables) within RENDER_SECONDS and RENDER_CHARS of output; any error as one line
    (ChatTemplateError naming the template). The render runs in a thread of its own that is stopped (an
    exception raised in it) when the time is up: a template's loops are Python code, and jinja2 has no limit."""
    import ctypes

    out: dict = {}

    def run():
        try:
            parts, n = [], 0
            for piece in template.generate(**variables):
                n += len(piece)
                if n > RENDER_CHARS:
                    raise _TooLong(f"its output passed {RENDER_CHARS:,} characters")
                parts.append(piece)
            out["text"] = "".join(parts)
        except BaseException as e:        # noqa: BLE001 -- handed to the caller
            out["error"] = e

    worker = threading.Thread(target=run, name="chat-template", daemon=True)
    worker.start()
    worker.join(RENDER_SECONDS)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(_RenderTimeout))
        worker.join(1.0)
        raise ChatTemplateError(f"{where} did not finish rendering within {RENDER_SECONDS:g} s (a loop that does "
                                f"not end?); fix the template or put the model's own back")
    e = out.get("error")
    if e is None:
        return out["text"]
    if isinstance(e, _TooLong):
        raise ChatTemplateError(f"{where} was stopped: {e}; fix the template or put the model's own back") from None
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise e
    message = " ".join(str(e).split()) or "no message"
    if len(message) > 300:
        message = message[:300] + "..."
    raise ChatTemplateError(f"{where} failed: {message} ({type(e).__name__}); the messages may not be what it "
                            f"accepts (e.g. roles that must alternate), or fix the template") from None


class _TooLong(Exception):
    """A value or output of a chat template over RENDER_CHARS."""


_BIG_NUMBER = re.compile(r"\d{7,}")


def _check_size(value) -> None:
    """An int a template passes to a call (a width, a count) that would build a value over RENDER_CHARS."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > RENDER_CHARS:
        raise _TooLong(f"it asked for a value of {value:,} (more than {RENDER_CHARS:,})")


def _limited_environment():
    """jinja2's immutable sandbox (as transformers uses) that also refuses values over RENDER_CHARS: `*` and `%`
    on strings and lists, `**`, and calls or filters given a huge width or count."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Limited(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, (str, list, tuple)) and isinstance(b, int) and len(a) * b > RENDER_CHARS:
                        raise _TooLong(f"it builds a value of {len(a) * b:,} items (more than {RENDER_CHARS:,})")
            elif operator == "**":
                if isinstance(left, (int, float)) and isinstance(right, (int, float)) and \
                        abs(right) > 64 and abs(left) > 1:
                    raise _TooLong(f"it raises a number to the power {right}")
            elif operator == "%" and isinstance(left, str):
                if _BIG_NUMBER.search(left):
                    raise _TooLong("its % format has a width over the limit")
                for a in (right if isinstance(right, tuple) else (right,)):
                    _check_size(a)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):      # noqa: N805 (jinja2's signature)
            for a in (*args, *kwargs.values()):
                _check_size(a)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is not None and _BIG_NUMBER.search(value.__self__):
                raise _TooLong("its format string has a width over the limit")
            return wrapped

    env = Limited(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    for name, f in list(env.filters.items()):
        env.filters[name] = _sized_filter(f)
    return env


def _sized_filter(f):
    @functools.wraps(f)       # keeps jinja2's pass_context/pass_environment marks
    def checked(*args, **kwargs):
        skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1     # (context,) value, then its arguments
        for a in (*args[skip:], *kwargs.values()):
            _check_size(a)
        return f(*args, **kwargs)
    return checked


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    import jinja2

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = _limited_environment()
    env.filters["tojson"] = _sized_filter(tojson)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFolderError(f"chat template: jinja2 syntax error at line {e.lineno} ({e.message})") from None
