"""Held-out agreement of trained PDMs on one eval split: the points of a data-size curve.

Every PDM is measured on the same held-out sequences (the first --eval-head sequences of --data,
features from --cache), whatever data it was trained on; the split, anchors, body and draft
vocabulary come from each checkpoint. The cache must hold the PDMs' anchors.

    python scripts/heldout_agreement.py --model default --data runs/all.jsonl --eval-head 300 \\
        --cache runs/cache-4x --pdm src/spd/assets/pdm/smollm2-135m-n2-15-15 --pdm runs/pdm-n2-all
"""

from __future__ import annotations

import argparse
import json

import torch

from spd.train import TrainConfig
from spd.train.loop import evaluate_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--data", action="append", required=True, help="the training runs' data file(s)")
    parser.add_argument("--eval-head", type=int, required=True, help="held-out: the first K sequences")
    parser.add_argument("--cache", required=True, help="the runs' token + feature cache folder")
    parser.add_argument("--pdm", action="append", required=True, help="PDM checkpoint folder (repeat)")
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for folder in args.pdm:
        cfg = TrainConfig(model=args.model, data=tuple(args.data), out=folder, eval_head=args.eval_head,
                          cache=args.cache, batch_tokens=args.batch_tokens, progress=False)
        ev = evaluate_checkpoint(cfg, folder)  # reads the folder, writes nothing
        rows.append({"pdm": folder, **ev})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| PDM | held-out loss | agreement full / partial | tokens |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['pdm']} | {r['loss']:.3f} | {r['agreement_full']:.3f} / {r.get('agreement_partial', 0):.3f} "
              f"| {r['tokens']:,} |")


if __name__ == "__main__":
    main()
