"""Measured cost of a tree verification and of the EAGLE-style head's tree rows (issue 24).

Times, on one target and context, a target forward over T new tokens against a 1-token forward
(v_T, `spd.bench.costs.verify_fraction`; T = 1, 4, 17, 33 by default: a 1-token step, a k=3
chain, trees of budget 16 and 32) and one head forward of R tree rows against the same 1-token
target forward (`costs.head_rows_step`), each pair called in turn (interleaved medians). With no
--eagle the head is random: its cost does not depend on its weights.

    python scripts/eagle_tree_costs.py --model default --context 256 --threads 1
"""

from __future__ import annotations

import argparse
import json

import torch

from spd.baselines.eagle import EagleHead
from spd.baselines.load import load_head
from spd.bench import costs
from spd.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--eagle", default=None, help="a trained head (default: a random one, same cost)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", default="1,4,17,33")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_target(args.model)
    head = load_head(args.eagle, target, "eagle") if args.eagle else EagleHead.create(target).eval()
    out = {"model": args.model, "context": args.context, "threads": torch.get_num_threads(),
           "verify": {}, "head_rows": {}}
    for t in (int(x) for x in args.tokens.split(",")):
        v, many, one = costs.verify_fraction(target, args.context, t, args.reps)
        out["verify"][t] = {"fraction": round(v, 3), "ms": round(1e3 * many, 2), "one_token_ms": round(1e3 * one, 2)}
        print(f"target forward of {t:3d} tokens: {1e3 * many:7.2f} ms = {v:.2f} x a 1-token forward ({1e3 * one:.2f} ms)")
    for r in (int(x) for x in args.rows.split(",")):
        step = costs.head_rows_step(target, head, args.context, r)
        head_s, one = costs.interleaved_medians([step, costs.target_step(target, args.context)], args.reps)
        out["head_rows"][r] = {"fraction": round(head_s / one, 3), "ms": round(1e3 * head_s, 2)}
        print(f"head forward of {r:2d} rows: {1e3 * head_s:6.2f} ms = {head_s / one:.3f} of a 1-token target forward")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
