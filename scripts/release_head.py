"""Ship a trained baseline head (EAGLE-style or PPSD) for the embedded default target.

Saves the head from a `spd train --method eagle|ppsd --out RUN` folder into
src/spd/assets/heads/ (smollm2-135m-eagle, smollm2-135m-ppsd-n<N>) in bfloat16, without the
frozen lm_head rows (loading copies them from the target), reloads it as users will, decodes
release_pdm's regression prompts greedily (EAGLE-style: chains of k = 5) and checks the tokens
against AR, and records the release acceptance in the config's `extra.release`
(tests/test_shipped_heads.py holds the head to it). `spd bench run --model default` then uses it.

    python scripts/release_head.py runs/eagle --train-command "spd train ..."
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))   # release_pdm, also when imported by the tests
from release_pdm import MAX_NEW_TOKENS, REGRESSION_PROMPTS  # noqa: E402
from spd.baselines.ar import ar_generate  # noqa: E402
from spd.baselines.eagle import eagle_generate  # noqa: E402
from spd.baselines.heads import CONFIG, WEIGHTS, save_head  # noqa: E402
from spd.baselines.load import load_head  # noqa: E402
from spd.baselines.ppsd import PPSDDrafter  # noqa: E402
from spd.engine import generate  # noqa: E402
from spd.loading import encode_prompt  # noqa: E402
from spd.shipped import HEAD_ASSETS  # noqa: E402
from spd.target import load_target, split_layers  # noqa: E402

EAGLE_K = 5


def decode(target, head, ids: list[int]) -> tuple[list[int], dict]:
    """Greedy tokens and acceptance of one regression prompt with the head's own method."""
    if head.METHOD == "eagle":
        tokens, s = eagle_generate(target, head, ids, EAGLE_K, max_new_tokens=MAX_NEW_TOKENS)
        return tokens, {"k": EAGLE_K, "rounds": s.rounds, "accepted": s.accepted,
                        "per_draft_acceptance": round(s.per_draft_acceptance, 4),
                        "mean_accepted_length": round(s.mean_accepted_length, 4)}
    stage_layers = list(head.config.stage_layers)
    stages = split_layers(target.num_layers, len(stage_layers), stage_layers)
    result = generate(target, PPSDDrafter(head), ids, stages, max_new_tokens=MAX_NEW_TOKENS)
    s = result.stats
    return result.tokens, {"cycles": s.cycles, "accepted": s.accepted,
                           "per_draft_acceptance": round(s.per_draft_acceptance, 4),
                           "equivalent_accept_length": round(s.equivalent_accept_length, 4)}


def measure(target, tokenizer, head) -> list[dict]:
    rows = []
    for prompt in REGRESSION_PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        tokens, counts = decode(target, head, ids)
        if tokens != ar_generate(target, ids, max_new_tokens=MAX_NEW_TOKENS)[0]:
            sys.exit(f"{head.METHOD} output differs from AR on {prompt!r}: not releasing")
        rows.append({"prompt": prompt, "new_tokens": len(tokens), **counts})
    return rows


def shipped_name(head) -> str:
    return "smollm2-135m-eagle" if head.METHOD == "eagle" else f"smollm2-135m-ppsd-n{head.config.n_stages}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="spd train --method eagle|ppsd --out folder")
    ap.add_argument("--train-command", default="", help="the spd train command line, for the record")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_target("default")
    head = load_head(args.run, target)
    summary = args.run / "train_summary.json"
    training = json.loads(summary.read_text()) if summary.exists() else {}
    if training.get("interrupted") is not None:
        sys.exit(f"{args.run} did not finish training ({training['interrupted']}): resume it first")
    head.config = replace(head.config, extra={**head.config.extra, "training": training,
                                              "train_command": args.train_command})
    dest = HEAD_ASSETS / shipped_name(head)
    if dest.exists():
        shutil.rmtree(dest)
    save_head(head, dest, dtype=torch.bfloat16, target=target)
    shipped = load_head(dest, target)   # what users get: bf16 weights cast to the target's dtype
    release = {"max_new_tokens": MAX_NEW_TOKENS, "prompts": measure(target, tokenizer, shipped)}
    meta = json.loads((dest / CONFIG).read_text())
    meta["config"]["extra"]["release"] = release
    (dest / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(release, indent=2))
    print(f"shipped {dest} ({(dest / WEIGHTS).stat().st_size / 2**20:.1f} MiB of weights)")


if __name__ == "__main__":
    main()
