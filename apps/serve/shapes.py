"""OpenAI's response shapes (chat.completion, text_completion, their stream chunks, usage, logprobs) and the
engine's own figures beside them (`timings`, as llama-server names its own)."""
from __future__ import annotations

import json

from specbeam_edge.results import Stats


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def usage(run) -> dict:
    prompt = sum(g.prompt_tokens for g in run.groups)
    completion = sum(len(t) for g in run.groups for t in g.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def timings(stats: Stats, completion_tokens: int, seconds: float) -> dict:
    """The engine's figures for a response: llama-server's names where it has them, then ours (target passes,
    beam steps a pass: tokens a pass for greedy search, draft passes and what the draft covered)."""
    return {"prompt_n": stats.prompt_tokens, "predicted_n": completion_tokens,
            "predicted_ms": round(seconds * 1000, 1),
            "predicted_per_second": round(completion_tokens / seconds, 2) if seconds > 0 else 0.0,
            "time_to_first_token_ms": round((stats.time_to_first_token or 0.0) * 1000, 1),
            "target_passes": stats.target_passes, "steps_per_pass": round(stats.beam_steps_per_pass, 3),
            "draft_passes": stats.draft_passes, "steps_from_draft": sum(stats.from_draft),
            "draft_tokens_proposed": stats.draft_tokens_proposed}


def token_entry(tokenizer, token: int, logprob: float) -> dict:
    text = tokenizer.decode([token], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, tokens: list[int], rows: list) -> dict | None:
    """OpenAI chat's logprobs object: per token, its log-prob and the top alternatives."""
    if not rows:
        return None
    return {"content": [dict(token_entry(tokenizer, t, lp), top_logprobs=[token_entry(tokenizer, a, alp)
                                                                          for a, alp in top])
                        for t, (lp, top) in zip(tokens, rows)], "refusal": None}


def completion_logprobs(tokenizer, tokens: list[int], rows: list) -> dict | None:
    """The legacy completions' logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    if not rows:
        return None
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [lp for lp, _ in rows],
            "top_logprobs": [{tokenizer.decode([a], skip_special_tokens=False): alp for a, alp in top}
                             for _, top in rows], "text_offset": offsets}


def head(run, chat: bool, chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": ("chatcmpl-" if chat else "cmpl-") + run.id, "object": kind, "created": run.created,
            "model": run.served.name, "system_fingerprint": "specbeam-edge"}


def choice(chat: bool, index: int, text: str, reason: str | None, logprobs) -> dict:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def delta(chat: bool, index: int, text: str | None = None, reason: str | None = None, logprobs=None,
          role: bool = False) -> dict:
    if chat:
        d = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
