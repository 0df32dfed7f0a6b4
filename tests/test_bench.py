"""`spd bench`: same-run harness, resumable records, summary recomputed from them, plots, CLI."""

import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from conftest import tiny_model
from spd.bench import costs
from spd.bench.harness import BenchConfig, read_records, run_bench
from spd.bench.methods import MethodSpec, parse_methods
from spd.bench.report import OVERALL
from spd.cli import app
from spd.target import Target

METHODS = "ar,spd-n2,spd-n2+retrieval,ppsd-n2,ppsd-n4,eagle-k2,eagle-k2+retrieval,eagle-tree-b4"
NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", num_layers=4, vocab=8, seed=2).save_pretrained(folder)
    return folder


def question_file(folder, name, prompts):
    path = folder / name / "question.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question_id": i, "turns": ["(ids)"], "prompt_ids": p}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


@pytest.fixture()
def evals(tmp_path):
    question_file(tmp_path / "evals", "alpha", [[1, 2, 3], [4, 5], [6, 7, 0, 1]])
    question_file(tmp_path / "evals", "beta", [[2, 2, 2, 2], [3]])
    return tmp_path / "evals"


def config(out, evals, model_dir, **kw):
    base = dict(out=str(out), model=str(model_dir), methods=METHODS, datasets=("alpha", "beta"),
                eval_dir=str(evals), temperatures=(0.0, 1.0), max_new_tokens=NEW, ignore_eos=True,
                cost_context=16, progress=False)
    base.update(kw)
    return BenchConfig(**base)


def recompute(records, methods):
    """The summary's definitions, written out again from the records."""
    rows = {}
    for method in {r["method"] for r in records}:
        for t in (0.0, 1.0):
            mine = [r for r in records if r["method"] == method and r["temperature"] == t]
            ar = [r for r in records if r["method"] == "ar" and r["temperature"] == t]
            dec = sum(r["new_tokens"] - 1 for r in mine)
            c = methods[method]["draft_fraction"]
            kind = mine[0]["kind"]
            if kind == "ar":
                cost = sum(r["target_forwards"] for r in mine)
            elif kind == "spd":
                cost = sum(r["cycles"] * max(1 / r["n"], c) for r in mine)
            elif kind == "ppsd":
                cost = sum(r["cycles"] * (1 / r["n"] + c) for r in mine)
            else:
                cost = sum(r["target_forwards"] + c * r["draft_forwards"] for r in mine)
            measured = cost
            if kind == "eagle":   # each forward of T tokens at 1 + (T - 1) / (T_full - 1) * (v - 1)
                v = methods[method]["verify_cost"]
                slope = (v["fraction"] - 1) / (v["tokens"] - 1)
                measured = sum(n * (1 + slope * (int(t) - 1)) for r in mine for t, n in r["verify_sizes"].items())
                measured += sum(c * r["draft_forwards"] for r in mine)
            tps = dec / sum(r["decode_seconds"] for r in mine)
            ar_tps = sum(r["new_tokens"] - 1 for r in ar) / sum(r["decode_seconds"] for r in ar)
            verified = sum(r["verified"] for r in mine)
            rows[(method, t)] = {
                "new_tokens": sum(r["new_tokens"] for r in mine), "theoretical_speedup": dec / cost,
                "measured_cost_speedup": dec / measured,
                "tokens_per_second": tps, "wall_clock_ratio": tps / ar_tps,
                "per_draft_acceptance": sum(r["accepted"] for r in mine) / verified if verified else None}
    return rows


