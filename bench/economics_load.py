"""The mixed load of :mod:`bench.economics`: two tenants' chat requests, in send order.

* tenant P (prefix sharing): conversation sessions of the Mooncake trace (the first
  ``scan_rows`` rows; sessions are rows with the same first two hash ids, the first
  ``turns`` turns of each session with 3 or more), in trace order, each request's hash
  ids cut at ``max_ids``; every hash id becomes a deterministic short text chunk of
  ``words_per_id`` words, so requests sharing leading hash ids share a prompt prefix.
  A request's question class is its hash-id list (only an exact repeat asks the same).
* tenant Q (paraphrases): ``duplicates`` label-1 and ``negatives`` label-0 pairs drawn
  (seeded) from the QQP file. Every ``text_a`` is asked first (shuffled); then every
  ``text_b`` and an exact repeat of ``repeats`` label-1 ``text_a`` (shuffled together).
  Classes: the texts of a label-1 pair share one; every other text has its own.

The two tenants' requests are interleaved (seeded) into one sequence.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORDS = ("river", "stone", "lamp", "garden", "window", "market", "silver", "morning", "engine",
    "paper", "valley", "harbor", "signal", "forest", "copper", "winter", "bridge", "candle",
    "orbit", "meadow", "ladder", "planet", "velvet", "thunder", "cabin", "mirror", "pepper",
    "saddle", "tunnel", "violet", "basket", "canyon", "falcon", "ginger", "island", "jacket",
    "kettle", "lemon", "marble", "needle", "oyster", "pillow", "quartz", "ribbon", "spider",
    "timber", "umbrella", "walnut", "yellow", "zebra", "anchor", "bucket", "cotton", "desert",
    "feather", "glacier", "hammer", "igloo", "jungle", "kernel", "lantern", "magnet", "nectar",
    "olive", "pebble", "quiver", "rocket", "shadow", "tulip", "vessel", "wagon", "yarn")
Q_SYSTEM = "You are a helpful assistant. Answer in one short sentence."


@dataclass(frozen=True)
class LoadConfig:
    trace: Path
    pairs: Path
    p_requests: int = 40
    scan_rows: int = 4000
    turns: int = 4
    max_ids: int = 32
    words_per_id: int = 6
    p_max_tokens: int = 4
    duplicates: int = 15
    negatives: int = 5
    repeats: int = 8
    q_max_tokens: int = 64
    seed: int = 0


@dataclass(frozen=True)
class PlannedRequest:
    """One chat request of the load."""

    tenant: str  # "P" or "Q"
    messages: tuple[tuple[str, str], ...]  # (role, content)
    question_class: str
    max_tokens: int

    def body(self, model: str) -> dict[str, Any]:
        return {"model": model, "temperature": 0, "max_tokens": self.max_tokens,
                "messages": [{"role": r, "content": c} for r, c in self.messages]}

    def message_dicts(self) -> list[dict[str, object]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def chunk_text(hash_id: int, num_words: int) -> str:
    """The deterministic text of one trace hash id (a leading space, a closing period)."""
    rng = random.Random(hash_id * 7919 + 17)
    return " " + " ".join(rng.choice(WORDS) for _ in range(num_words)) + "."


def trace_sessions(path: Path, config: LoadConfig) -> list[list[int]]:
    """The hash-id lists of tenant P's requests (see module doc), in trace order."""
    sessions: dict[tuple[int, int], list[tuple[float, list[int]]]] = {}
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= config.scan_rows:
                break
            row = json.loads(line)
            ids = [int(x) for x in row["hash_ids"]]
            if len(ids) >= 2:
                sessions.setdefault((ids[0], ids[1]), []).append((float(row["timestamp"]), ids))
    chosen: list[tuple[float, list[int]]] = []
    for turns in sessions.values():
        if len(turns) >= 3 and len(chosen) < config.p_requests:
            chosen += turns[: config.turns]
    chosen = sorted(chosen[: config.p_requests], key=lambda t: t[0])
    return [ids[: config.max_ids] for _, ids in chosen]


def p_requests(config: LoadConfig) -> list[PlannedRequest]:
    out = []
    for ids in trace_sessions(config.trace, config):
        text = "Context:" + "".join(chunk_text(h, config.words_per_id) for h in ids)
        out.append(PlannedRequest("P", (("user", text),), "p:" + ",".join(map(str, ids)),
                                  config.p_max_tokens))
    return out


def read_pairs(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def q_requests(config: LoadConfig, pairs: list[dict[str, Any]]) -> list[PlannedRequest]:
    rng = random.Random(config.seed)
    dup = [p for p in pairs if int(p["label"]) == 1 and p["text_a"] != p["text_b"]]
    neg = [p for p in pairs if int(p["label"]) == 0 and p["text_a"] != p["text_b"]]
    if len(dup) < config.duplicates or len(neg) < config.negatives:
        raise ValueError("the pairs file has too few label-1 or label-0 pairs")
    chosen = [(p, True) for p in rng.sample(dup, config.duplicates)]
    chosen += [(p, False) for p in rng.sample(neg, config.negatives)]
    classes: dict[str, str] = {}
    for i, (p, is_dup) in enumerate(chosen):
        classes.setdefault(p["text_a"], f"q:{i}a")
        classes.setdefault(p["text_b"], classes[p["text_a"]] if is_dup else f"q:{i}b")

    def ask(text: str) -> PlannedRequest:
        return PlannedRequest("Q", (("system", Q_SYSTEM), ("user", text)), classes[text],
                              config.q_max_tokens)

    first = [ask(p["text_a"]) for p, _ in chosen]
    rng.shuffle(first)
    later = [ask(p["text_b"]) for p, _ in chosen]
    later += [ask(p["text_a"]) for p, is_dup in chosen[: config.repeats] if is_dup]
    rng.shuffle(later)
    return first + later


def interleave(a: list[PlannedRequest], b: list[PlannedRequest],
               rng: random.Random) -> list[PlannedRequest]:
    """Both lists in their own order, merged at random (each next item drawn in
    proportion to what is left of each list)."""
    out: list[PlannedRequest] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if j >= len(b) or (i < len(a) and rng.random() < (len(a) - i) / (len(a) - i + len(b) - j)):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out


def build_load(config: LoadConfig) -> list[PlannedRequest]:
    """Tenant P's and Q's requests, interleaved, in send order."""
    return interleave(p_requests(config), q_requests(config, read_pairs(config.pairs)),
                      random.Random(config.seed + 1))
