"""Lexically constrained beam search with dynamic beam allocation (Post & Vilar 2018; DESIGN "Terminology
constraints"): every finished hypothesis contains each constraint (one of its alternative token phrases).

A hypothesis's constraint state is a function of its generated tokens alone (which constraints appeared as
contiguous phrases, and the phrase prefixes its last tokens form), so the replay of a speculative pass computes
exactly the states plain search computes, and speculative constrained search is token-identical to plain
constrained search (the step is a deterministic function of the beams' log-probs and these states).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .beam import NEG, BeamRows, BeamSearch, _top


@dataclass(frozen=True)
class State:
    """met: a bit per constraint that appeared; partial: (constraint, alternative, tokens matched) for every
    phrase prefix the hypothesis's last tokens form (of constraints not met yet)."""
    met: int = 0
    partial: tuple = ()


class Constraints:
    """One request's constraints: each a list of alternative phrases (token-id lists), met by any one of them."""

    def __init__(self, constraints: list[list[list[int]]]):
        self.phrases = [[tuple(int(t) for t in alt) for alt in c] for c in constraints]
        if not self.phrases or any(not c or any(not alt for alt in c) for c in self.phrases):
            raise ValueError("a constraint needs at least one non-empty phrase")
        self.all_met = (1 << len(self.phrases)) - 1
        # a constraint's weight in the banks: its shortest alternative's length (the tokens it takes at least)
        self.units = [min(len(alt) for alt in c) for c in self.phrases]
        self.total_units = sum(self.units)
        self.starts: dict[int, list[tuple[int, int]]] = {}    # first token -> (constraint, alternative)
        for ci, c in enumerate(self.phrases):
            for ai, alt in enumerate(c):
                self.starts.setdefault(alt[0], []).append((ci, ai))

    def advance(self, s: State, tok: int) -> State:
        met, partial = s.met, []
        for ci, ai, k in s.partial:
            if not met >> ci & 1 and self.phrases[ci][ai][k] == tok:
                if k + 1 == len(self.phrases[ci][ai]):
                    met |= 1 << ci
                else:
                    partial.append((ci, ai, k + 1))
        for ci, ai in self.starts.get(tok, ()):
            if not met >> ci & 1:
                if len(self.phrases[ci][ai]) == 1:
                    met |= 1 << ci
                else:
                    partial.append((ci, ai, 1))
        return State(met, tuple(sorted(p for p in set(partial) if not met >> p[0] & 1)))

    def bank(self, s: State) -> int:
        """Constraint tokens produced: a met constraint counts its units, a phrase in progress its matched
        tokens (at most units - 1)."""
        progress = [0] * len(self.phrases)
        for ci, _, k in s.partial:
            progress[ci] = max(progress[ci], min(k, self.units[ci] - 1))
        return sum(u if s.met >> ci & 1 else progress[ci] for ci, u in enumerate(self.units))

    def next_tokens(self, s: State) -> list[int]:
        """Tokens that extend a phrase in progress or start an unmet constraint, in a fixed order."""
        out = [self.phrases[ci][ai][k] for ci, ai, k in s.partial]
        out += [alt[0] for ci, c in enumerate(self.phrases) if not s.met >> ci & 1 for alt in c]
        return list(dict.fromkeys(out))

    def unmet(self, s: State) -> list[int]:
        return [ci for ci in range(len(self.phrases)) if not s.met >> ci & 1]


