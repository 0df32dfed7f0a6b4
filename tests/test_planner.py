"""The cost model's arithmetic (spd.bench.planner): runs of verifications, cycle times per layout,
the balanced split, and tokens/s; no timing."""

import math

import pytest

from spd.bench.planner import Costs, balanced_split, cycle_ms, expected_run, plan_table, predict
from spd.pdm import fits_split, types_by_depth

COSTS = Costs(num_layers=30, layer_ms=1.0, head_ms=4.0, message_ms=0.0, draft_ms={"pdm": 2.0, "oracle": 0.0})


def test_expected_run_matches_constant_acceptance():
    assert expected_run([1.0], 2) == math.inf
    assert expected_run([0.0, 0.0], 2) == 1.0
    for a in (0.3, 0.8):   # constant acceptance: a geometric run, cycles/token = 1 + (n-1)(1-a) (SPEC 2)
        assert expected_run([a], 4) == pytest.approx(1 / (1 - a))
    a1, a2 = 0.2, 0.7   # fill 1 first, then steady state
    assert expected_run([a1, a2], 2) == pytest.approx(1 + a1 + a1 * a2 / (1 - a2))


def test_cycle_time_per_layout():
    split = (15, 15)
    # head on the last stage: rank 0 = 15 layers + draft, rank 1 = 15 layers + head (+ 2 messages)
    assert cycle_ms(COSTS, split, "with-first-stage", "last", 2.0, fill=2) == 19.0
    assert cycle_ms(COSTS, split, "with-first-stage", "last", 2.0, fill=1) == 17.0   # refill: stage 0 only
    # head on rank 0: after the reports, or overlapped by looking ahead
    assert cycle_ms(COSTS, split, "with-first-stage", "control", 2.0, fill=2) == 21.0
    assert cycle_ms(COSTS, split, "with-first-stage", "control", 2.0, fill=2, lookahead=True) == 21.0
    assert cycle_ms(COSTS, split, "separate", "control", 2.0, fill=2, lookahead=True) == 15.0
    messages = Costs(30, 1.0, 4.0, 0.5)
    assert cycle_ms(messages, split, "with-first-stage", "last", 0.0, fill=2) == 20.0
    cpu = Costs(30, 1.0, 4.0, 0.0, cores=2, contention=1.5)   # 3 processes on 2 cores: time-sliced
    assert cycle_ms(cpu, split, "separate", "last", 2.0, fill=2) == pytest.approx(19 * 1.5)   # the slowest rank
    assert cycle_ms(cpu, split, "separate", "last", 10.0, fill=2) == pytest.approx((10 + 15 + 19) * 1.5 / 2)


def test_balanced_split_and_pdm_constraint():
    assert balanced_split(COSTS, 2, "with-first-stage", "last") == (17, 13)   # 17 = 13 + head 4
    assert balanced_split(COSTS, 2, "with-first-stage", "last", draft_ms=4.0) == (15, 15)
    assert balanced_split(COSTS, 1, "with-first-stage", "last") == (30,)
    split = balanced_split(COSTS, 2, "with-first-stage", "last", allowed=lambda d, b: b != 17)
    assert split in ((16, 14), (18, 12))
    three = balanced_split(COSTS, 3, "with-first-stage", "last")
    assert sum(three) == 30 and max(three[0], three[1], three[2] + 4) <= 12
    # a PDM trained on 15/15 with anchors 0,15,30 sees the same anchors at every depth on 17/13
    assert types_by_depth([15, 15], [0, 15, 30]) == [1, 2, 3]
    assert fits_split([15, 15], [0, 15, 30], [17, 13]) and not fits_split([15, 15], [0, 15, 30], [14, 16])


def test_predicted_tokens_per_second():
    oracle = predict(COSTS, (17, 13), "with-first-stage", "last", [1.0], "oracle")
    assert oracle.cycle_ms == 17.0 and oracle.tokens_per_cycle == 1.0
    assert oracle.tokens_per_second == pytest.approx(1000 / 17)
    assert oracle.vs_ar_one_device == pytest.approx(34 / 17)   # AR = 30 layers + head
    # 64 new tokens: 63 decode tokens pay one refill cycle (stage 0 only) on top
    short = predict(COSTS, (17, 13), "with-first-stage", "last", [1.0], "oracle", new_tokens=64)
    assert 1000 / short.tokens_per_second == pytest.approx(17 + 17 / 63)
    # head on rank 0, looking ahead: a rejection wastes a cycle, the end of a sequence none
    ahead = predict(COSTS, (15, 15), "with-first-stage", "control", [1.0], "oracle", new_tokens=64, lookahead=True)
    assert 1000 / ahead.tokens_per_second == pytest.approx(ahead.cycle_ms + (ahead.cycle_ms - 4) / 63)
    a = 0.5
    half = predict(COSTS, (15, 15), "with-first-stage", "last", [a], "pdm")
    run = 1 / (1 - a)
    assert 1000 / half.tokens_per_second == pytest.approx(19 + 17 / run)
    rows = plan_table(COSTS, [0.8], "pdm", max_n=3)
    assert {r.n for r in rows} == {1, 2, 3} and all(sum(r.split) == 30 for r in rows)
    assert Costs.from_json(COSTS.to_json()) == COSTS