def test_bench_run_writes_records_summary_and_plots(tmp_path, evals, model_dir):
    out = tmp_path / "out"
    result = run_bench(config(out, evals, model_dir))
    assert result.greedy_mismatches == 0
    records = read_records(out / "per_prompt.jsonl")
    assert len(records) == 5 * 2 * 8 == result.records == result.new_records  # prompts x T x methods
    greedy = [r for r in records if r["temperature"] == 0 and r["kind"] != "ar"]
    assert greedy and all(r["matches_ar"] is True for r in greedy)
    assert all(r["new_tokens"] == NEW for r in records)
    for r in records:
        if r["kind"] in ("spd", "ppsd"):
            assert sum(r["verified_by_position"]) == r["verified"] == NEW - 1
            assert len(r["verified_by_position"]) == r["n"]
        if r["kind"] == "eagle":
            assert r["new_tokens"] - 1 == r["target_forwards"] + r["accepted"]
            assert sum(r["verify_sizes"].values()) == r["target_forwards"]
            assert r["draft_tokens"] == sum((int(t) - 1) * n for t, n in r["verify_sizes"].items())
        if r["method"] == "eagle-tree-b4":   # budget 4: depth 4, top-k 4; 5-token forwards but the last
            assert r["tree"] == {"budget": 4, "depth": 4, "top_k": 4} and r["k"] is None
            assert max(int(t) for t in r["verify_sizes"]) == 5 and len(r["verified_by_position"]) == 4
        if r["kind"] != "ar":   # every verified draft is counted under its source
            by_source = r["drafts_by_source"]
            assert sum(v for v, _ in by_source.values()) == r["verified"]
            assert sum(a for _, a in by_source.values()) == r["accepted"]
    sources = {r["method"]: set(r["drafts_by_source"]) for r in records if r["temperature"] == 0}
    assert "retrieval" in sources["spd-n2+retrieval"] and "retrieval" in sources["eagle-k2+retrieval"]
    assert "retrieval" not in sources["spd-n2"] | sources["eagle-k2"]

    rows = json.loads((out / "summary.json").read_text())
    run = json.loads((out / "run.json").read_text())
    assert set(run["methods"]) == set(METHODS.split(","))
    assert {m for m, info in run["methods"].items() if "retrieval_ms" in info} == {"spd-n2+retrieval", "eagle-k2+retrieval"}
    assert {r["dataset"] for r in rows} == {"alpha", "beta", OVERALL}
    assert run["methods"]["eagle-tree-b4"]["verify_cost"]["tokens"] == 5
    assert run["methods"]["eagle-k2"]["verify_cost"]["tokens"] == 3 and "verify_cost" not in run["methods"]["spd-n2"]
    expected = recompute(records, run["methods"])
    for row in rows:
        if row["dataset"] != OVERALL:
            continue
        want = expected[(row["method"], row["temperature"])]
        for name, value in want.items():
            assert row[name] == pytest.approx(value), (row["method"], name)
        if row["kind"] == "ar":
            assert row["theoretical_speedup"] == pytest.approx(1.0) and row["wall_clock_ratio"] == pytest.approx(1.0)
    # per-dataset rows add up to the overall one
    for method in METHODS.split(","):
        parts = [r for r in rows if r["method"] == method and r["temperature"] == 0 and r["dataset"] != OVERALL]
        whole = next(r for r in rows if r["method"] == method and r["temperature"] == 0 and r["dataset"] == OVERALL)
        assert sum(p["new_tokens"] for p in parts) == whole["new_tokens"]
        assert sum(p["prompts"] for p in parts) == whole["prompts"] == 5
    md = (out / "summary.md").read_text()
    assert "| spd-n2 (untrained) | overall | 0 |" in md and "theoretical / wall-clock" in md
    assert "| eagle-tree-b4 (untrained) | overall | 0 |" in md and "speedup at measured verify cost" in md
    for png in ("speedup_vs_n.png", "acceptance_by_position.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_resumes_and_refuses_other_settings(tmp_path, evals, model_dir):
    out = tmp_path / "out"
    first = run_bench(config(out, evals, model_dir, limit=1, methods="ar,spd-n2", temperatures=(0.0,), plots=False))
    assert first.new_records == 2 * 2    # 1 prompt per dataset x 2 methods
    again = run_bench(config(out, evals, model_dir, limit=1, methods="ar,spd-n2", temperatures=(0.0,), plots=False))
    assert again.new_records == 0 and again.records == 4
    # a torn last line (killed mid-write) is dropped and that decode redone
    path = out / "per_prompt.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    grown = run_bench(config(out, evals, model_dir, limit=2, methods="ar,spd-n2,eagle-k3", temperatures=(0.0,),
                             plots=False))
    assert grown.new_records == 1 + 2 * 2 + 4   # the torn one; 2 new prompts x (ar, spd); eagle on all 4
    records = read_records(path)
    keys = [(r["method"], r["dataset"], r["question_id"]) for r in records]
    assert len(keys) == len(set(keys)) == 4 * 3
    with pytest.raises(ValueError, match="max_new_tokens=10"):
        run_bench(config(out, evals, model_dir, limit=1, methods="ar", temperatures=(0.0,), max_new_tokens=5))


