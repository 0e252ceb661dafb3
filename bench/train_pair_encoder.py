"""Fine-tune all-MiniLM-L6-v2 as a siamese pair scorer (the verifier's encoder).

The cross-encoder (bench/train_cross_encoder.py) starts from a fresh head and learns
slowly from the 27k fit pairs: after 200 steps of 32 its calib AP (0.63) is still below
plain cosine's (0.72). A siamese fine-tune starts *at* cosine and moves from there:
each text is encoded alone (mean pooling, L2-normalised, as the embedder does) and the
pair's score is the cosine of the two vectors.

Loss, per batch of labelled pairs: CoSENT (every label-1 pair's cosine should exceed
every label-0 pair's: ``log(1 + sum exp(scale * (cos_neg - cos_pos)))``, which is the
ranking that average precision measures) plus multiple-negatives ranking on the label-1
pairs (each text's duplicate against every other text of the batch, both directions),
which keeps the space a retrieval space. ``--bf16`` autocasts to bfloat16 (AMX).

Data: :mod:`bench.cross_encoder_data` (the ``fit`` split of the clean QQP file, template
hard negatives, the train half of the hand-written cases; ``heldout`` is never read).
``--eval-every N`` prints AP / ROC AUC on a seeded sample of the **calib** split
(monitoring only). Checkpoints (``OUT/ckpt.pt``, the encoder's state dict) every
``--ckpt-minutes`` and at the end; ``bench/export_pair_encoder.py`` packs one.

Usage: python bench/train_pair_encoder.py --out /tmp/pe --bf16 [--epochs 2] [--max-minutes 60]
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
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.cross_encoder_data import Example, load_examples
from bench.train_cross_encoder import DEFAULT_QQP, HARD_CASES, batches, calib_sample


def encode(model: Any, tokenizer: Any, texts: Sequence[str]) -> Any:
    """Mean-pooled, L2-normalised vectors of ``texts`` (one padded batch)."""
    import torch

    enc = tokenizer.encode_batch(list(texts))
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    states = model(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).to(states.dtype)
    pooled = (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def pair_loss(va: Any, vb: Any, labels: Any, scale: float) -> Any:
    """CoSENT on the labelled pairs plus multiple-negatives ranking on the label-1 ones."""
    import torch

    cos = (va * vb).sum(-1) * scale
    diff = cos[None, :] - cos[:, None]  # [i, j] = cos_j - cos_i: wanted negative where
    wanted = (labels[:, None] > labels[None, :]).float()  # i is label 1 and j label 0
    diff = diff - (1.0 - wanted) * 1e12
    cosent = torch.logsumexp(torch.cat([torch.zeros(1), diff.flatten()]), dim=0)
    pos = labels > 0.5
    if int(pos.sum()) < 2:
        return cosent
    a, b = va[pos], vb[pos]
    sims = torch.cat([a, b]) @ torch.cat([a, b]).T * scale  # every text against every text
    n = a.shape[0]
    sims = sims - torch.eye(2 * n) * 1e12  # never a text against itself
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    return cosent + torch.nn.functional.cross_entropy(sims, target)


def evaluate(model: Any, tokenizer: Any, sample: Sequence[Example], bf16: bool) -> dict[str, float]:
    """Pairwise AP and ROC AUC of the cosine on ``sample`` (monitoring)."""
    import numpy as np
    import torch

    from bench.semantic.pair_metrics import average_precision, roc_auc

    scores = np.zeros(len(sample))
    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for start in range(0, len(sample), 64):
            part = sample[start : start + 64]
            va = encode(model, tokenizer, [a for a, _, _ in part])
            vb = encode(model, tokenizer, [b for _, b, _ in part])
            scores[start : start + len(part)] = (va * vb).sum(-1).numpy()
    model.train()
    labels = [y for _, _, y in sample]
    return {"ap": round(average_precision(scores, labels), 4),
            "auc": round(roc_auc(scores, labels), 4)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=Path, default=DEFAULT_QQP)
    parser.add_argument("--hard-cases", type=Path, default=HARD_CASES)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--warmup", type=float, default=0.1)
    parser.add_argument("--scale", type=float, default=20.0, help="cosine scale in the losses")
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--per-kind", type=int, default=700)
    parser.add_argument("--hard-repeat", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--ckpt-minutes", type=float, default=5.0)
    parser.add_argument("--bf16", action="store_true", help="autocast matmuls to bfloat16")
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--eval-pairs", type=int, default=800)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import BertModel

    from proxy.semantic.embedder import bundled_model_path

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = bundled_model_path()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(args.max_len)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    model = BertModel.from_pretrained(str(model_dir), add_pooling_layer=False,
                                      local_files_only=True)  # fmt: skip
    model.train()
    examples, counts = load_examples(args.pairs, args.hard_cases, args.seed, args.per_kind,
                                     args.hard_repeat)  # fmt: skip
    sample = calib_sample(args.pairs, args.eval_pairs, args.seed) if args.eval_every else []
    rng = random.Random(args.seed)
    steps_per_epoch = math.ceil(len(examples) / args.batch_size)
    total_steps = max(1, int(steps_per_epoch * args.epochs))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, int(total_steps * args.warmup))
    def lr_at(s: int) -> float:
        return (s + 1) / warm if s < warm else max(0.0, (total_steps - s) / (total_steps - warm))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)

    def stream() -> Iterator[list[Example]]:
        while True:  # length buckets by the longer text: both sides pad to their own batch
            yield from batches(examples, args.batch_size, rng, lambda e: max(len(e[0]), len(e[1])))

    print(json.dumps({"counts": counts, "steps_per_epoch": steps_per_epoch,
                      "total_steps": total_steps}), flush=True)  # fmt: skip
    started = last_ckpt = time.monotonic()
    running, step = 0.0, 0
    for step, batch in enumerate(stream()):
        if step >= total_steps:
            break
        if args.eval_every and step % args.eval_every == 0:
            result = evaluate(model, tokenizer, sample, args.bf16)
            print(json.dumps({"step": step, "eval": result}), flush=True)
        labels = torch.tensor([float(y) for _, _, y in batch])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            va = encode(model, tokenizer, [a for a, _, _ in batch])
            vb = encode(model, tokenizer, [b for _, b, _ in batch])
        loss = pair_loss(va, vb, labels, args.scale)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = 0.98 * running + 0.02 * float(loss.detach()) if step else float(loss.detach())
        now = time.monotonic()
        if step % 20 == 0:
            print(json.dumps({"step": step, "loss": round(running, 4),
                              "s_per_step": round((now - started) / (step + 1), 3),
                              "epoch": round(step / steps_per_epoch, 3)}), flush=True)  # fmt: skip
        if (now - last_ckpt) / 60 >= args.ckpt_minutes:
            _save(model, args, step + 1)
            last_ckpt = now
        if args.max_minutes is not None and (now - started) / 60 >= args.max_minutes:
            print(json.dumps({"stopped": "max-minutes", "step": step + 1}), flush=True)
            step += 1
            break
    _save(model, args, step)
    if args.eval_every:
        print(json.dumps({"step": step, "eval": evaluate(model, tokenizer, sample, args.bf16)}))
    print(json.dumps({"done": True, "steps": step,
                      "seconds": round(time.monotonic() - started, 1)}), flush=True)  # fmt: skip
    return 0


def _save(model: Any, args: argparse.Namespace, step: int) -> None:
    import torch

    tmp = args.out / "ckpt.pt.tmp"
    torch.save({"state_dict": model.state_dict(), "step": step, "max_len": args.max_len,
                "seed": args.seed, "kind": "pair-encoder"}, tmp)  # fmt: skip
    tmp.replace(args.out / "ckpt.pt")


if __name__ == "__main__":
    raise SystemExit(main())
