"""`spd demo`: the embedded default target with its shipped PDM, next to plain AR decoding.

Streams SPD's text for a built-in prompt, then decodes the same prompt autoregressively and
prints both runs' statistics side by side (tokens identical, cycles, acceptance, speed).
"""

from __future__ import annotations

import sys

from .baselines.ar import ar_generate
from .engine import generate
from .loading import build_decoder, encode_prompt
from .sampling import SamplingParams
from .shipped import demo_pdm

PROMPT = "Explain in a few sentences why the sky is blue, then give one everyday example."


def run_demo(stages: int = 2, prompt: str = PROMPT, max_new_tokens: int = 128, on_text=None,
             drafter: str = "hybrid") -> dict:
    """Decode `prompt` with SPD (shipped PDM) and AR on the default target; return both stats."""
    pdm_path = demo_pdm(stages)
    dec = build_decoder("default", stages=stages, pdm_path=pdm_path, drafter=drafter)
    ids = encode_prompt(dec.tokenizer, prompt)
    shown = []

    def on_token(token):
        shown.append(token)
        if on_text is not None:
            on_text(dec.tokenizer.decode(shown, skip_special_tokens=True))

    result = generate(dec.target, dec.drafter(), ids, dec.stages, SamplingParams(), max_new_tokens,
                      on_token=on_token)
    ar_tokens, ar_stats = ar_generate(dec.target, ids, SamplingParams(), max_new_tokens)
    return {"prompt": prompt, "text": dec.tokenizer.decode(result.tokens, skip_special_tokens=True),
            "split": dec.stage_layers, "drafter": dec.drafter_kind, "spd": result.stats, "ar": ar_stats,
            "identical": ar_tokens == result.tokens}


def print_report(report: dict, out=None) -> None:
    out = out or sys.stderr  # looked up per call: a redirected stderr (tests, callers) is honoured
    spd, ar = report["spd"], report["ar"]
    rows = [("", "SPD", "AR"),
            ("stages (layers each)", f"n={spd.n_stages} ({','.join(map(str, report['split']))})", "1 (all)"),
            ("new tokens", spd.new_tokens, ar.new_tokens),
            ("cycles / target forwards", spd.cycles, ar.forwards),
            ("accepted / rejected drafts", f"{spd.accepted} / {spd.rejected}", "-"),
            ("drafter", report["drafter"], "-"),
            ("per-draft acceptance", f"{spd.per_draft_acceptance:.2f}", "-"),
            *((f"  drafts from {name}", f"{c['share']:.0%}, accepted {c['acceptance']:.2f}", "-")
              for name, c in spd.source_acceptance().items()),
            ("theoretical speedup (n*N/C)", f"{spd.equivalent_accept_length:.2f}x", "1.00x"),
            ("decode tokens/s (one process)", f"{spd.decode_tokens_per_second:.1f}", f"{ar.decode_tokens_per_second:.1f}")]
    for label, a, b in rows:
        print(f"  {label:<32}{str(a):<22}{b}", file=out)
    print(f"  tokens identical to AR: {'yes' if report['identical'] else 'NO'}", file=out)
    print("  (one process runs the stages one after another; the wall-clock gain needs one process "
          "per stage: `spd generate --distributed`)", file=out)
