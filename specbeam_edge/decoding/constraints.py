"""Lexically constrained beam search with dynamic beam allocation (Post & Vilar 2018; DESIGN "Terminology
constraints"): every finished hypothesis contains each constraint (one of its alternative token phrases).

A hypothesis's constraint state is a function of its generated tokens alone (which constraints appeared as
contiguous phrases, and the phrase prefixes its last tokens form), so the replay of a speculative pass computes
exactly the states plain search computes, and speculative constrained search is token-identical to plain
constrained search (the step is a deterministic function of the beams' log-probs and these states).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .beam import NEG, BeamRows, BeamSearch, _top
from ..text.markup import find_span_matches


@dataclass(frozen=True)
class State:
    """counts: how often each constraint appeared; met: a bit per constraint that appeared as often as it must;
    partial: (constraint, alternative, tokens matched) for every phrase prefix the hypothesis's last tokens form
    (of constraints not met yet, and of met ones that must not appear again)."""
    counts: tuple = ()
    met: int = 0
    partial: tuple = ()
    tokens: tuple = ()           # the generated tokens, kept only when a constraint is matched on the text
    progress: tuple = ()         # per text constraint: the characters of it the text ends with (0: none)
    invented: bool = False       # the text holds a span that is no constraint (Constraints.forbid)


class Constraints:
    """One request's constraints: each a list of alternative phrases (token-id lists), met by any one of them.

    need[c]: how many times constraint c must appear (1 unless the source holds a span several times); exact[c]:
    it may not appear more often (a copied span: once per occurrence in the source); after[c]: another
    constraint it may not appear more often than (a closing tag after its opening tag): a candidate that breaks
    one of these is not taken, a function of its state like everything else. text[c]: match constraint c on the
    decoded output text instead of on tokens (a copied span such as '<b>' may be written with tokens that also
    hold a neighbouring character, e.g. '>%'); its phrases are then the token forms the search proposes, and
    decode(token ids) -> text is needed."""

    def __init__(self, constraints: list[list[list[int]]], need=None, exact=None, after=None, text=None,
                 decode=None, encode=None, forbid=None):
        self.phrases = [[tuple(int(t) for t in alt) for alt in c] for c in constraints]
        if (not self.phrases and forbid is None) or any(not c or any(not alt for alt in c) for c in self.phrases):
            raise ValueError("a constraint needs at least one non-empty phrase")
        n = len(self.phrases)
        self.need = list(need) if need is not None else [1] * n
        self.exact = list(exact) if exact is not None else [False] * n
        self.after = list(after) if after is not None else [None] * n
        self.text = list(text) if text is not None else [None] * n
        self.decode, self.encode = decode, encode
        self.forbid = forbid          # text -> True when it holds a span the source lacks (markup)
        self._rests: dict[tuple[int, int], tuple[int, ...]] = {}
        if decode is None and (forbid is not None or any(t is not None for t in self.text)):
            raise TypeError("constraints on the text need a tokenizer (decode)")
        self.on_text = [ci for ci, t in enumerate(self.text) if t is not None]
        # how the beam is shared: "banks" (dynamic beam allocation) when a constraint is a term the model may not
        # write unasked; "reserve" (one place for the most advanced candidate, the rest as plain beam search)
        # when all are copied spans, which the model mostly writes anyway (measured: docs/HISTORY.md)
        self.allocation = "reserve" if len(self.on_text) == n else "banks"
        self.all_met = (1 << n) - 1
        # a constraint's weight in the banks: its shortest alternative's length (the tokens it takes at least)
        self.units = [min(len(alt) for alt in c) for c in self.phrases]
        self.total_units = sum(u * k for u, k in zip(self.units, self.need))
        self.starts: dict[int, list[tuple[int, int]]] = {}    # first token -> (constraint, alternative)
        for ci, c in enumerate(self.phrases):
            if self.text[ci] is None:
                for ai, alt in enumerate(c):
                    self.starts.setdefault(alt[0], []).append((ci, ai))
        self.start = State(counts=(0,) * n)

    def _tracked(self, ci: int, counts) -> bool:
        return counts[ci] < self.need[ci] or self.exact[ci]

    def advance(self, s: State, tok: int) -> State:
        counts, partial, done = list(s.counts), [], set()
        for ci, ai, k in s.partial:
            if self.phrases[ci][ai][k] == tok:
                if k + 1 == len(self.phrases[ci][ai]):
                    done.add(ci)
                else:
                    partial.append((ci, ai, k + 1))
        for ci, ai in self.starts.get(tok, ()):
            if self._tracked(ci, counts):
                if len(self.phrases[ci][ai]) == 1:
                    done.add(ci)
                else:
                    partial.append((ci, ai, 1))
        for ci in done:                       # one occurrence per token, whichever alternatives completed
            counts[ci] += 1
        tokens, progress, invented = (), (), False
        if self.on_text or self.forbid is not None:     # occurrences in the decoded text (spans do not overlap)
            tokens = s.tokens + (tok,)
            text = self.decode(list(tokens))
            for ci in self.on_text:
                counts[ci] = text.count(self.text[ci])
            progress = tuple(next((k for k in range(len(self.text[ci]) - 1, 0, -1)
                                   if text.endswith(self.text[ci][:k])), 0) for ci in self.on_text)
            invented = self.forbid is not None and self.forbid(text)
        met = sum(1 << ci for ci, c in enumerate(counts) if c >= self.need[ci])
        return State(tuple(counts), met, tuple(sorted(p for p in set(partial) if self._tracked(p[0], counts))),
                     tokens, progress, invented)

    def text_rests(self, s: State) -> list[tuple[int, ...]]:
        """Token forms of what is left of each unmet text constraint the output has begun (its characters after
        the progress), for the search's candidates and proposals."""
        out = []
        for j, ci in enumerate(self.on_text):
            k = s.progress[j] if s.progress else 0
            if k and self.open(s, ci) and self.encode is not None:
                if (ci, k) not in self._rests:
                    self._rests[(ci, k)] = tuple(self.encode(self.text[ci][k:]))
                if self._rests[(ci, k)]:
                    out.append(self._rests[(ci, k)])
        return out

    def open(self, s: State, ci: int) -> bool:
        """Constraint ci still has to appear and may appear now (its prerequisite appeared more often)."""
        return s.counts[ci] < self.need[ci] and (self.after[ci] is None or s.counts[ci] < s.counts[self.after[ci]])

    def violates(self, s: State) -> bool:
        """A constraint appeared more often than it may (exact), or more often than its prerequisite, or the text
        holds a span that is none of the constraints (forbid)."""
        return s.invented or any((self.exact[ci] and c > self.need[ci]) or
                   (self.after[ci] is not None and c > s.counts[self.after[ci]]) for ci, c in enumerate(s.counts))

    def bank(self, s: State) -> int:
        """Constraint tokens produced: each required appearance counts its units, a phrase in progress its
        matched tokens (at most units - 1)."""
        progress = [0] * len(self.phrases)
        for ci, _, k in s.partial:
            if self.open(s, ci):
                progress[ci] = max(progress[ci], min(k, self.units[ci] - 1))
        for j, ci in enumerate(self.on_text):        # a text one: its share of characters, in its units
            if s.progress and self.open(s, ci):
                progress[ci] = min(self.units[ci] - 1, s.progress[j] * self.units[ci] // len(self.text[ci]))
        return sum(min(c, k) * u + p for c, k, u, p in zip(s.counts, self.need, self.units, progress))

    def next_tokens(self, s: State) -> list[int]:
        """Tokens that extend a phrase in progress or start an unmet constraint (a text one: its token forms), in
        a fixed order."""
        out = [self.phrases[ci][ai][k] for ci, ai, k in s.partial if self.open(s, ci)]
        out += [alt[0] for ci in self.unmet(s) if self.open(s, ci) for alt in self.phrases[ci]]
        out += [rest[0] for rest in self.text_rests(s)]
        return list(dict.fromkeys(out))

    def unmet(self, s: State) -> list[int]:
        return [ci for ci in range(len(self.phrases)) if s.counts[ci] < self.need[ci]]


class ConstrainedBeamSearch(BeamSearch):
    """BeamSearch whose step allocates the beam over banks of constraint progress (dynamic beam allocation).

    Per step, the candidates are the 2K best continuations of all beams (as in plain beam search), plus, for each
    live beam, every token that extends one of its phrases in progress or starts an unmet constraint, and its
    single best token. EOS is banned on a beam until it has met every constraint (at the length limit a
    hypothesis finishes whatever it met, ranked after every one that met all). The next K beams are taken from
    the banks in turn (most constraint tokens first, each bank's best first), so hypotheses that made progress on
    the constraints keep places in the beam although their score is lower (`allocation` "reserve": only the most
    advanced candidate goes first, then plain beam search's order). A candidate that stops finishes when it ranks
    among the first K of that order and has met every constraint (transformers' finishing rule, ranked so)."""

    def __init__(self, *args, constraints: Constraints, min_finished: int = 1, **kw):
        super().__init__(*args, **kw)
        self.min_finished = min(min_finished, self.num_beams)
        if self.num_beams < 2:
            raise ValueError("constraints need beam search: num_beams >= 2 (4 or more is better: the beam is "
                             "shared by the banks of constraint progress)")
        self.constraints = constraints
        self.states = {self.running[0]: constraints.start}
        self.fin_met = np.zeros(self.num_beams, bool)

    def proposals(self) -> list[int]:
        """Below each running beam, the rest of every phrase in progress and every unmet constraint's phrases, as
        chains (within the length limit): the steps that take a constraint token are then scored in the same
        pass as the draft's tree (a draft model knows nothing of the constraints)."""
        C, room, out = self.constraints, self.max_length - self.cur_len, []
        for n in dict.fromkeys(self.running):
            s = self.states[n]
            unmet = [ci for ci in C.unmet(s) if C.open(s, ci)]
            rests = [C.phrases[ci][ai][k:] for ci, ai, k in s.partial if ci in unmet]
            rests += [alt for ci in unmet for alt in C.phrases[ci]] + C.text_rests(s)
            for rest in rests:
                node = n
                for t in rest[:room]:
                    node = self._add(node, t)
                    out.append(node)
        return list(dict.fromkeys(out))

    def _add(self, node: int, tok: int, state: State | None = None) -> int:
        """The tree's child of node for tok, with its constraint state (given, or computed once)."""
        child = self.tree.add(node, tok)
        if child not in self.states:
            self.states[child] = state if state is not None else self.constraints.advance(self.states[node], tok)
        return child

    def step(self, rows: BeamRows | np.ndarray) -> list[int]:
        if self.done:
            raise RuntimeError("beam search already finished")
        rows = self.process(rows if isinstance(rows, BeamRows) else BeamRows(rows))
        C, K = self.constraints, self.num_beams
        logp = rows.dense()
        V = logp.shape[1]
        total = self.scores[:, None] + logp
        at_limit = self.cur_len + 1 >= self.max_length
        states = [self.states[n] for n in self.running]
        for b, s in enumerate(states):
            if len(self.eos) and not at_limit and s.met != C.all_met:
                total[b, self.eos] = -np.inf
        cands, vals, kid = self._candidates(total, states, at_limit)
        beam, tok = (cands // V).tolist(), (cands % V).tolist()
        hit = [t in self.eos or at_limit for t in tok]
        # the banks in turn (most constraint tokens first, each bank's best first); -inf-like scores last
        banks: dict[int, list[int]] = {}
        for j in range(len(cands)):
            banks.setdefault(C.bank(kid[j]) if vals[j] > NEG / 2 else -1, []).append(j)
        if C.allocation == "banks":
            ranked = [banks[b][r] for r in range(max(map(len, banks.values()), default=0))
                      for b in sorted(banks, reverse=True) if b >= 0 and r < len(banks[b])] + banks.get(-1, [])
        else:                   # "reserve": the most advanced candidate first, then plain beam search's order
            top = max((b for b in banks if b >= 0), default=-1)
            first = banks[top][:1] if top > 0 else []
            ranked = first + [j for j in range(len(cands)) if j not in first]
        # finished: stopping candidates ranked < K that met every constraint (at the length limit: any)
        fin = [j for j in ranked[:K] if hit[j] and (kid[j].met == C.all_met or at_limit)]
        self._finish([self._add(self.running[beam[j]], tok[j], kid[j]) for j in fin], vals[fin],
                     [kid[j].met == C.all_met for j in fin])
        nxt = [j for j in ranked if not hit[j]][:K]
        if nxt:
            nxt += [nxt[-1]] * (K - len(nxt))
            self.running = [self._add(self.running[beam[j]], tok[j], kid[j]) for j in nxt]
            self.scores = np.array([vals[j] for j in nxt], np.float32)
            self.scores[len(set(nxt)):] = NEG
        self.cur_len += 1
        self._update_done(not nxt)
        return self.running

    def _candidates(self, total: np.ndarray, states: list[State], at_limit: bool):
        """The step's candidates (flat indices beam * V + token, best first by value then index), their values
        and states: the best n_candidates continuations, each live beam's constraint tokens and its own best
        token; those that would break an `exact` or `after` rule are left out, and the best list is widened
        until K candidates that do not stop remain (or none is left)."""
        C, K, V = self.constraints, self.num_beams, total.shape[1]
        flat = total.reshape(-1)
        extra = []
        for b in range(K):
            if self.scores[b] > NEG / 2 and self.running[b] not in self.running[:b]:    # live, not a duplicate
                extra += [b * V + t for t in C.next_tokens(states[b])] + [b * V + int(np.argmax(total[b]))]
        finite, M = int(np.isfinite(flat).sum()), self.n_candidates
        states_of: dict[int, State] = {}        # per candidate, across widenings of the list
        while True:
            cands = np.array(list(dict.fromkeys([int(i) for i in _top(flat, M)] + extra)), np.int64)
            vals = flat[cands]
            keep = np.isfinite(vals)
            cands, vals = cands[keep], vals[keep]
            order = np.lexsort((cands, -vals))                   # by value, then flat index (as _top)
            cands, vals = cands[order], vals[order]
            kid = [states_of[c] if c in states_of else states_of.setdefault(c, C.advance(states[c // V], c % V))
                   for c in cands.tolist()]
            ok = [not C.violates(k) for k in kid]
            going = sum(o and (c % V) not in self.eos for o, c in zip(ok, cands.tolist()))
            if at_limit or going >= K or M >= finite:
                break
            M *= 2
        pick = np.flatnonzero(ok)
        return cands[pick], vals[pick], [kid[j] for j in pick]

    def _finish(self, nodes: list[int], scores: np.ndarray, met: list[bool]) -> None:
        """Add stopped hypotheses (normalised by generated length ** length_penalty) to the K best finished:
        those that met every constraint by score, then the others (they stop only at the length limit: the search
        returns num_return_sequences hypotheses, those flagged constraints_met=False last); none once the search
        cannot improve (as transformers: every slot holds a hypothesis that met all, and early_stopping=True or no
        beam can beat the worst)."""
        full = bool((self.fin_done & self.fin_met).all())
        if not nodes or (full and self.early is True) or not self.improvable:
            return
        norm = scores.astype(np.float32) / np.float32((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        fin_scores = np.concatenate([self.fin_scores, norm])
        fin_met = np.concatenate([self.fin_met, np.array(met, bool)])
        fin_done = np.concatenate([self.fin_done, np.ones(len(nodes), bool)])
        fin_nodes = self.fin_nodes + list(nodes)
        keep = np.lexsort((np.arange(len(fin_scores)), -fin_scores, ~fin_met, ~fin_done))[:self.num_beams]
        self.fin_scores, self.fin_met, self.fin_done = fin_scores[keep], fin_met[keep], fin_done[keep]
        self.fin_nodes = [fin_nodes[i] for i in keep]

    def _update_done(self, all_stopped: bool) -> None:
        """transformers' stopping rule over the hypotheses that met every constraint (done when every slot holds
        one and early_stopping=True, or no running beam's best possible score beats the worst of them), and
        sooner: once `min_finished` of them are finished and no running beam's score beats the best of them.
        (Beams that may not stop before they meet the constraints otherwise run on: measured on the shipped pair,
        40-75% more steps than the output's tokens, and longer, worse outputs; docs/HISTORY.md.)"""
        if self.early == "never" and self.length_penalty > 0.0:
            L = self.max_length - self.prompt_len
        else:
            L = self.cur_len - self.prompt_len
        met = self.fin_done & self.fin_met
        full = bool(met.all())
        best = self.scores.max() / np.float32(L ** self.length_penalty)
        self.improvable = self.improvable and not (full and best <= self.fin_scores.min())
        if met.sum() >= self.min_finished:    # enough hypotheses that met all, and none running does better
            self.improvable = self.improvable and not (best <= self.fin_scores[met].max())
        self.done = all_stopped or not self.improvable or (full and self.early is True) \
            or self.cur_len >= self.max_length

    def constraints_met(self, n: int) -> list[bool]:
        """Per hypothesis of hypotheses(n): whether it met every constraint."""
        return [bool(m) for node, m in zip(self.fin_nodes, self.fin_met) if node >= 0][:n]


def parse(constraints, phrase, decode=None, eos=()) -> Constraints | None:
    """One request's constraints from the API: None or [] -> none; otherwise a list whose items are each one
    constraint: a text, a list of token ids, a tuple/list of alternatives (texts or token-id lists) of which any
    one satisfies it, or a dict {"phrase": any of those, or "text": a string matched in the decoded output
    text, however it is tokenized; "count": times it must appear (1), "exact": it may not appear more often
    (False), "after": the index of a constraint it may not appear more often than} (markup.py builds text ones
    for copied spans). phrase(x): a text or token ids -> validated token ids (Engine.prefix_ids: texts are
    encoded as plain target-side text); decode(ids) -> text, for "text" constraints; eos: the end-of-sequence
    ids, which no phrase may hold (a hypothesis ends there). A text phrase also gets its form after a space
    (" " + text) as an alternative, as a word inside a sentence is often tokenized differently from the word
    alone. Every error names the constraint by its index in the list."""
    if constraints is None:
        return None
    if isinstance(constraints, (str, bytes, bytearray, dict)) or not hasattr(constraints, "__iter__"):
        raise TypeError(f"constraints must be a list (each item a text, token ids, a list of alternatives or a "
                        f"dict), got {type(constraints).__name__}")
    constraints = list(constraints)
    eos = {int(t) for t in eos}
    # "after" names an index of the caller's list; {"no_other_spans"} items are no constraint of their own
    index = {}
    for i, c in enumerate(constraints):
        if not (isinstance(c, dict) and "no_other_spans" in c):
            index[i] = len(index)
    out, need, exact, after, text, forbid = [], [], [], [], [], None
    for i, c in enumerate(constraints):
        opts = {}
        if isinstance(c, dict) and "no_other_spans" in c:
            forbid = _forbid_other_spans(c, i, constraints)
            continue
        if isinstance(c, dict):
            opts, c = _options(i, c, index), c.get("phrase", c.get("text"))
        alts = _alternatives(i, c, phrase, eos)
        out.append(list(dict.fromkeys(alts)))
        text.append(opts.get("text"))
        need.append(opts.get("count", 1))
        exact.append(bool(opts.get("exact", False)))
        after.append(index[opts["after"]] if opts.get("after") is not None else None)
    if not out and forbid is None:
        return None
    return Constraints(out, need, exact, after, text, decode, phrase, forbid=forbid)


def _options(i: int, c: dict, index: dict) -> dict:
    """Constraint i given as a dict, checked: its options (the phrase or text is the caller's to read)."""
    unknown = set(c) - {"phrase", "text", "count", "exact", "after"}
    if unknown or ("phrase" in c) == ("text" in c):
        raise TypeError(f"constraint {i}: a dict takes 'phrase' or 'text', and optionally 'count', 'exact', "
                        f"'after'; got {sorted(c)}")
    if "text" in c and (not isinstance(c["text"], str) or not c["text"].strip()):
        raise TypeError(f"constraint {i}: 'text' must be a non-empty string, not only spaces, got {c['text']!r}")
    if "text" in c:
        _check_text(i, c["text"])
    count, prior = c.get("count", 1), c.get("after")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"constraint {i}: count must be an int >= 1, got {count!r}")
    if not isinstance(c.get("exact", False), bool):
        raise TypeError(f"constraint {i}: exact must be true or false, got {c['exact']!r}")
    if prior is not None and (isinstance(prior, bool) or not isinstance(prior, int) or
                              prior not in index or prior == i):
        raise ValueError(f"constraint {i}: after must be the index of another constraint (not a "
                         f"no_other_spans item), got {prior!r}")
    return c


def _alternatives(i: int, c, phrase, eos: set) -> list[tuple]:
    """Constraint i's alternatives as token-id tuples (a text also in its form after a space), checked."""
    if isinstance(c, str) or _token_ids(c):
        c = [c]
    if not isinstance(c, (list, tuple)) or not c:
        raise TypeError(f"constraint {i}: {c!r} is not a text, token ids or a list of alternatives")
    alts = []
    for a in c:
        if isinstance(a, str):
            _check_text(i, a)
            if not a.strip():
                raise ValueError(f"constraint {i}: {a!r} is only spaces; give a word or phrase")
        elif not (_token_ids(a) or isinstance(a, (list, tuple)) and not a):    # [] has no tokens
            raise TypeError(f"constraint {i}: alternative {a!r} is neither a text nor a list of token ids (ints)")
        forms = [a, " " + a] if isinstance(a, str) and not a[:1].isspace() else [a]
        for f in forms:
            try:
                ids = phrase(f)
            except (TypeError, ValueError) as e:
                raise type(e)(f"constraint {i}: {str(e).replace('target prefix token', 'token')}") from None
            if not ids:
                raise ValueError(f"constraint {i}: {a!r} has no tokens")
            if eos & set(ids):
                raise ValueError(f"constraint {i}: {a!r} holds the end-of-sequence token "
                                 f"{sorted(eos & set(ids))[0]}; a hypothesis ends there, so it can never be "
                                 f"met inside one")
            alts.append(tuple(ids))
    return alts


def _token_ids(x) -> bool:
    """A non-empty list or tuple of ints (not bools): token ids."""
    return isinstance(x, (list, tuple)) and bool(x) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in x)


def _check_text(i: int, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"constraint {i}: {text!r} holds a lone surrogate (no UTF-8 spelling: an unpaired "
                         f"\\ud800-\\udfff escape or an undecodable byte); pass valid text") from None


def _forbid_other_spans(item: dict, i: int, constraints: list):
    """{"no_other_spans": [extra patterns]}: the output may hold no span (markup.find_spans with those patterns)
    that is not one of the request's text constraints (a model that translates `<file>` into `<Datei>` beside it)."""
    extra = item["no_other_spans"]
    if set(item) != {"no_other_spans"} or not isinstance(extra, (list, tuple)) or \
            not all(isinstance(x, str) for x in extra):
        raise TypeError(f"constraint {i}: {{'no_other_spans': [patterns]}} takes a list of regular expressions")
    for rx in extra:
        try:
            re.compile(rx)
        except re.error as e:
            raise ValueError(f"constraint {i}: no_other_spans pattern {rx!r} is not a regular expression ({e})") \
                from None
    allowed = {c["text"] for c in constraints if isinstance(c, dict) and "text" in c}

    def invented(text: str) -> bool:
        # a copied span being written is no invented one: '&a' on the way to '&amp;', 'https://ex' to a URL. The
        # text's longest end that begins an allowed span is pending; only spans starting before it count
        pending = len(text)
        for a in allowed:
            k = next((k for k in range(min(len(a) - 1, len(text)), 0, -1) if text.endswith(a[:k])), 0)
            pending = min(pending, len(text) - k)
        return any(m.group(0) not in allowed and m.start() < pending
                   for m in find_span_matches(text, extra))
    return invented
