"""Training data of the cross-encoder (bench/train_cross_encoder.py); none of it ships.

* the ``fit`` split of the clean QQP file (``qqp_split``; ``heldout`` is never read
  here, ``calib`` only for monitoring and by :mod:`bench.export_cross_encoder`);
* generated hard negatives: ``fit`` questions perturbed by templates (negation, numbers,
  units, swapped entities, from/to, opposite verbs, question word), label 0, see
  :func:`hard_negatives`;
* the ``split == "train"`` rows of bench/semantic/hard_cases.jsonl (``heldout`` rows are
  the held-out near-misses and paraphrases: never fitted), repeated ``hard_repeat`` times;
* a few identical questions (case aside), label 1.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.semantic.evaluate import qqp_split

Example = tuple[str, str, int]

_NEGATE = {
    "is": "isn't", "are": "aren't", "can": "can't", "does": "doesn't", "do": "don't",
    "should": "shouldn't", "will": "won't", "was": "wasn't", "did": "didn't",
    "could": "couldn't", "would": "wouldn't", "has": "hasn't", "have": "haven't",
}
_OPPOSITE = {
    "increase": "decrease", "buy": "sell", "gain": "lose", "best": "worst",
    "start": "stop", "open": "close", "good": "bad", "more": "less", "before": "after",
    "win": "lose", "love": "hate", "add": "remove", "enable": "disable", "high": "low",
    "cheap": "expensive", "fast": "slow", "easy": "hard", "rich": "poor", "hot": "cold",
    "online": "offline", "men": "women", "male": "female", "first": "last", "old": "young",
    "upload": "download", "import": "export", "send": "receive", "positive": "negative",
    "advantages": "disadvantages", "pros": "cons", "legal": "illegal", "like": "dislike",
    "bigger": "smaller", "strong": "weak", "long": "short", "north": "south",
    "east": "west", "maximum": "minimum", "true": "false", "happy": "sad",
}
_OPPOSITE.update({v: k for k, v in list(_OPPOSITE.items())})
_UNITS = {
    "km": "miles", "miles": "km", "kg": "pounds", "pounds": "kg", "hours": "minutes",
    "minutes": "hours", "days": "weeks", "weeks": "months", "months": "years",
    "years": "months", "dollars": "euros", "rupees": "dollars", "gb": "tb", "mb": "gb",
    "celsius": "fahrenheit", "fahrenheit": "celsius", "liters": "gallons", "cm": "inches",
}
_QWORDS = {"why": "how", "how": "why", "what": "where", "when": "where", "where": "when",
           "who": "what", "which": "why"}
_WORD = re.compile(r"[A-Za-z']+|\d+|[^\sA-Za-z\d]")



def _case_like(word: str, like: str) -> str:
    return word.capitalize() if like[:1].isupper() else word


def _swap_words(text: str, table: dict[str, str], rng: random.Random) -> str | None:
    tokens = text.split(" ")
    spots = [i for i, t in enumerate(tokens) if t.lower().strip("?,.") in table]
    if not spots:
        return None
    i = rng.choice(spots)
    core = tokens[i].strip("?,.")
    tail = tokens[i][len(core):]
    tokens[i] = _case_like(table[core.lower()], core) + tail
    return " ".join(tokens)


def _negate(text: str, rng: random.Random) -> str | None:
    return _swap_words(text, _NEGATE, rng)


def _number(text: str, rng: random.Random) -> str | None:
    nums = list(re.finditer(r"\d+", text))
    if not nums:
        return None
    m = rng.choice(nums)
    value = int(m.group())
    new = value + rng.choice([1, 2, 5, 10, -1]) if value > 1 else value + rng.choice([1, 2, 3])
    if new == value or new < 0:
        new = value + 3
    return text[: m.start()] + str(new) + text[m.end():]


def _direction(text: str, rng: random.Random) -> str | None:
    m = re.search(r"\bfrom (\w+(?: \w+)?) to (\w+(?: \w+)?)", text)
    if m:
        a, b = m.group(1), m.group(2)
        return text[: m.start()] + f"from {b} to {a}" + text[m.end():]
    m = re.search(r"\b(\w+) (vs\.?|versus|or|than) (\w+)", text)
    if m and m.group(2) == "than":
        return text[: m.start()] + f"{m.group(3)} than {m.group(1)}" + text[m.end():]
    return None


def _entity(text: str, names: Sequence[str], rng: random.Random) -> str | None:
    tokens = text.split(" ")
    spots = [i for i, t in enumerate(tokens[1:], start=1) if t[:1].isupper() and t.isalpha()]
    if not spots or not names:
        return None
    i = rng.choice(spots)
    other = rng.choice(names)
    if other == tokens[i]:
        return None
    tokens[i] = other
    return " ".join(tokens)


def hard_negatives(questions: Sequence[str], seed: int, per_kind: int) -> list[Example]:
    """Label-0 pairs (question, perturbed question), at most ``per_kind`` of each kind."""
    rng = random.Random(seed)
    names = sorted({t for q in questions for t in q.split(" ")[1:] if t[:1].isupper()
                    and t.isalpha() and len(t) > 2})
    kinds: dict[str, Any] = {
        "negation": _negate,
        "numbers": _number,
        "units": lambda t, r: _swap_words(t, _UNITS, r),
        "opposite": lambda t, r: _swap_words(t, _OPPOSITE, r),
        "question_word": lambda t, r: _swap_words(t, _QWORDS, r),
        "direction": _direction,
        "entities": lambda t, r: _entity(t, names, r),
    }
    out: list[Example] = []
    order = list(questions)
    rng.shuffle(order)
    for make in kinds.values():
        made = 0
        for q in order:
            if made >= per_kind:
                break
            p = make(q, rng)
            if p and p.lower() != q.lower():
                out.append((q, p, 0))
                made += 1
    return out


def load_examples(qqp: Path, hard_path: Path, seed: int, per_kind: int,
                  hard_repeat: int) -> tuple[list[Example], dict[str, int]]:
    rows = [json.loads(line) for line in qqp.read_text().splitlines() if line.strip()]
    fit = [(r["text_a"], r["text_b"], int(r["label"])) for r in rows
           if qqp_split(r["text_a"], r["text_b"]) == "fit"]
    questions = sorted({t for a, b, _ in fit for t in (a, b)})
    negatives = hard_negatives(questions, seed, per_kind)
    hard = [json.loads(line) for line in hard_path.read_text().splitlines() if line.strip()]
    hand = [(h["text_a"], h["text_b"], int(h["label"])) for h in hard if h["split"] == "train"]
    # identical questions (case aside) are duplicates: a few so the model knows it
    rng = random.Random(seed + 1)
    same = [(q, q.lower() if rng.random() < 0.5 else q, 1) for q in rng.sample(questions, 500)]
    examples = fit + negatives + hand * hard_repeat + same
    counts = {"fit": len(fit), "generated_negatives": len(negatives), "hand": len(hand),
              "hand_repeat": hard_repeat, "identical": len(same), "total": len(examples)}
    return examples, counts
