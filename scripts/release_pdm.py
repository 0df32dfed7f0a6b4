"""Ship a trained PDM for the embedded default target: bf16 weights into src/spd/assets/pdm/.

Saves the checkpoint from a `spd train --out RUN` folder in bfloat16 (small enough to commit),
reloads it as users will, decodes the fixed regression prompts greedily with the engine and AR,
and records the release acceptance in the config's `extra.release` (the regression gate in
tests/test_shipped_pdms.py compares against it).

    python scripts/release_pdm.py runs/pdm-n2 --train-command "spd train ..."
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

from spd.baselines.ar import ar_generate
from spd.checkpoint import CONFIG, load_pdm, save_pdm
from spd.drafters import PDMDrafter
from spd.engine import generate
from spd.loading import encode_prompt
from spd.shipped import shipped_pdm_dir
from spd.target import load_target, split_layers

REGRESSION_PROMPTS = [
    "Write a short poem about the sea.",
    "What is 17 times 23? Explain step by step.",
    "Write a Python function that checks whether a number is prime.",
]
MAX_NEW_TOKENS = 48


def measure(target, tokenizer, pdm) -> list[dict]:
    stages = split_layers(target.num_layers, pdm.config.n_stages, list(pdm.config.stage_layers))
    rows = []
    for prompt in REGRESSION_PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        result = generate(target, PDMDrafter(pdm), ids, stages, max_new_tokens=MAX_NEW_TOKENS)
        ar, _ = ar_generate(target, ids, max_new_tokens=MAX_NEW_TOKENS)
        if result.tokens != ar:
            sys.exit(f"engine output differs from AR on {prompt!r}: not releasing")
        s = result.stats
        rows.append({"prompt": prompt, "new_tokens": s.new_tokens, "cycles": s.cycles,
                     "accepted": s.accepted, "per_draft_acceptance": round(s.per_draft_acceptance, 4),
                     "equivalent_accept_length": round(s.equivalent_accept_length, 4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="spd train --out folder")
    ap.add_argument("--train-command", default="", help="the spd train command line, for the record")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_target("default")
    pdm = load_pdm(args.run, target)
    summary = args.run / "train_summary.json"
    training = json.loads(summary.read_text()) if summary.exists() else {}
    if training.get("interrupted") is not None:   # before the shipped copy is removed
        sys.exit(f"{args.run} did not finish training ({training['interrupted']}): resume it first")
    dest = shipped_pdm_dir(list(pdm.config.stage_layers))
    if dest.exists():
        shutil.rmtree(dest)
    pdm.config = replace(pdm.config, extra={**pdm.config.extra, "training": training,
                                            "train_command": args.train_command})
    save_pdm(pdm, dest, dtype=torch.bfloat16)
    shipped = load_pdm(dest, target)  # what users get: bf16 weights cast to the target's dtype
    release = {"max_new_tokens": MAX_NEW_TOKENS, "prompts": measure(target, tokenizer, shipped)}
    config = json.loads((dest / CONFIG).read_text())
    config["extra"]["release"] = release
    (dest / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    size = sum(f.stat().st_size for f in dest.iterdir()) / 2**20
    print(json.dumps(release, indent=2))
    print(f"shipped {dest} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
