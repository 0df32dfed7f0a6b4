"""Regression gate for the PDMs that ship with spd for the embedded default target.

Each shipped PDM loads onto SmolLM2-135M-Instruct, decodes the release prompts token-identically
to AR, and accepts at least the per-draft rate recorded at release (scripts/release_pdm.py)
minus a small margin for floating-point differences between machines.
"""

import json

import pytest

from conftest import load_script, needs_default_target
from spd.shipped import ASSETS, shipped_pdm, shipped_pdm_dir

SHIPPED = sorted(p for p in ASSETS.glob("*") if (p / "pdm_config.json").is_file()) if ASSETS.exists() else []
MARGIN = 0.05
BUDGET_BYTES = 60 * 10**6  # the budget: all shipped checkpoints together <= 60 MB

pytestmark = needs_default_target


def test_pdms_ship_for_n2_and_n4():
    names = {p.name for p in SHIPPED}
    assert {"smollm2-135m-n2-15-15", "smollm2-135m-n4-8-8-7-7"} <= names
    total = sum(f.stat().st_size for p in SHIPPED for f in p.iterdir())
    assert total <= BUDGET_BYTES, f"shipped PDMs take {total / 1e6:.1f} MB (budget 60 MB)"
    # `--model default` finds each by its split (n=2 when no split is asked)
    assert shipped_pdm("default", None, None) == str(ASSETS / "smollm2-135m-n2-15-15")
    assert shipped_pdm("default", 4, None) == str(ASSETS / "smollm2-135m-n4-8-8-7-7")
    # another split where every depth reaches the same anchors drafts alike: the PDM is found
    assert shipped_pdm("default", 4, [10, 10, 5, 5]) == str(ASSETS / "smollm2-135m-n4-8-8-7-7")
    assert shipped_pdm("default", 4, [5, 5, 10, 10]) is None
    assert shipped_pdm("some/other-model", 2, None) is None


@pytest.mark.parametrize("folder", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_pdm_accepts_as_released(default_target, default_ar, folder):
    from spd.checkpoint import load_pdm
    from spd.drafters import PDMDrafter
    from spd.engine import generate
    from spd.loading import encode_prompt
    from spd.target import split_layers

    target, tokenizer = default_target
    pdm = load_pdm(folder, target)
    assert shipped_pdm_dir(list(pdm.config.stage_layers)) == folder  # named by its split
    release = json.loads((folder / "pdm_config.json").read_text())["extra"]["release"]
    script = load_script("release_pdm")
    assert [row["prompt"] for row in release["prompts"]] == script.REGRESSION_PROMPTS
    assert release["max_new_tokens"] == script.MAX_NEW_TOKENS
    stages = split_layers(target.num_layers, pdm.config.n_stages, list(pdm.config.stage_layers))
    for row in release["prompts"]:
        ids = encode_prompt(tokenizer, row["prompt"])
        result = generate(target, PDMDrafter(pdm), ids, stages, max_new_tokens=release["max_new_tokens"])
        assert result.tokens == default_ar(ids, release["max_new_tokens"])
        assert result.stats.per_draft_acceptance >= row["per_draft_acceptance"] - MARGIN, row["prompt"]