def test_cost_model_and_method_names():
    assert costs.step_cost("spd", 0.1, 4) == 0.25 and costs.step_cost("spd", 0.4, 4) == 0.4
    assert costs.step_cost("ppsd", 0.1, 4) == pytest.approx(0.35)
    eagle = {"kind": "eagle", "target_forwards": 10, "draft_forwards": 30}
    assert costs.decode_cost(eagle, 0.05) == pytest.approx(11.5)
    assert [s.name for s in parse_methods("spd-n4,eagle-k5,ppsd-n2")] == ["ar", "spd-n4", "eagle-k5", "ppsd-n2"]
    assert MethodSpec.parse("eagle-k3") == MethodSpec("eagle", k=3)
    assert MethodSpec.parse("spd-n4+retrieval") == MethodSpec("spd", n=4, retrieval=True)
    assert MethodSpec.parse("eagle-k5+retrieval").name == "eagle-k5+retrieval"
    for bad in ("spd", "spd-n0", "eagle-3", "medusa", "ppsd-n2+retrieval", "ar+retrieval", "eagle-tree-4",
                "eagle-tree-b4+retrieval", "eagle-tree-b4-k2-d3"):
        with pytest.raises(ValueError, match="unknown method"):
            MethodSpec.parse(bad)
    tree = MethodSpec.parse("eagle-tree-b16")
    assert (tree.kind, tree.tree.budget, tree.tree.depth, tree.tree.top_k, tree.verify_tokens) == ("eagle", 16, 6, 8, 17)
    assert MethodSpec.parse("eagle-tree-b16-d3-k4").name == "eagle-tree-b16-d3-k4"
    assert MethodSpec.parse("eagle-tree-b16-d6-k8").name == "eagle-tree-b16"   # the defaults are left out
    with pytest.raises(ValueError, match="must be >= 1"):
        MethodSpec.parse("eagle-tree-b0")
    # measured cost: a 5-token forward at v=2.0, a 3-token one interpolated at 1.5, draft calls as before
    record = {"kind": "eagle", "target_forwards": 3, "draft_forwards": 10, "verify_sizes": {"5": 2, "3": 1}}
    assert costs.measured_decode_cost(record, 0.1, {"tokens": 5, "fraction": 2.0}) == pytest.approx(2 * 2 + 1.5 + 1)
    assert costs.measured_decode_cost({**record, "kind": "ar"}, 0.1, None) == 3
    # tree SPD: a cycle costs its widest level's v_w / n, or the draft if that is slower
    assert MethodSpec.parse("spd-n4-w4").verify_tokens == 4 and MethodSpec.parse("spd-n4").verify_tokens is None
    tree = {"kind": "spd", "n": 4, "tree_width": 4, "cycles": 7, "cycles_by_width": {"1": 2, "4": 4, "2": 1}}
    assert costs.measured_decode_cost(tree, 0.1, {"tokens": 4, "fraction": 2.2}) == pytest.approx(
        2 * 0.25 + 4 * 2.2 / 4 + 1 * 1.4 / 4)
    assert costs.measured_decode_cost(tree, 0.6, {"tokens": 4, "fraction": 2.2}) == pytest.approx(7 * 0.6)
    assert costs.decode_cost(tree, 0.1) == pytest.approx(7 * 0.25)   # the common model: width is free
    assert costs.measured_decode_cost(tree, 0.1, None) is None
    with pytest.raises(ValueError, match="twice"):
        parse_methods("spd-n2,spd-n2")


