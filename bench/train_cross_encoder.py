"""Fine-tune all-MiniLM-L6-v2 as a pair classifier (the semantic cache's cross-encoder).

Input ``[CLS] a [SEP] b [SEP]`` (BERT pair encoding, ``--max-len`` tokens), a linear
head on the [CLS] state or on the mean of all token states (``--pool mean``, the
embedder's own pooling), binary cross-entropy. Each pair is shown in a random order each
epoch, or in both orders (``--both-orders``): the verifier reads (query, cached prompt)
and is trained to be symmetric by seeing both. ``--bf16`` autocasts to bfloat16 (AMX).

Data: :mod:`bench.cross_encoder_data` (the ``fit`` split of the clean QQP file, template
hard negatives, the train half of the hand-written cases; ``heldout`` is never read).
``--eval-every N`` prints AP / ROC AUC on a seeded sample of the **calib** split every N
steps (monitoring only: thresholds and calibration are the exporter's).

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
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    # bench/ itself must not be on the path: bench/kernels.py shadows the ``kernels``
    # package that transformers probes for
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.cross_encoder_data import Example, load_examples
from bench.semantic.evaluate import qqp_split

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QQP = ROOT.parent / "shared" / "data" / "qqp_pairs_clean_40k.jsonl"
HARD_CASES = ROOT / "bench" / "semantic" / "hard_cases.jsonl"


def batches(examples: Sequence[Example], batch_size: int, rng: random.Random,
            length: Any, both_orders: bool = False) -> list[list[Example]]:
    """Length-bucketed batches in a random order; each pair in a random order (or in
    both orders)."""
    if both_orders:
        shown = [*examples, *((b, a, y) for a, b, y in examples)]
    else:
        shown = [(a, b, y) if rng.random() < 0.5 else (b, a, y) for a, b, y in examples]
    rng.shuffle(shown)
    chunk = batch_size * 50
    out: list[list[Example]] = []
    for start in range(0, len(shown), chunk):
        part = sorted(shown[start : start + chunk], key=length)
        out.extend(part[i : i + batch_size] for i in range(0, len(part), batch_size))
    rng.shuffle(out)
    return out


def build_model(model_dir: Path, pool: str) -> Any:
    from proxy.semantic.cross_encoder import PairClassifier

    return PairClassifier.from_pretrained_encoder(model_dir, pool)  # type: ignore[arg-type]


def calib_sample(qqp: Path, size: int, seed: int) -> list[Example]:
    """``size`` calib pairs (seeded), asked as the cache asks: (text_b, text_a)."""
    rows = [json.loads(line) for line in qqp.read_text().splitlines() if line.strip()]
    calib = [(r["text_b"], r["text_a"], int(r["label"])) for r in rows
             if qqp_split(r["text_a"], r["text_b"]) == "calib"]
    return random.Random(seed).sample(calib, min(size, len(calib)))


def evaluate(model: Any, tokenizer: Any, sample: Sequence[Example], bf16: bool) -> dict[str, float]:
    """Pairwise average precision and ROC AUC of the model on ``sample`` (monitoring)."""
    import numpy as np
    import torch

    from bench.semantic.pair_metrics import average_precision, roc_auc

    order = sorted(range(len(sample)), key=lambda i: len(sample[i][0]) + len(sample[i][1]))
    scores = np.zeros(len(sample))
    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for start in range(0, len(order), 64):
            idx = order[start : start + 64]
            enc = tokenizer.encode_batch([(sample[i][0], sample[i][1]) for i in idx])
            logits = model(torch.tensor([e.ids for e in enc]),
                           torch.tensor([e.attention_mask for e in enc]),
                           torch.tensor([e.type_ids for e in enc]))
            scores[idx] = logits.float().numpy()
    model.train()
    labels = [y for _, _, y in sample]
    return {"ap": round(average_precision(scores, labels), 4),
            "auc": round(roc_auc(scores, labels), 4)}


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
    parser.add_argument("--both-orders", action="store_true",
                        help="each epoch shows every pair as (a, b) and as (b, a)")
    parser.add_argument("--pool", choices=("cls", "mean"), default="cls")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="every N steps, AP/AUC on --eval-pairs calib pairs (monitoring)")
    parser.add_argument("--eval-pairs", type=int, default=1000)
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
    model = build_model(model_dir, args.pool)
    model.train()
    sample = calib_sample(args.pairs, args.eval_pairs, args.seed) if args.eval_every else []

    examples, counts = load_examples(args.pairs, args.hard_cases, args.seed, args.per_kind,
                                     args.hard_repeat)
    rng = random.Random(args.seed)
    steps_per_epoch = math.ceil(len(examples) * (2 if args.both_orders else 1) / args.batch_size)
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
            yield from batches(examples, args.batch_size, rng, length, args.both_orders)

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
        if args.eval_every and step % args.eval_every == 0:
            print(json.dumps({"step": step, "eval": evaluate(model, tokenizer, sample, args.bf16)}),
                  flush=True)
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
                "seed": args.seed, "pool": args.pool}, tmp)
    tmp.replace(args.out / "ckpt.pt")


if __name__ == "__main__":
    raise SystemExit(main())
