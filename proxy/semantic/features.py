"""Guard features for verifying a semantic-cache candidate (query vs cached prompt).

Embedding similarity is high for texts that differ in exactly the ways that change
the answer. Each feature below measures one such difference, cheaply (regexes and
small lexicons, no model), so the verifier can weigh it against the similarity:

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
``exact``               identical after normalisation
``hi``, ``hi*<guard>``  similarity above 0.75 (rescaled to 0..1), and each guard
                        gated by it: a guard matters most when the texts are close
=====================  =========================================================
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

FEATURE_NAMES = (
    "sim", "sim2", "negation", "numbers", "units", "entities", "entity_swap",
    "direction", "opposite", "overlap", "unmatched", "reorder", "wh", "exact",
    "hi", "hi*negation", "hi*numbers", "hi*units", "hi*entities", "hi*entity_swap",
    "hi*direction", "hi*opposite", "hi*overlap", "hi*unmatched", "hi*reorder", "hi*wh",
)  # fmt: skip
HIGH_SIMILARITY_FLOOR = 0.75  # "hi" = max(0, sim - floor) / (1 - floor): guards gated by it


def _words(*chunks: str) -> tuple[str, ...]:
    return tuple("".join(chunks).split())


_TOKEN = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?|\d+(?:[.,]\d+)*|[$€£%]")
STOPWORDS = frozenset(
    _words(
        "a an the is are was were be been being am do does did doing have has had having i me ",
        "my we our you your he him his she her it its they them their this that these those ",
        "of in on at by for with about as into through during to from up down out off over ",
        "under again further then once here there all any both each few more most other some ",
        "such own same so than too very can will just should would could may might must shall ",
        "what which who whom whose when where why how and or but if because until while s t ",
        "get got there's it's i'm what's how's",
    )
)
NEGATIONS = frozenset(
    _words(
        "not no never none nobody nothing neither nor without cannot cant dont doesnt didnt ",
        "isnt arent wasnt werent wont wouldnt shouldnt couldnt hasnt havent",
    )
)
WH_WORDS = ("what", "why", "how", "when", "where", "who", "which", "whom", "whose")
NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        _words(
            "zero one two three four five six seven eight nine ten eleven twelve thirteen ",
            "fourteen fifteen sixteen seventeen eighteen nineteen twenty",
        )
    )
}
NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "hundred": "100"})
NUMBER_WORDS.update({"thousand": "1000", "million": "1000000", "billion": "1000000000"})
OPPOSITES = _words(
    "enable/disable buy/sell increase/decrease add/remove start/stop open/close win/lose ",
    "import/export upload/download encrypt/decrypt connect/disconnect install/uninstall ",
    "lock/unlock push/pull accept/reject allow/deny include/exclude first/last more/less ",
    "most/least maximum/minimum max/min best/worst better/worse high/low higher/lower ",
    "highest/lowest big/small large/small long/short fast/slow cheap/expensive hot/cold ",
    "rich/poor early/late before/after above/below inside/outside true/false love/hate ",
    "positive/negative advantage/disadvantage pro/con gain/lose rise/fall raise/lower ",
    "expand/shrink show/hide join/leave borrow/lend give/take send/receive arrive/depart ",
    "men/women man/woman male/female boy/girl husband/wife father/mother son/daughter ",
    "brother/sister north/south east/west left/right up/down enter/exit import/export ",
    "compress/decompress zip/unzip subscribe/unsubscribe follow/unfollow like/dislike ",
    "agree/disagree legal/illegal safe/unsafe happy/sad easy/hard easy/difficult ",
    "light/dark heavy/light strong/weak young/old new/old ascending/descending ",
    "inhale/exhale mount/unmount attach/detach freeze/unfreeze ban/unban block/unblock ",
    "minimize/maximize overestimate/underestimate underweight/overweight deposit/withdraw ",
    "credit/debit profit/loss success/failure pass/fail asleep/awake wet/dry",
)
_IRREGULAR = {
    "bought": "buy", "sold": "sell", "won": "win", "lost": "lose", "rose": "rise",
    "risen": "rise", "fell": "fall", "fallen": "fall", "gave": "give", "given": "give",
    "took": "take", "taken": "take", "sent": "send", "lent": "lend",
    "shown": "show", "hid": "hide", "hidden": "hide", "froze": "freeze", "frozen": "freeze",
}  # fmt: skip


def _forms(base: str) -> set[str]:
    forms = {base, base + "s", base + "es", base + "d", base + "ed", base + "ing", base + "er"}
    if base.endswith("e"):
        forms |= {base[:-1] + "ing", base[:-1] + "ed"}
    if base.endswith("y"):
        forms |= {base[:-1] + "ies", base[:-1] + "ied"}
    if len(base) > 2 and base[-1] not in "aeiouwy" and base[-2] in "aeiou":
        forms |= {base + base[-1] + "ing", base + base[-1] + "ed"}
    return forms


@dataclass(frozen=True)
class _Lexicon:
    form_to_base: dict[str, str]
    opposite_pairs: frozenset[tuple[str, str]]


def build_lexicon() -> _Lexicon:
    """Word-form map and opposite pairs (built once by the verifier)."""
    form_to_base: dict[str, str] = dict(_IRREGULAR)
    pairs: set[tuple[str, str]] = set()
    for item in OPPOSITES:
        left, right = item.split("/")
        pairs |= {(left, right), (right, left)}
        for base in (left, right):
            for form in _forms(base):
                form_to_base.setdefault(form, base)
    return _Lexicon(form_to_base, frozenset(pairs))


@dataclass(frozen=True)
class Parsed:
    """What the guards need from one text; computed once per text."""

    lower: tuple[str, ...]
    content: tuple[str, ...]  # stems of non-stopwords, in order
    entities: tuple[str, ...]  # proper nouns, in order
    numbers: tuple[tuple[str, str], ...]  # (value, unit)
    negated: bool
    wh: str
    bases: frozenset[str]  # lexicon base forms present
    directions: frozenset[tuple[str, str]]  # (role, word): ("from", "paris"), ("to", "london")
    flows: frozenset[tuple[str, str]]  # (source, target)


def _stem(word: str) -> str:
    if len(word) > 4:
        for suffix, repl in (("ies", "y"), ("ing", ""), ("ed", ""), ("es", ""), ("s", "")):
            if word.endswith(suffix) and not word.endswith("ss"):
                return word[: -len(suffix)] + repl
    return word


def parse(text: str, lexicon: _Lexicon) -> Parsed:
    """Tokenise ``text`` and extract everything :func:`features` compares."""
    raw = _TOKEN.findall(text)
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
    return Parsed(lower, content, entities, _numbers(lower), negated, wh, bases, directions, flows)


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


def features(sim: float, a: Parsed, b: Parsed, lexicon: _Lexicon) -> list[float]:
    """Feature vector in :data:`FEATURE_NAMES` order."""
    ents_a, ents_b = set(a.entities), set(b.entities)
    union = ents_a | ents_b
    vals_a = Counter(v for v, _ in a.numbers)
    vals_b = Counter(v for v, _ in b.numbers)
    units_differ = vals_a == vals_b and sorted(a.numbers) != sorted(b.numbers)
    stems_a, stems_b = set(a.content), set(b.content)
    overlap = len(stems_a & stems_b) / max(1, len(stems_a | stems_b))
    unmatched = min(5, len(stems_a ^ stems_b)) / 5
    opposite = any(
        (x, y) in lexicon.opposite_pairs for x in a.bases - b.bases for y in b.bases - a.bases
    )
    swapped_flow = any((y, x) in b.flows and x != y for x, y in a.flows)
    swapped_role = any(
        (("to" if role == "from" else "from"), w) in b.directions and (role, w) not in b.directions
        for role, w in a.directions
    )
    base = [
        sim,
        sim * sim,
        float(a.negated != b.negated),
        float(vals_a != vals_b),
        float(units_differ),
        len(ents_a ^ ents_b) / max(1, len(union)),
        float(ents_a == ents_b and len(ents_a) >= 2 and _order(a.entities) != _order(b.entities)),
        float(swapped_flow or swapped_role),
        float(opposite),
        overlap,
        unmatched,
        float(Counter(a.content) == Counter(b.content) and a.content != b.content),
        float(a.wh != b.wh),
        float(a.lower == b.lower),
    ]
    hi = max(0.0, sim - HIGH_SIMILARITY_FLOOR) / (1.0 - HIGH_SIMILARITY_FLOOR)
    return [*base, hi, *(hi * g for g in base[2:13])]


def _order(entities: tuple[str, ...]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for e in entities:
        seen.setdefault(e, None)
    return tuple(seen)