def test_measured_draft_fractions_are_sane():
    """A 1-layer head costs less than the 6-layer target it drafts for, measured interleaved."""
    from spd.baselines.eagle import EagleHead
    from spd.baselines.ppsd import PPSDDrafter, PPSDHead

    target = Target.from_hf(tiny_model("llama", num_layers=6, vocab=512))
    steps = [costs.eagle_draft_step(target, EagleHead.create(target).eval(), 16),
             costs.pipeline_draft_step(target, PPSDDrafter(PPSDHead.create(target, [2, 2, 2]).eval()), 3, 16)]
    for step in steps:
        fraction, draft_s, target_s = costs.draft_fraction(target, step, 16, reps=9)
        assert 0 < draft_s < target_s and fraction == pytest.approx(draft_s / target_s)


def test_cli_bench_run_and_report(tmp_path, model_dir):
    data = question_file(tmp_path, "mine", [[1, 2, 3], [5, 6]])
    out = tmp_path / "cli-out"
    runner = CliRunner()
    args = ["bench", "run", "--model", str(model_dir), "--datasets", "", "--data", str(data), "--methods",
            "ar,spd-n2,eagle-k2", "--temperatures", "0", "--max-new-tokens", "8", "--out", str(out),
            "--no-progress", "--no-plots", "--cost-context", "8"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "| eagle-k2 (untrained) | mine | 0 | 2 |" in result.stdout
    rows = json.loads((out / "summary.json").read_text())
    assert {(r["method"], r["dataset"]) for r in rows} >= {("ar", "mine"), ("spd-n2", OVERALL)}
    report = runner.invoke(app, ["bench", "report", "--out", str(out)])
    assert report.exit_code == 0 and "eagle-k2" in report.stdout
    assert (out / "speedup_vs_n.png").is_file()
    missing = runner.invoke(app, ["bench", "run", "--model", str(model_dir), "--datasets", "nope",
                                  "--eval-dir", str(tmp_path), "--out", str(out)])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_shipped_heads_are_found_for_the_default_target_only(tmp_path, monkeypatch):
    """A head in assets/heads is what `spd bench run --model default` uses when no --eagle/--ppsd
    is given (no untrained row); other models and missing heads fall back to untrained ones."""
    from conftest import tiny_target
    from spd import shipped
    from spd.baselines.eagle import EagleHead
    from spd.baselines.heads import save_head
    from spd.bench.methods import build_runner

    target = tiny_target(num_layers=4)
    monkeypatch.setattr(shipped, "HEAD_ASSETS", tmp_path)
    assert shipped.shipped_head("default", "eagle") is None
    save_head(EagleHead.create(target, seed=1), tmp_path / "smollm2-135m-eagle")
    assert shipped.shipped_head("default", "eagle") == str(tmp_path / "smollm2-135m-eagle")
    assert shipped.shipped_head("other/model", "eagle") is None and shipped.shipped_head("default", "ppsd", 2) is None
    assert not build_runner(MethodSpec.parse("eagle-k3"), target, "default").untrained
    assert build_runner(MethodSpec.parse("eagle-k3"), target, "other/model").untrained


def test_bench_replay_gives_the_decoded_counts(tmp_path, evals, model_dir):
    methods = METHODS + ",eagle-k4,spd-n3-w2"
    decoded = run_bench(config(tmp_path / "decoded", evals, model_dir, methods=methods, temperatures=(0.0,),
                               plots=False))
    replayed = run_bench(config(tmp_path / "replayed", evals, model_dir, methods=methods, temperatures=(0.0,),
                                plots=False, replay=True, engine_check=1))
    assert decoded.greedy_mismatches == replayed.greedy_mismatches == 0
    real = {(r["method"], r["dataset"], r["question_id"]): r for r in read_records(tmp_path / "decoded" / "per_prompt.jsonl")}
    counts = ("tokens", "cycles", "target_forwards", "draft_forwards", "verified", "accepted", "verified_by_position",
              "accepted_by_position", "drafts_by_source", "draft_tokens", "verify_sizes", "stage_tokens",
              "cycles_by_width")
    seen = {"replayed": 0, "checked": 0}
    for r in read_records(tmp_path / "replayed" / "per_prompt.jsonl"):
        first = r["question_id"] == 0   # engine_check=1: each dataset's first prompt decodes for real
        if r["kind"] == "ar" or r["method"] == "spd-n3-w2":   # AR is the reference; trees cannot be replayed
            assert "replayed" not in r and r["decode_seconds"] is not None
            continue
        if first:
            assert r["replay_agrees"] is True and r["matches_ar"] is True and r["decode_seconds"] > 0
            seen["checked"] += 1
        else:
            assert r["replayed"] is True and r["matches_ar"] is None and r["decode_seconds"] is None
            seen["replayed"] += 1
        want = real[(r["method"], r["dataset"], r["question_id"])]
        assert {f: r.get(f) for f in counts} == {f: want.get(f) for f in counts}, r["method"]
    assert seen == {"checked": 2 * 8, "replayed": 3 * 8}   # 8 replayable methods
    rows = {r["method"]: r for r in replayed.summary if r["dataset"] == OVERALL}
    want = {r["method"]: r for r in decoded.summary if r["dataset"] == OVERALL}
    for method, row in rows.items():   # (the draft costs are timed per run: compare counts)
        assert row["mean_accepted_length"] == pytest.approx(want[method]["mean_accepted_length"]), method
        assert row["per_draft_acceptance"] == want[method]["per_draft_acceptance"]
    assert rows["spd-n2"]["replayed"] == 3 and rows["spd-n2"]["replay_agreed"] == rows["spd-n2"]["replay_checked"] == 2
    assert rows["spd-n2"]["tokens_per_second"] > 0   # from the two decoded prompts
    assert rows["spd-n3-w2"]["verify_cost_fraction"] > 0 and rows["spd-n3-w2"]["measured_cost_speedup"] > 0
    assert "(+3 replayed; replay = decode 2/2)" in (tmp_path / "replayed" / "summary.md").read_text()


def test_bench_replay_of_a_sampled_run(tmp_path, evals, model_dir):
    # T = 1: the replayed records judge each draft against AR's sample (the law of the method's
    # own output; tests/test_acceptance.py checks the acceptances' law); engine-checked prompts decode
    out = tmp_path / "t1"
    result = run_bench(config(out, evals, model_dir, methods="spd-n2,eagle-k3", temperatures=(1.0,), plots=False,
                              replay=True, engine_check=1))
    records = read_records(out / "per_prompt.jsonl")
    ar = {(r["dataset"], r["question_id"]): r["tokens"] for r in records if r["kind"] == "ar"}
    kinds = Counter()
    for r in records:
        if r["kind"] == "ar":
            continue
        if r["question_id"] == 0:
            assert "replayed" not in r and "replay_agrees" not in r and r["decode_seconds"] > 0
            kinds["decoded"] += 1
        else:
            assert r["replayed"] is True and r["tokens"] == ar[(r["dataset"], r["question_id"])]
            assert 0 < r["verified"] and 0 <= r["accepted"] <= r["verified"]
            kinds["replayed"] += 1
    assert kinds == {"decoded": 2 * 2, "replayed": 3 * 2} and result.greedy_mismatches == 0
