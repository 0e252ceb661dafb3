"""Pack a trained pair-encoder checkpoint into the weights the package ships.

Reads ``ckpt.pt`` from ``bench/train_pair_encoder.py`` and writes
``proxy/semantic/data/pair_encoder.npz`` (matrices int8 per row with float16 scales,
vectors float32) and ``pair_encoder.json``: MiniLM's BERT config, the stacked logistic
weights, the threshold and the recall-first similarity floor, all fitted on the
**calib** split of the clean QQP file (``qqp_split``; ``fit`` trained the model,
``heldout`` stays unseen), with the shipped (int8) model:

* ``stack``: :class:`proxy.semantic.verifier.LogisticVerifier` weights over the guard
  features with the tuned cosine as the similarity (``bench.semantic_train.fit_weights``),
  fitted on the calib pairs scored as the cache scores them (query ``text_b`` against
  cached ``text_a``), the train half of the hand-written cases (``--hand-weight``) and
  template near-misses of calib questions (:func:`bench.cross_encoder_data.hard_negatives`);
* ``min_similarity``: the index cosine (the pair encoder is the index's embedder, so
  the tuned cosine) that keeps ``--min-sim-recall`` of the calib duplicates (rounded
  down to 0.01);
* ``threshold``: per query, as the cache decides: every ``text_a`` of the file stored,
  each calib ``text_b`` finds its ``--candidates`` nearest (exact tuned cosine), those above the
  floor are scored, the best is served when it reaches the threshold; the lowest
  threshold whose served calib queries reach ``--target-precision`` (at least 50 of
  them), else the lowest whose calib *pairs* reach ``--pairwise-target``.

Usage: python bench/export_pair_encoder.py --ckpt /tmp/pe/ckpt.pt [--out proxy/semantic/data]
       [--vectors-cache DIR] [--target-precision 0.95]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from bench.cross_encoder_data import hard_negatives
from bench.export_cross_encoder import choose_threshold, nearest, similarity_floor
from bench.semantic.evaluate import qqp_split, read_pairs
from bench.semantic.pair_metrics import average_precision, roc_auc
from proxy.semantic.cross_encoder import pack_state
from proxy.semantic.pair_encoder import CONFIG_FILE, WEIGHTS_FILE, PairEncoder, PairEncoderConfig

ROOT = Path(__file__).resolve().parents[1]
HARD_CASES = ROOT / "bench" / "semantic" / "hard_cases.jsonl"
DEFAULT_QQP = ROOT.parent / "shared" / "data" / "qqp_pairs_clean_40k.jsonl"
DEFAULT_OUT = ROOT / "proxy" / "semantic" / "data"


def export(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.semantic.evaluate import embed_cached
    from bench.semantic_train import Example, fit_weights
    from proxy.semantic.embedder import SentenceTransformerEmbedder, bundled_model_path, embed_many
    from proxy.semantic.verifier import LogisticVerifier, exact_repeat

    torch.set_num_threads(args.threads)
    ckpt = torch.load(args.ckpt, map_location="cpu", weights_only=True)
    arrays = pack_state({k: v.float().numpy() for k, v in ckpt["state_dict"].items()
                         if k != "embeddings.position_ids"})  # fmt: skip
    bert = json.loads((bundled_model_path() / "config.json").read_text())
    bert = {k: v for k, v in bert.items() if not k.startswith("_")}
    pairs = read_pairs(args.pairs)
    calib = [i for i, p in enumerate(pairs) if qqp_split(p.text_a, p.text_b) == "calib"]
    rows = [pairs[i] for i in calib]
    labels = np.asarray([p.label for p in rows], dtype=np.int64)

    base = SentenceTransformerEmbedder()
    own_base = np.sum(embed_cached(base, [p.text_a for p in rows], args.vectors_cache)
                      * embed_cached(base, [p.text_b for p in rows], args.vectors_cache), axis=1)
    draft = PairEncoderConfig(bert, int(ckpt.get("max_len", 64)), 0.0, {})
    model = PairEncoder(draft, arrays)
    stored = embed_cached(model, [p.text_a for p in pairs], args.vectors_cache)
    asked = embed_cached(model, [p.text_b for p in rows], args.vectors_cache)
    floor = similarity_floor(np.sum(stored[calib] * asked, axis=1), labels, args.min_sim_recall)
    idx, sim = nearest(stored, asked, args.candidates)
    candidates = [[(int(j), float(s)) for j, s in zip(idx[r], sim[r], strict=True) if s >= floor]
                  for r in range(len(rows))]  # fmt: skip
    hand = [json.loads(line) for line in HARD_CASES.read_text().splitlines() if line.strip()]
    hand = [h for h in hand if h["split"] == "train"]
    questions = sorted({t for p in rows for t in (p.text_a, p.text_b)})
    generated = hard_negatives(questions, args.seed, args.per_kind)
    texts = sorted({p.text_b for p in rows} | {pairs[calib[r]].text_a for r in range(len(rows))}
                   | {pairs[j].text_a for cs in candidates for j, _ in cs}
                   | {t for h in hand for t in (h["text_a"], h["text_b"])}
                   | {t for a, b, _ in generated for t in (a, b)})  # fmt: skip
    known = dict(zip([p.text_a for p in pairs], stored, strict=True))
    known.update(zip([p.text_b for p in rows], asked, strict=True))
    rest = [t for t in texts if t not in known]
    known.update(zip(rest, embed_many(model, rest), strict=True))

    def tuned(a: str, b: str) -> float:
        return float(known[a] @ known[b])

    examples = [Example(p.text_b, p.text_a, tuned(p.text_b, p.text_a), p.label, 1.0) for p in rows]
    examples += [Example(h["text_b"], h["text_a"], tuned(h["text_b"], h["text_a"]),
                         int(h["label"]), args.hand_weight) for h in hand]  # fmt: skip
    examples += [Example(b, a, tuned(b, a), 0, 1.0) for a, b, _ in generated]
    weights = fit_weights(examples, "pair-encoder")
    stack = LogisticVerifier(weights)
    own_tuned = np.asarray([tuned(p.text_b, p.text_a) for p in rows])

    def score(r: int, j: int, s: float) -> float:
        return stack.score(rows[r].text_b, pairs[j].text_a, tuned(rows[r].text_b, pairs[j].text_a))

    best, right = [], []
    for r, cs in enumerate(candidates):
        if cs:
            value, j = max((score(r, j, s), j) for j, s in cs)
            best.append(value)
            right.append((j == calib[r] and rows[r].label == 1)
                         or exact_repeat(rows[r].text_b, pairs[j].text_a))  # fmt: skip
    best_arr, right_arr = np.asarray(best), np.asarray(right, dtype=np.int64)
    probs = np.asarray([stack.score(p.text_b, p.text_a, t) for p, t in zip(rows, own_tuned,
                                                                            strict=True)])
    try:
        threshold = choose_threshold(best_arr, right_arr, args.target_precision)
        rule = f"per-query precision >= {args.target_precision} on calib"
    except ValueError as exc:
        print(f"note: {exc}; threshold from pairwise precision >= {args.pairwise_target}",
              file=sys.stderr)  # fmt: skip
        rule = "pairwise precision >= {} on calib (per-query unreachable: own-pair rule)"
        for target in (args.pairwise_target, 0.9):  # the fallback when even that is out of reach
            try:
                threshold = choose_threshold(probs, labels, target)
                rule = rule.format(target)
                break
            except ValueError as again:
                print(f"note: {again}", file=sys.stderr)
        else:
            raise RuntimeError("no usable threshold on calib")
    served = best_arr >= threshold
    meta: dict[str, Any] = {
        "checkpoint_step": int(ckpt.get("step", 0)),
        "seed": int(ckpt.get("seed", 0)),
        "trained_by": "bench/train_pair_encoder.py",
        "exported_by": "bench/export_pair_encoder.py",
        "calib": {
            "pairs": len(rows),
            "positives": int(labels.sum()),
            "stored_prompts": len(pairs),
            "candidates": args.candidates,
            "threshold_rule": rule,
            "min_sim_recall": args.min_sim_recall,
            "per_query_precision": round(float(right_arr[served].mean()), 4),
            "per_query_recall": round(float(right_arr[served].sum() / labels.sum()), 4),
            "pairwise_average_precision": round(average_precision(probs, labels), 4),
            "pairwise_roc_auc": round(roc_auc(probs, labels), 4),
            "tuned_cosine_average_precision": round(average_precision(own_tuned, labels), 4),
            "base_cosine_average_precision": round(average_precision(own_base, labels), 4),
        },
    }
    meta["stack_examples"] = {"calib_pairs": len(rows), "hand": len(hand),
                              "generated_negatives": len(generated)}  # fmt: skip
    stack_json = dataclasses.replace(weights, threshold=threshold, min_similarity=floor).to_json()
    config = PairEncoderConfig(bert, draft.max_len, floor, stack_json, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / WEIGHTS_FILE, allow_pickle=False, **arrays)
    (args.out / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=1) + "\n")
    return {"out": str(args.out), "weights_bytes": (args.out / WEIGHTS_FILE).stat().st_size,
            "threshold": threshold, "min_similarity": floor, **meta}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_QQP)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--target-precision", type=float, default=0.95)
    parser.add_argument("--pairwise-target", type=float, default=0.95)
    parser.add_argument("--min-sim-recall", type=float, default=0.98)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--vectors-cache", type=Path, default=None)
    parser.add_argument("--hand-weight", type=float, default=5.0,
                        help="sample weight of each hand-written train case in the stack")
    parser.add_argument("--per-kind", type=int, default=0,
                        help="template near-misses of calib questions per kind (stack)")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if not args.ckpt.is_file():
        print(f"error: --ckpt: no such file: {args.ckpt}", file=sys.stderr)
        return 2
    if not 0 < args.target_precision < 1 or not 0 < args.min_sim_recall <= 1:
        print("error: --target-precision and --min-sim-recall must be in (0, 1)", file=sys.stderr)
        return 2
    print(json.dumps(export(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
