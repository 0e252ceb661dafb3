"""Fine-tune all-MiniLM-L6-v2 as a pair classifier (the semantic cache's cross-encoder).

Input ``[CLS] a [SEP] b [SEP]`` (BERT pair encoding, ``--max-len`` tokens), a linear
head on the [CLS] state, binary cross-entropy. Each pair is shown in a random order each
epoch (the verifier averages nothing: it is trained to be symmetric by seeing both).

Data (none of it ships; only the weights do):
* the ``fit`` split of the clean QQP file (``qqp_split``; ``heldout`` is never read
  here, ``calib`` only by :mod:`bench.export_cross_encoder` for calibration);
* generated hard negatives: ``fit`` questions perturbed by templates (negation, numbers,
  units, swapped entities, from/to, opposite verbs, question word), label 0, see
  :func:`hard_negatives`;
* the ``split == "train"`` rows of bench/semantic/hard_cases.jsonl (``heldout`` rows are
  the held-out near-misses and paraphrases: never fitted), repeated ``--hard-repeat`` times.

Batches are length-bucketed (examples sorted by length inside chunks of 50 batches, the
batches shuffled) and padded to their own longest row. Seeded; a checkpoint
(``OUT/ckpt.pt``) is written every ``--ckpt-minutes`` and at every epoch's end, so a cut
run still leaves usable weights. ``--probe N`` trains N steps and prints seconds per step.

Usage: python bench/train_cross_encoder.py --out /tmp/ce [--epochs 1] [--max-minutes 45]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    # bench/ itself must not be on the path: bench/kernels.py shadows the ``kernels``
    # package that transformers probes for
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.semantic.evaluate import qqp_split

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QQP = ROOT.parent / "shared" / "data" / "qqp_pairs_clean_40k.jsonl"
HARD_CASES = ROOT / "bench" / "semantic" / "hard_cases.jsonl"

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


def batches(examples: Sequence[Example], batch_size: int, rng: random.Random,
            length: Any) -> list[list[Example]]:
    """Length-bucketed batches in a random order; each pair in a random order."""
    shown = [(a, b, y) if rng.random() < 0.5 else (b, a, y) for a, b, y in examples]
    rng.shuffle(shown)
    chunk = batch_size * 50
    out: list[list[Example]] = []
    for start in range(0, len(shown), chunk):
        part = sorted(shown[start : start + chunk], key=length)
        out.extend(part[i : i + batch_size] for i in range(0, len(part), batch_size))
    rng.shuffle(out)
    return out


def build_model(model_dir: Path) -> Any:
    from proxy.semantic.cross_encoder import PairClassifier

    return PairClassifier.from_pretrained_encoder(model_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=Path, default=DEFAULT_QQP)
    parser.add_argument("--hard-cases", type=Path, default=HARD_CASES)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=4e-5)
    parser.add_argument("--warmup", type=float, default=0.06)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--per-kind", type=int, default=700)
    parser.add_argument("--hard-repeat", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--ckpt-minutes", type=float, default=5.0)
    parser.add_argument("--probe", type=int, default=0, help="train N steps, print s/step")
    parser.add_argument("--bf16", action="store_true", help="autocast matmuls to bfloat16")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from proxy.semantic.embedder import bundled_model_path

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    from tokenizers import Tokenizer

    model_dir = bundled_model_path()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(args.max_len)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    model = build_model(model_dir)
    model.train()

    examples, counts = load_examples(args.pairs, args.hard_cases, args.seed, args.per_kind,
                                     args.hard_repeat)
    rng = random.Random(args.seed)
    steps_per_epoch = math.ceil(len(examples) / args.batch_size)
    total_steps = args.probe or max(1, int(steps_per_epoch * args.epochs))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, int(total_steps * args.warmup))

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (total_steps - step) / max(1, total_steps - warm))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def length(ex: Example) -> int:
        return len(ex[0]) + len(ex[1])

    def stream() -> Iterator[list[Example]]:
        while True:
            yield from batches(examples, args.batch_size, rng, length)

    print(json.dumps({"counts": counts, "steps_per_epoch": steps_per_epoch,
                      "total_steps": total_steps}), flush=True)
    started = time.monotonic()
    last_ckpt = started
    running = 0.0
    step = 0
    for step, batch in enumerate(stream()):
        if step >= total_steps:
            break
        enc = tokenizer.encode_batch([(a, b) for a, b, _ in batch])
        ids = torch.tensor([e.ids for e in enc])
        types = torch.tensor([e.type_ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        labels = torch.tensor([float(y) for _, _, y in batch])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(ids, mask, types)
        loss = loss_fn(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = 0.98 * running + 0.02 * float(loss) if step else float(loss)
        now = time.monotonic()
        if step % 20 == 0:
            print(json.dumps({"step": step, "loss": round(running, 4),
                              "s_per_step": round((now - started) / (step + 1), 3),
                              "epoch": round(step / steps_per_epoch, 3)}), flush=True)
        if (now - last_ckpt) / 60 >= args.ckpt_minutes or (step + 1) % steps_per_epoch == 0:
            _save(model, args, step + 1)
            last_ckpt = now
        if args.max_minutes is not None and (now - started) / 60 >= args.max_minutes:
            print(json.dumps({"stopped": "max-minutes", "step": step + 1}), flush=True)
            step += 1
            break
    else:  # pragma: no cover - the stream is endless
        pass
    elapsed = time.monotonic() - started
    if not args.probe:
        _save(model, args, step)
    print(json.dumps({"done": True, "steps": step, "seconds": round(elapsed, 1),
                      "s_per_step": round(elapsed / max(1, step), 3)}), flush=True)
    return 0


def _save(model: Any, args: argparse.Namespace, step: int) -> None:
    import torch

    tmp = args.out / "ckpt.pt.tmp"
    torch.save({"state_dict": model.state_dict(), "step": step, "max_len": args.max_len,
                "seed": args.seed}, tmp)
    tmp.replace(args.out / "ckpt.pt")


if __name__ == "__main__":
    raise SystemExit(main())
