"""LibreTranslate's API on a translation model: POST /translate (q a text or a list, source, target, format
text/html, alternatives, api_key in the body) and GET /languages, as browser extensions and document tools call
it; `glossary` (an extra field: {"source term": "target term" or [forms]}) makes terms appear as the translate
tool's --glossary does (constrained beam search), and format html keeps the tags (its --keep_markup)."""
from __future__ import annotations


from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from specbeam_edge.text.markup import find_spans, markup_constraints
from specbeam_edge.online import Done, Failed

from .complete import Bridge, follow
from .params import ApiError, integer

# LibreTranslate's two-letter codes -> NLLB's codes (M2M100 uses the two-letter codes themselves)
NLLB = {"ar": "arb_Arab", "bg": "bul_Cyrl", "ca": "cat_Latn", "cs": "ces_Latn", "da": "dan_Latn", "de": "deu_Latn",
        "el": "ell_Grek", "en": "eng_Latn", "es": "spa_Latn", "et": "est_Latn", "fi": "fin_Latn", "fr": "fra_Latn",
        "he": "heb_Hebr", "hi": "hin_Deva", "hu": "hun_Latn", "id": "ind_Latn", "it": "ita_Latn", "ja": "jpn_Jpan",
        "ko": "kor_Hang", "lt": "lit_Latn", "lv": "lvs_Latn", "nl": "nld_Latn", "pl": "pol_Latn", "pt": "por_Latn",
        "ro": "ron_Latn", "ru": "rus_Cyrl", "sk": "slk_Latn", "sl": "slv_Latn", "sv": "swe_Latn", "tr": "tur_Latn",
        "uk": "ukr_Cyrl", "zh": "zho_Hans"}
MAX_TEXTS = 128


def translation_model(server, name: str | None):
    reg = server.registry
    if name is not None:
        return reg.get(name)
    reg.get(None)                       # 503 while loading
    for m in reg.models.values():
        if m.translation:
            return m
    raise ApiError(400, f"this server holds no translation model ({', '.join(reg.models)} are chat models); "
                        f"start it with --model on a translation folder")


def code(served, value, field: str) -> str | None:
    """A language code as the model takes it (None for a model with one fixed pair, which takes any)."""
    codes = served.engine.encoder.language_codes if served.engine.encoder is not None else {}
    if not codes:
        return None
    if not isinstance(value, str) or not value or value == "auto":
        raise ApiError(400, f"'{field}' must name a language of this model (auto-detection is not supported): "
                            f"one of {', '.join(sorted(codes))}", param=field)
    for candidate in (value, NLLB.get(value), f"__{value}__"):
        if candidate in codes:
            return candidate
    raise ApiError(400, f"'{field}' {value!r} is not a language of this model; it has "
                        f"{', '.join(sorted(codes))}", param=field)


def glossary_terms(body) -> list[tuple[str, tuple[str, ...]]]:
    g = body.get("glossary")
    if g is None:
        return []
    if not isinstance(g, dict) or not all(isinstance(k, str) and k and (isinstance(v, str) and v or isinstance(
            v, list) and v and all(isinstance(x, str) and x for x in v)) for k, v in g.items()):
        raise ApiError(400, "'glossary' must be an object {\"source term\": \"target term\" or [forms]}",
                       param="glossary")
    return [(k, tuple([v] if isinstance(v, str) else v)) for k, v in g.items()]


def prepare(served, texts: list[str], body: dict) -> list:
    from specbeam_apps.translate.job import glossary_constraints

    engine = served.engine
    alternatives = integer(body, "alternatives", 0, 8, 0)
    html = body.get("format", "text")
    if html not in ("text", "html"):
        raise ApiError(400, "'format' must be 'text' or 'html'", param="format")
    src, tgt = code(served, body.get("source"), "source"), code(served, body.get("target"), "target")
    terms = glossary_terms(body)
    beams = max(engine.generation_config().num_beams, alternatives + 1, 2 if terms or html == "html" else 1)
    out = []
    for i, text in enumerate(texts):
        constraints = list(glossary_constraints(terms, [text], "insensitive")[0] or []) if terms else []
        if html == "html":
            constraints += markup_constraints(find_spans(text))
        lang = {"src_lang": src, "tgt_lang": tgt} if src else {}
        try:
            out.append(engine.request(text, num_beams=beams, num_return_sequences=alternatives + 1,
                                      constraints=constraints or None, speculative=served.speculative(
                                          {"num_beams": beams}), **lang))
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"q[{i}]: {e}" if len(texts) > 1 else f"q: {e}", param="q") from None
    return out


async def translate(request: Request):
    server = request.app.state.server
    body = await server.body(request)
    server.authorize(request, body.get("api_key"))
    q = body.get("q")
    texts = [q] if isinstance(q, str) else q
    if not isinstance(texts, list) or not texts or len(texts) > MAX_TEXTS or \
            not all(isinstance(t, str) and t.strip() for t in texts):
        raise ApiError(400, f"'q' must be a non-empty text or a list of at most {MAX_TEXTS} of them", param="q")
    served = translation_model(server, body.get("model"))
    prepared = await run_in_threadpool(prepare, served, texts, body)
    results = await _run(served, prepared, request)
    if results is None:
        return JSONResponse({}, status_code=499)
    best = [r.hypotheses[0].text for r in results]
    alts = [[h.text for h in r.hypotheses[1:]] for r in results]
    out = {"translatedText": best[0] if isinstance(q, str) else best}
    if integer(body, "alternatives", 0, 8, 0):
        out["alternatives"] = alts[0] if isinstance(q, str) else alts
    return JSONResponse(out)


async def _run(served, prepared: list, request: Request):
    """The texts' requests in the model's batcher, together; None when the client went away."""
    bridge, results, pending = Bridge(served.batcher, prepared), [None] * len(prepared), [len(prepared)]
    bridge.submit()

    async def step(timeout):
        i, ev = await bridge.next(timeout)
        if isinstance(ev, Failed):
            bridge.cancel()
            raise ev.error
        if isinstance(ev, Done):
            results[i], pending[0] = ev.result, pending[0] - 1
    if not await follow(request, step, lambda: not pending[0]):
        bridge.cancel()
        return None
    return results


async def languages(request: Request):
    server = request.app.state.server
    server.authorize(request)
    served = translation_model(server, request.query_params.get("model"))
    codes = sorted(served.engine.encoder.language_codes) if served.engine.encoder is not None else []
    return JSONResponse([{"code": c, "name": c, "targets": codes} for c in codes])


__all__ = ["languages", "translate"]
