"""Guard features for verifying a semantic-cache candidate (query vs cached prompt).

Embedding similarity is high for texts that differ in exactly the ways that change
the answer. Each feature below measures one such difference, cheaply (regexes and
the word lists of :mod:`proxy.semantic.lexicon`, no model), so the verifier can weigh
it against the similarity. "Substituted" means each side has something the other
lacks (a changed value); "added" means only one side has extra (more detail):

=====================  =========================================================
``sim``, ``sim2``       cosine similarity and its square
``negation``            one side is negated and the other is not (parity differs)
``numbers``             the multisets of numbers differ (digits and number words)
``units``               same numbers, different units/currencies next to them
``entities``            share of proper nouns present on one side only
``entity_swap``         same proper nouns (>= 2), different order
``direction``           source/target swapped: from X to Y vs from Y to X, X to Y vs Y to X
``opposite``            a pair of opposites, one on each side (enable/disable, buy/sell)
``overlap``             Jaccard overlap of content-word stems
``unmatched``           content stems on one side only (capped at 5, / 5)
``reorder``             same bag of content words, different order
``wh``                  different question word (why vs how)
``number_sub``          a number substituted (2014 vs 2015), ``number_add`` one added
``entity_sub``          a proper noun substituted, ``entity_add`` one added
``content_sub``         a content word substituted (counted with repeats: "what can
                        the Muggles use" vs "what can the Wizards use" when both
                        names occur elsewhere), ``content_add`` only added
``only_query``          content stems in the query only (capped at 3, / 3)
``only_prompt``         content stems in the cached prompt only (capped at 3, / 3)
``swap``                two shared content words in opposite order, not a mere
                        "X and Y" / "Y and X" (boys about girls vs girls about boys)
``pointer``             a side points outside the text ("this dog", "the code below")
``wh_class``            question words asking for different kinds of answer
                        (why vs what; how and what count as one class)
``coordination``        different number of "and"/"or": one side asks two things
``exact``               identical after normalisation
``hi``, ``hi*<guard>``  similarity above 0.75 (rescaled to 0..1), and each guard
                        gated by it: a guard matters most when the texts are close
=====================  =========================================================
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from proxy.semantic.lexicon import (
    COORDINATORS,
    DEMONSTRATIVES,
    NEGATIONS,
    NUMBER_WORDS,
    POINTERS,
    STOPWORDS,
    WH_CLASSES,
    WH_WORDS,
    Lexicon,
    build_lexicon,
)

GUARD_NAMES = (
    "negation", "numbers", "units", "entities", "entity_swap", "direction", "opposite",
    "overlap", "unmatched", "reorder", "wh", "number_sub", "number_add", "entity_sub",
    "entity_add", "content_sub", "content_add", "only_query", "only_prompt", "swap",
    "pointer", "wh_class", "coordination",
)  # fmt: skip
FEATURE_NAMES = ("sim", "sim2", *GUARD_NAMES, "exact", "hi", *(f"hi*{g}" for g in GUARD_NAMES))
HIGH_SIMILARITY_FLOOR = 0.75  # "hi" = max(0, sim - floor) / (1 - floor): guards gated by it

__all__ = ["FEATURE_NAMES", "Parsed", "build_lexicon", "features", "parse"]

_TOKEN = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?|\d+(?:[.,]\d+)*|[$€£%]")


@dataclass(frozen=True)
class Parsed:
    """What the guards need from one text; computed once per text."""

    lower: tuple[str, ...]
    content: tuple[str, ...]  # stems of non-stopwords, in order
    entities: tuple[str, ...]  # proper nouns, in order
    numbers: tuple[tuple[str, str], ...]  # (value, unit)
    negated: bool
    wh: str
    wh_class: int  # -1: no question word
    bases: frozenset[str]  # lexicon base forms present
    directions: frozenset[tuple[str, str]]  # (role, word): ("from", "paris"), ("to", "london")
    flows: frozenset[tuple[str, str]]  # (source, target)
    points_outside: bool
    num_coordinators: int
    content_counts: Counter[str]  # multisets of the above, for the substitution guards
    entity_counts: Counter[str]
    number_counts: Counter[str]  # values only


def _stem(word: str) -> str:
    if len(word) > 4:
        for suffix, repl in (("ies", "y"), ("ing", ""), ("ed", ""), ("es", ""), ("s", "")):
            if word.endswith(suffix) and not word.endswith("ss"):
                return word[: -len(suffix)] + repl
    return word


def _token_text(token: str) -> str:
    return token[:-2] if token[-2:] in ("'s", "'S") else token  # possessive: "Delhi's" -> "Delhi"


def parse(text: str, lexicon: Lexicon) -> Parsed:
    """Tokenise ``text`` and extract everything :func:`features` compares."""
    raw = [_token_text(t) for t in _TOKEN.findall(text)]
    lower = tuple(t.lower().replace("n't", "nt") for t in raw)
    content = tuple(_stem(t) for t in lower if t not in STOPWORDS and t.isalpha())
    entities = tuple(
        t.lower()
        for t in raw
        if t[:1].isalpha()
        and (t[0].isupper() or any(c.isupper() for c in t[1:]))
        and t.lower() not in STOPWORDS
        and t.lower() not in WH_WORDS
        and t != "I"
    )
    negated = sum(1 for t in lower if t in NEGATIONS) % 2 == 1
    wh = next((t for t in lower if t in WH_WORDS), "")
    bases = frozenset(lexicon.form_to_base[t] for t in lower if t in lexicon.form_to_base)
    directions, flows = _directions(lower)
    numbers = _numbers(lower)
    return Parsed(
        lower, content, entities, numbers, negated, wh, WH_CLASSES.get(wh, -1), bases,
        directions, flows, _points_outside(lower), sum(1 for t in lower if t in COORDINATORS),
        Counter(content), Counter(entities), Counter(v for v, _ in numbers),
    )  # fmt: skip


def _numbers(lower: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for i, tok in enumerate(lower):
        value = NUMBER_WORDS.get(tok) or (tok.replace(",", "") if tok[:1].isdigit() else None)
        if value is None:
            continue
        before = lower[i - 1] if i > 0 and lower[i - 1] in "$€£" else ""
        after = lower[i + 1] if i + 1 < len(lower) else ""
        unit = before or (after if after.isalpha() and after not in STOPWORDS else "")
        out.append((value.rstrip("0").rstrip(".") if "." in value else value, _stem(unit)))
    return tuple(out)


def _points_outside(lower: tuple[str, ...]) -> bool:
    """ "this dog", "these questions", "what is that", "the code below"."""
    for i, tok in enumerate(lower):
        if tok in POINTERS:
            return True
        if tok in DEMONSTRATIVES and tok != "that":
            after = lower[i + 1] if i + 1 < len(lower) else ""
            if not after or (after.isalpha() and after not in STOPWORDS):
                return True
        if tok == "that" and i == len(lower) - 1:
            return True
    return False


def _next_content(lower: tuple[str, ...], i: int) -> str:
    for tok in lower[i + 1 : i + 4]:
        if tok not in STOPWORDS:
            return tok
    return ""


Pairs = frozenset[tuple[str, str]]


def _directions(lower: tuple[str, ...]) -> tuple[Pairs, Pairs]:
    roles: set[tuple[str, str]] = set()
    flows: set[tuple[str, str]] = set()
    source = ""
    for i, tok in enumerate(lower):
        if tok == "from":
            source = _next_content(lower, i)
            if source:
                roles.add(("from", source))
        elif tok in ("to", "into", "towards"):
            target = _next_content(lower, i)
            if not target:
                continue
            roles.add(("to", target))
            left = source or (lower[i - 1] if i > 0 and lower[i - 1] not in STOPWORDS else "")
            if left:
                flows.add((left, target))
    return frozenset(roles), frozenset(flows)


def features(sim: float, a: Parsed, b: Parsed, lexicon: Lexicon) -> list[float]:
    """Feature vector in :data:`FEATURE_NAMES` order (``a`` the query, ``b`` the prompt)."""
    guards = [*_original_guards(a, b, lexicon), *_change_guards(a, b)]
    hi = max(0.0, sim - HIGH_SIMILARITY_FLOOR) / (1.0 - HIGH_SIMILARITY_FLOOR)
    return [sim, sim * sim, *guards, float(a.lower == b.lower), hi, *(hi * g for g in guards)]


def _original_guards(a: Parsed, b: Parsed, lexicon: Lexicon) -> list[float]:
    ents_a, ents_b = a.entity_counts.keys(), b.entity_counts.keys()
    union = ents_a | ents_b
    vals_a, vals_b = a.number_counts, b.number_counts
    units_differ = vals_a == vals_b and sorted(a.numbers) != sorted(b.numbers)
    stems_a, stems_b = a.content_counts.keys(), b.content_counts.keys()
    opposite = any(
        (x, y) in lexicon.opposite_pairs for x in a.bases - b.bases for y in b.bases - a.bases
    )
    swapped_flow = any((y, x) in b.flows and x != y for x, y in a.flows)
    swapped_role = any(
        (("to" if role == "from" else "from"), w) in b.directions and (role, w) not in b.directions
        for role, w in a.directions
    )
    return [
        float(a.negated != b.negated),
        float(vals_a != vals_b),
        float(units_differ),
        len(ents_a ^ ents_b) / max(1, len(union)),
        float(ents_a == ents_b and len(ents_a) >= 2 and _order(a.entities) != _order(b.entities)),
        float(swapped_flow or swapped_role),
        float(opposite),
        len(stems_a & stems_b) / max(1, len(stems_a | stems_b)),
        min(5, len(stems_a ^ stems_b)) / 5,
        float(a.content_counts == b.content_counts and a.content != b.content),
        float(a.wh != b.wh),
    ]


def _change_guards(a: Parsed, b: Parsed) -> list[float]:
    number_sub, number_add = _sub_add(a.number_counts, b.number_counts)
    entity_sub, entity_add = _sub_add(a.entity_counts, b.entity_counts)
    content_sub, content_add = _sub_add(a.content_counts, b.content_counts)
    only_query = len(a.content_counts.keys() - b.content_counts.keys())
    only_prompt = len(b.content_counts.keys() - a.content_counts.keys())
    return [
        number_sub, number_add, entity_sub, entity_add, content_sub, content_add,
        min(3, only_query) / 3, min(3, only_prompt) / 3, float(_swapped(a, b)),
        float(a.points_outside or b.points_outside),
        float(a.wh_class != b.wh_class),
        float(a.num_coordinators != b.num_coordinators),
    ]  # fmt: skip


def _sub_add(x: Counter[str], y: Counter[str]) -> tuple[float, float]:
    """(each side has something the other lacks, exactly one side has extra)."""
    only_x = any(n > y.get(k, 0) for k, n in x.items())
    only_y = any(n > x.get(k, 0) for k, n in y.items())
    return float(only_x and only_y), float(only_x != only_y)


def _swapped(a: Parsed, b: Parsed) -> bool:
    """Two content words shared by both sides come in opposite orders, and neither text
    joins them with a coordinator ("X and Y" vs "Y and X" asks the same)."""
    first_b = {w: i for i, w in reversed(list(enumerate(b.content)))}
    shared = [w for w in dict.fromkeys(a.content) if w in first_b]
    for i, x in enumerate(shared):
        for y in shared[i + 1 :]:
            if first_b[x] > first_b[y] and not (_coordinated(a, x, y) or _coordinated(b, x, y)):
                return True
    return False


def _coordinated(p: Parsed, x: str, y: str) -> bool:
    stems = [_stem(t) for t in p.lower]
    if x not in stems or y not in stems:
        return False
    i, j = sorted((stems.index(x), stems.index(y)))
    return any(t in COORDINATORS for t in p.lower[i + 1 : j])


def _order(entities: tuple[str, ...]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for e in entities:
        seen.setdefault(e, None)
    return tuple(seen)
