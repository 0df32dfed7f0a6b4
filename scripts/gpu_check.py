"""GPU checks for when an accelerator is lent (never in CI; run by scripts/gpu_check.sh).

1. The single-process engine on CUDA emits exactly AR's greedy tokens: tiny random models
   (llama, qwen3) x oracle / adversarial / random PDM drafters x n = 2, 3; the default target
   (SmolLM2-135M) in float32 and bfloat16 x oracle / shipped PDM at n = 2.
2. The distributed runtime on NCCL, every rank on cuda:0, n = 2 with-first-stage and separate,
   greedy tokens == AR. NCCL (>= 2.5) refuses two ranks of one communicator on one GPU
   ("Duplicate GPU detected"); that refusal is reported as such, not as a pass.
3. Per-layer, head, draft and per-cycle times on the GPU, printed as one JSON line.
Any token mismatch exits 1 with the failing case named.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # tiny_model from the tests
from conftest import tiny_model  # noqa: E402
from spd.baselines.ar import ar_generate  # noqa: E402
from spd.drafters import AdversarialDrafter, OracleDrafter, PDMDrafter  # noqa: E402
from spd.engine import generate  # noqa: E402
from spd.pdm import PDM  # noqa: E402
from spd.target import Target, load_target, split_layers  # noqa: E402

DEVICE = os.environ.get("SPD_GPU_CHECK_DEVICE", "cuda:0")   # cpu: a dry run of this script's logic
FAILURES: list[str] = []
REPORT: dict = {}


def check(name: str, ours: list[int], reference: list[int]) -> None:
    ok = ours == reference
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else f": {ours} != AR {reference}"), flush=True)
    if not ok:
        FAILURES.append(name)


def engine_cases(target: Target, label: str, prompt: list[int], ns=(2, 3), new: int = 32, pdm=None) -> None:
    reference, _ = ar_generate(target, prompt, max_new_tokens=new, eos_token_ids=())
    for n in ns:
        stages = split_layers(target.num_layers, n)
        drafters = {"oracle": OracleDrafter(reference), "adversarial": AdversarialDrafter(reference, target.vocab_size),
                    "pdm": PDMDrafter(pdm if pdm is not None else
                                      PDM.create(target, [len(s) for s in stages], num_layers=1, seed=1).to(
                                          device=target.device, dtype=target.dtype))}
        if pdm is not None and len(pdm.config.stage_layers) != n:
            drafters.pop("pdm")
        for kind, drafter in drafters.items():
            out = generate(target, drafter, prompt, stages, max_new_tokens=new, eos_token_ids=())
            check(f"engine {label} n={n} {kind}", out.tokens, reference)


def tiny_models() -> None:
    for family in ("llama", "qwen3"):
        target = Target.from_hf(tiny_model(family, num_layers=6, seed=3).to(DEVICE))
        engine_cases(target, f"tiny {family} fp32", [3, 17, 5, 9, 22, 40, 2, 7])


def default_target() -> None:
    from spd.checkpoint import load_pdm
    from spd.loading import encode_prompt
    from spd.runtime.weights import read_model_config
    from spd.shipped import shipped_pdm

    folder, _ = read_model_config("default")   # the converted SmolLM2-135M-Instruct
    for dtype in (torch.float32, torch.bfloat16):
        target, tokenizer = load_target(str(folder), dtype=dtype, device=DEVICE)
        prompt = encode_prompt(tokenizer, "Explain why the sky is blue in a few sentences.")
        pdm = load_pdm(shipped_pdm("default", 2, None), target)
        engine_cases(target, f"default {str(dtype).split('.')[-1]}", prompt, ns=(2,), new=64, pdm=pdm)
        if dtype == torch.float32:
            timings(target, pdm)


def timings(target: Target, pdm) -> None:
    """Per-part GPU times (ms) and the cost model's prediction for n = 1..4 (spd.bench.planner)."""
    from spd.bench.costs import pipeline_draft_step
    from spd.bench.planner import measure_costs, plan_table

    costs = measure_costs(target, {"pdm": pipeline_draft_step(target, PDMDrafter(pdm), 2, 64)}, busy=False)
    REPORT["costs"] = json.loads(costs.to_json())
    REPORT["plan_oracle"] = [dict(n=r.n, draft_rank=r.draft_rank, head=r.head, split=r.split, cycle_ms=r.cycle_ms,
                                  tokens_per_second=r.tokens_per_second, vs_ar_one_device=r.vs_ar_one_device)
                             for r in plan_table(costs, [1.0], "oracle", max_n=4)]


def distributed() -> None:
    from spd.runtime import plan, start

    folder = Path(tempfile.mkdtemp()) / "tiny"
    model = tiny_model("llama", num_layers=6, seed=3)
    model.save_pretrained(folder)
    full = Target.from_hf(model.to(DEVICE))
    prompt = [3, 17, 5, 9, 22, 40, 2, 7]
    reference, _ = ar_generate(full, prompt, max_new_tokens=24, eos_token_ids=())
    for n, draft_rank in ((2, "with-first-stage"), (2, "separate")):
        world = n + (draft_rank == "separate")
        spec = plan(str(folder), stages=n, draft_rank=draft_rank, timeout=60, devices=(DEVICE,) * world)
        try:
            with start(spec) as session:
                t = time.perf_counter()
                out = session.generate(prompt, OracleDrafter(reference), max_new_tokens=24, eos_token_ids=())
                REPORT[f"distributed_n{n}_{draft_rank}_s"] = time.perf_counter() - t
                REPORT[f"distributed_n{n}_{draft_rank}_breakdown"] = out.stats.breakdown
                check(f"distributed NCCL n={n} {draft_rank} oracle", out.tokens, reference)
                adv = session.generate(prompt, AdversarialDrafter(reference, full.vocab_size), max_new_tokens=24,
                                       eos_token_ids=())
                check(f"distributed NCCL n={n} {draft_rank} adversarial", adv.tokens, reference)
        except Exception as err:  # noqa: BLE001 -- report NCCL's refusal of a shared GPU by name
            text = str(err)
            if "Duplicate GPU" in text or "duplicate" in text.lower():
                print(f"SKIP distributed NCCL n={n} {draft_rank}: NCCL refuses ranks sharing one GPU: {text[:200]}")
                REPORT[f"distributed_n{n}_{draft_rank}"] = "NCCL refused ranks sharing one GPU"
            else:
                print(f"FAIL distributed NCCL n={n} {draft_rank}: {type(err).__name__}: {text[:500]}")
                FAILURES.append(f"distributed n={n} {draft_rank}")


def main() -> None:
    if DEVICE.startswith("cuda"):
        if not torch.cuda.is_available():
            sys.exit("gpu_check: no CUDA device")
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    parts = sys.argv[1:] or ["tiny", "default", "distributed"]
    for part in parts:
        t = time.perf_counter()
        {"tiny": tiny_models, "default": default_target, "distributed": distributed}[part]()
        REPORT[f"{part}_seconds"] = round(time.perf_counter() - t, 1)
    print("GPU_CHECK_JSON " + json.dumps(REPORT))
    if FAILURES:
        sys.exit(f"gpu_check: {len(FAILURES)} FAILED: {', '.join(FAILURES)}")
    print("gpu_check: all token checks passed")


if __name__ == "__main__":
    main()