class ConstrainedBeamSearch(BeamSearch):
    """BeamSearch whose step allocates the beam over banks of constraint progress (dynamic beam allocation).

    Per step, the candidates are the 2K best continuations of all beams (as in plain beam search), plus, for each
    live beam, every token that extends one of its phrases in progress or starts an unmet constraint, and its
    single best token. EOS is banned on a beam until it has met every constraint (at the length limit a
    hypothesis finishes whatever it met, ranked after every one that met all). The next K beams are taken from
    the banks in turn (most constraint tokens first, each bank's best first), so hypotheses that made progress on
    the constraints keep places in the beam although their score is lower. A candidate that stops finishes when
    it ranks among the K best candidates by score and has met every constraint, as transformers' finishing rule."""

    def __init__(self, *args, constraints: Constraints, **kw):
        super().__init__(*args, **kw)
        if self.num_beams < 2:
            raise ValueError("constraints need beam search: num_beams >= 2 (4 or more is better: the beam is "
                             "shared by the banks of constraint progress)")
        self.constraints = constraints
        self.states = {self.running[0]: State()}
        self.fin_met = np.zeros(self.num_beams, bool)

    def state_of(self, node: int) -> State:
        return self.states[node]

    def proposals(self) -> list[int]:
        """Below each running beam, the rest of every phrase in progress and every unmet constraint's phrases, as
        chains (within the length limit): the steps that take a constraint token are then scored in the same
        pass as the draft's tree (a draft model knows nothing of the constraints)."""
        C, room, out = self.constraints, self.max_length - self.cur_len, []
        for n in dict.fromkeys(self.running):
            s = self.states[n]
            rests = [C.phrases[ci][ai][k:] for ci, ai, k in s.partial]
            rests += [alt for ci in C.unmet(s) for alt in C.phrases[ci]]
            for rest in rests:
                node = n
                for t in rest[:room]:
                    node = self._add(node, t, C.advance(self.states[node], t))
                    out.append(node)
        return list(dict.fromkeys(out))

    def _add(self, node: int, tok: int, state: State) -> int:
        child = self.tree.add(node, tok)
        self.states.setdefault(child, state)
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
        if len(self.eos) and not at_limit:
            for b, s in enumerate(states):
                if s.met != C.all_met:
                    total[b, self.eos] = -np.inf
        flat = total.reshape(-1)
        cands = [int(i) for i in _top(flat, self.n_candidates)]
        for b in range(K):
            if self.scores[b] > NEG / 2 and self.running[b] not in self.running[:b]:    # live, not a duplicate
                cands += [b * V + t for t in C.next_tokens(states[b])] + [b * V + int(np.argmax(total[b]))]
        cands = np.array(list(dict.fromkeys(cands)), np.int64)
        vals = flat[cands]
        keep = np.isfinite(vals)
        cands, vals = cands[keep], vals[keep]
        order = np.lexsort((cands, -vals))                       # by value, then flat index (as _top)
        cands, vals = cands[order], vals[order]
        beam, tok = (cands // V).tolist(), (cands % V).tolist()
        kid = [self.constraints.advance(states[b], t) for b, t in zip(beam, tok)]
        hit = [t in self.eos or at_limit for t in tok]
        # the banks in turn (most constraint tokens first, each bank's best first); -inf-like scores last
        banks: dict[int, list[int]] = {}
        for j in range(len(cands)):
            banks.setdefault(C.bank(kid[j]) if vals[j] > NEG / 2 else -1, []).append(j)
        ranked = [banks[b][r] for r in range(max(map(len, banks.values()), default=0))
                  for b in sorted(banks, reverse=True) if b >= 0 and r < len(banks[b])] + banks.get(-1, [])
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

    def _finish(self, nodes: list[int], scores: np.ndarray, met: list[bool]) -> None:
        """Add stopped hypotheses (normalised by generated length ** length_penalty) to the K best finished:
        those that met every constraint, by score (the others, which stop only at the length limit, only while
        no hypothesis met all: the search returns something, flagged); none once the search cannot improve (as
        transformers: every slot holds a hypothesis that met all, and early_stopping=True or no beam can beat
        the worst)."""
        full = bool((self.fin_done & self.fin_met).all())
        if not nodes or (full and self.early is True) or not self.improvable:
            return
        norm = scores.astype(np.float32) / np.float32((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        fin_scores = np.concatenate([self.fin_scores, norm])
        fin_met = np.concatenate([self.fin_met, np.array(met, bool)])
        fin_done = np.concatenate([self.fin_done, np.ones(len(nodes), bool)])
        fin_nodes = self.fin_nodes + list(nodes)
        if (fin_met & fin_done).any():       # one that met all: the ones that did not (at the limit) are dropped
            drop = fin_done & ~fin_met
            fin_scores[drop], fin_done[drop] = NEG, False
            fin_nodes = [-1 if d else n for n, d in zip(fin_nodes, drop)]
        keep = np.lexsort((np.arange(len(fin_scores)), -fin_scores, ~fin_met, ~fin_done))[:self.num_beams]
        self.fin_scores, self.fin_met, self.fin_done = fin_scores[keep], fin_met[keep], fin_done[keep]
        self.fin_nodes = [fin_nodes[i] for i in keep]

    def _update_done(self, all_stopped: bool) -> None:
        """transformers' stopping rule over the hypotheses that met every constraint: done when every slot holds
        one and (early_stopping=True, or no running beam's best possible score beats the worst of them)."""
        if self.early == "never" and self.length_penalty > 0.0:
            L = self.max_length - self.prompt_len
        else:
            L = self.cur_len - self.prompt_len
        full = bool((self.fin_done & self.fin_met).all())
        best = self.scores.max() / np.float32(L ** self.length_penalty)
        self.improvable = self.improvable and not (full and best <= self.fin_scores.min())
        self.done = all_stopped or not self.improvable or (full and self.early is True) \
            or self.cur_len >= self.max_length

    def constraints_met(self, n: int) -> list[bool]:
        """Per hypothesis of hypotheses(n): whether it met every constraint."""
        return [bool(m) for node, m in zip(self.fin_nodes, self.fin_met) if node >= 0][:n]


def parse(constraints, phrase) -> Constraints | None:
    """One request's constraints from the API: None or [] -> none; otherwise a list whose items are each one
    constraint: a text, a list of token ids, or a tuple/list of alternatives (texts or token-id lists) of which
    any one satisfies it. phrase(x): a text or token ids -> validated token ids (Engine._prefix_ids: texts are
    encoded as plain target-side text). A text also gets its form after a space (" " + text) as an alternative,
    as a word inside a sentence is often tokenized differently from the word alone."""
    if constraints is None:
        return None
    if isinstance(constraints, (str, bytes, bytearray, dict)) or not hasattr(constraints, "__iter__"):
        raise TypeError(f"constraints must be a list (each item a text, token ids, or a list of alternatives), "
                        f"got {type(constraints).__name__}")
    out = []
    for i, c in enumerate(constraints):
        if isinstance(c, str) or isinstance(c, (list, tuple)) and c and all(isinstance(t, (int, np.integer))
                                                                          for t in c):
            c = [c]
        if not isinstance(c, (list, tuple)) or not c:
            raise TypeError(f"constraint {i}: {c!r} is not a text, token ids or a list of alternatives")
        alts = []
        for a in c:
            forms = [a, " " + a] if isinstance(a, str) and not a[:1].isspace() else [a]
            for f in forms:
                ids = phrase(f)
                if not ids:
                    raise ValueError(f"constraint {i}: {a!r} has no tokens")
                alts.append(tuple(ids))
        out.append(list(dict.fromkeys(alts)))
    return Constraints(out) if out else None