def test_wallclock_gives_each_drafter_its_balanced_split(tmp_path, monkeypatch):
    """`spd bench wallclock --split auto`: a drafter with a costly draft on rank 0 gets fewer layers
    on stage 0 than the oracle; each runs on its own processes and still emits AR's tokens."""
    from conftest import tiny_model
    from spd.bench import wallclock
    from spd.checkpoint import save_pdm
    from spd.pdm import PDM
    from spd.target import Target

    model = tiny_model("llama", num_layers=8, seed=2)
    model.save_pretrained(tmp_path / "model")
    save_pdm(PDM.create(Target.from_hf(model), [4, 4], anchors=[0, 8]), tmp_path / "pdm")
    costs = Costs(num_layers=8, layer_ms=1.0, head_ms=2.0, message_ms=0.0, draft_ms={"pdm": 4.0})
    monkeypatch.setattr(wallclock, "measure_device_costs", lambda *a: costs)   # no timing in a test
    results = wallclock.measure(wallclock.WallclockOptions(
        str(tmp_path / "model"), 2, "auto", "with-first-stage", ("oracle", "pdm"), ["a", "b"], "test", 8, (1,), 1,
        str(tmp_path / "pdm")))
    assert results["oracle"]["split"] == [5, 3]       # 5 = 3 + head 2
    assert results["pdm"]["split"] == [3, 5]          # 3 + draft 4 = 5 + head 2
    assert results["oracle"]["identical"] and results["pdm"]["identical"]
    assert results["settings"]["stage_layers"] == [(3, 5), (5, 3)]
    assert "SPD oracle 5/3" in wallclock.format_report(results)
    # the speedup over AR on 1 thread is predicted from the same costs (AR = 8 layers + head = 10 ms)
    oracle = results["oracle"]
    predicted = oracle["predicted_ratio_vs_ar_one_thread"]
    assert predicted == pytest.approx(10 * oracle["predicted_tokens_per_second"] / 1000) and 1.5 < predicted < 2
    assert oracle["ratio_prediction_error"] == pytest.approx(predicted / oracle["ratio_vs_ar_one_thread"] - 1)
    assert "AR 1 thread predicted" in wallclock.format_report(results)


def test_wallclock_runs_a_token_tree(tmp_path, monkeypatch):
    """`--tree-width 2`: the PDM drafts two candidates per level, lookahead auto turns off, the
    tokens stay AR's, and no cost-model prediction is made (it prices one token per stage)."""
    from conftest import tiny_model
    from spd.bench import wallclock
    from spd.checkpoint import save_pdm
    from spd.pdm import PDM
    from spd.target import Target

    model = tiny_model("llama", num_layers=4, seed=3)
    model.save_pretrained(tmp_path / "model")
    save_pdm(PDM.create(Target.from_hf(model), [2, 2]), tmp_path / "pdm")
    costs = Costs(num_layers=4, layer_ms=1.0, head_ms=1.0, message_ms=0.0, draft_ms={"pdm": 1.0})
    monkeypatch.setattr(wallclock, "measure_device_costs", lambda *a: costs)
    results = wallclock.measure(wallclock.WallclockOptions(
        str(tmp_path / "model"), 2, [2, 2], drafters=("pdm",), prompts=["a"], max_new_tokens=12, ar_threads=(1,),
        threads=1, pdm=str(tmp_path / "pdm"), tree_width=2))
    r = results["pdm"]
    assert r["identical"] and 1.0 < r["mean_width"] <= 2.0
    assert "predicted_tokens_per_second" not in r and results["settings"]["lookahead"] == "off"
    assert "mean width" in wallclock.format_report(results) and "tree width 2" in wallclock.format_report(results)


def test_contention_is_measured_beside_a_stage_of_the_same_architecture():
    """`measure_contention` runs a zero-weight stage of the target's own config in another process,
    pairs calls with it paused and running, and leaves no process behind."""
    import multiprocessing

    import torch

    from conftest import tiny_model
    from spd.bench.planner import measure_contention

    model = tiny_model("llama", num_layers=4, seed=1)
    calls = []

    def layers():
        calls.append(1)
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3]]))

    contention = measure_contention(layers, model.config, 4, cores=2, reps=3)
    assert 0.2 < contention < 20 and len(calls) == 2 * (3 + 2)
    assert multiprocessing.active_children() == []
