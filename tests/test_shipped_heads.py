"""Regression gate for the baseline heads that ship for the embedded default target (issue 24).

Each shipped head (scripts/release_head.py) loads onto SmolLM2-135M-Instruct, decodes the release
prompts token-identically to AR, and accepts at least the per-draft rate recorded at release minus
a small margin for floating-point differences between machines. The shipped assets together stay
small enough for the installed package to be under 100 MB.
"""

import json

import pytest

from conftest import load_script, needs_default_target
from spd.shipped import ASSETS, HEAD_ASSETS, shipped_head

HEADS = sorted(p for p in HEAD_ASSETS.glob("*") if (p / "head_config.json").is_file()) if HEAD_ASSETS.exists() else []
MARGIN = 0.05
ASSET_BUDGET_BYTES = 90 * 10**6   # PDMs + heads; the code and metadata take the rest of 100 MB


def test_shipped_assets_fit_the_package_budget():
    total = sum(f.stat().st_size for root in (ASSETS, HEAD_ASSETS) if root.exists()
                for f in root.rglob("*") if f.is_file())
    assert total <= ASSET_BUDGET_BYTES, f"shipped assets take {total / 1e6:.1f} MB (budget 90 MB)"
    for folder in HEADS:   # `spd bench run --model default` finds each head by its method (and n)
        meta = json.loads((folder / "head_config.json").read_text())
        n = len(meta["config"]["stage_layers"]) if meta["method"] == "ppsd" else None
        assert shipped_head("default", meta["method"], n) == str(folder)


@needs_default_target
@pytest.mark.parametrize("folder", HEADS, ids=[p.name for p in HEADS])
def test_shipped_head_accepts_as_released(default_target, default_ar, folder):
    from spd.baselines.load import load_head
    from spd.loading import encode_prompt

    target, tokenizer = default_target
    script = load_script("release_head")
    head = load_head(folder, target)
    assert folder.name == script.shipped_name(head)
    release = head.config.extra["release"]
    assert [row["prompt"] for row in release["prompts"]] == script.REGRESSION_PROMPTS
    for row in release["prompts"]:
        ids = encode_prompt(tokenizer, row["prompt"])
        tokens, counts = script.decode(target, head, ids)
        assert tokens == default_ar(ids, release["max_new_tokens"])
        assert counts["per_draft_acceptance"] >= row["per_draft_acceptance"] - MARGIN, row["prompt"]
