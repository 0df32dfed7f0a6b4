"""Fitting the hybrid drafter's gate: thresholds against brute force, the per-length accuracy
over every match, and gate records from a real (tiny) target and PDM."""

import random

import pytest
import torch

from conftest import tiny_model
from spd.pdm import PDM
from spd.retrieval import RETRIEVAL_PRIOR, Gate, SuffixIndex
from spd.target import Target, split_layers
from spd.train.gate import GateRecord, fit_gate, gate_records


def random_records(seed: int, count: int = 400) -> list[GateRecord]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length, p = rng.choice([1, 1, 2, 2, 3, 5]), round(rng.random(), 3)
        agree = rng.random() < 0.3
        retrieval_right = rng.random() < 0.2 * length
        pdm_right = retrieval_right if agree else (not retrieval_right and rng.random() < p)
        out.append(GateRecord(length, p, retrieval_right, pdm_right, agree))
    return out


def right_drafts(records, length, threshold):
    return sum(r.retrieval_right if r.pdm_top1 < threshold else r.pdm_right
               for r in records if min(r.match_len, 4) == length and not r.agree)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thresholds_and_accuracy_are_fitted_on_the_disagreements_per_length(seed):
    records = random_records(seed)
    gate = fit_gate(records, max_len=4, min_count=20)
    for length in (1, 2, 3, 4):   # matches of 5 count as 4 (max_len)
        candidates = [0.0, 1.01] + sorted({r.pdm_top1 + 1e-6 for r in records})   # every distinct cut
        assert right_drafts(records, length, gate.threshold[length - 1]) == max(
            right_drafts(records, length, t) for t in candidates)
        matches = [r for r in records if min(r.match_len, 4) == length and not r.agree]
        assert gate.accuracy[length - 1] == pytest.approx(sum(r.retrieval_right for r in matches) / len(matches), abs=1e-4)
    assert gate.prior(9) == gate.accuracy[3] and gate.prior(1) == gate.accuracy[0]


def test_sparse_lengths_fall_back_and_an_unfitted_gate_uses_the_documented_prior():
    records = [GateRecord(1, 0.5, True, False, False)] * 30 + [GateRecord(2, 0.5, False, False, True)] * 40
    gate = fit_gate(records, max_len=3, min_count=20)
    assert gate.accuracy == [1.0, 1.0, 1.0] and gate.threshold == [1.01, 1.01, 1.01]
    empty = fit_gate([], max_len=2, min_count=20)
    assert empty.accuracy == list(RETRIEVAL_PRIOR[:1]) * 2 and empty.threshold == [0.0, 0.0]
    assert Gate().prior(3) == RETRIEVAL_PRIOR[2] and Gate().prior(20) == RETRIEVAL_PRIOR[-1]
    with pytest.raises(ValueError, match="accuracy"):
        Gate(max_len=2, threshold=[0.1, 0.2], min_len=1, accuracy=[0.5])


def test_gate_records_follow_the_index_and_the_pdm():
    """Records: one per position with a match; agree == (retrieved == PDM top-1), and the truth is
    the target's own greedy next token."""
    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=16, seed=3))
    pdm = PDM.create(target, [len(s) for s in split_layers(4, 2)], seed=1).eval()
    gen = torch.Generator().manual_seed(0)
    prompt, answer = torch.randint(0, 16, (5,), generator=gen).tolist(), torch.randint(0, 16, (40,), generator=gen).tolist()
    records = gate_records(target, pdm, prompt, answer)
    index, sequence, drafted_at = SuffixIndex(8), prompt + answer, []
    for t in range(len(prompt), len(sequence) - 1):
        index.sync(sequence[:t + 1], t)
        if index.lookup()[0] is not None:
            drafted_at.append(t + 1)
    assert len(records) == len(drafted_at) > 10
    assert all(not (r.agree and r.retrieval_right != r.pdm_right) for r in records)
    # each record's lead: over the earlier disagreements already verified (behind the n=2 pipeline)
    for i, (record, position) in enumerate(zip(records, drafted_at)):
        first_inflight = max(len(prompt), position - 2)
        earlier = [int(r.retrieval_right) - int(r.pdm_right) for r, at in zip(records[:i], drafted_at)
                   if not r.agree and at < first_inflight]
        assert record.lead == pytest.approx(sum(earlier) / len(earlier) if earlier else 0.0)
    assert any(r.lead != 0 for r in records)


def test_the_gate_learns_a_weight_on_the_sequences_lead_where_the_lead_tells_who_is_right():
    """Retrieval is right where it led earlier in the sequence, the PDM where it did, and the PDM's
    top-1 probability says nothing: the fit puts a weight on the lead and gets more drafts right."""
    rng = random.Random(0)
    records = []
    for _ in range(600):
        lead = rng.choice([-0.8, -0.3, 0.3, 0.8])
        retrieval_right = rng.random() < (0.9 if lead > 0 else 0.1)
        records.append(GateRecord(rng.choice([1, 2]), round(rng.random(), 3), retrieval_right, not retrieval_right,
                                  lead=lead))
    plain, adaptive = fit_gate(records, max_len=2), fit_gate(records, max_len=2, adapt=None)
    assert plain.adapt == 0 and adaptive.adapt > 0

    def right(gate):
        return sum(r.retrieval_right if gate.takes_retrieval(r.match_len, r.pdm_top1, lead=r.lead) else r.pdm_right
                   for r in records)
    assert right(adaptive) > right(plain) + 0.2 * len(records)
    # a length it never hands to retrieval stays so whatever the lead; one it always does skips the PDM
    assert not Gate(min_len=1, max_len=1, threshold=[-0.51], adapt=0.5).takes_retrieval(1, 0.0, lead=1.0)
    assert Gate(min_len=1, max_len=1, threshold=[1.51], adapt=0.5).skips_pdm(1, lead=-1.0)


def test_a_length_whose_retrievals_were_all_wrong_leaves_a_retrieved_candidate_its_pdm_score():
    from spd.drafters import top_candidates
    from spd.sampling import SamplingParams

    gate = fit_gate([GateRecord(1, 0.5, False, True, False)] * 25, max_len=2, min_count=20)
    assert gate.accuracy == [0.0, 0.0]
    first = top_candidates(torch.zeros(8), SamplingParams(), 2, "pdm", (3, gate.prior(1)))[0]
    assert first.token == 3 and first.logprob == pytest.approx(-torch.log(torch.tensor(8.0)).item())   # its PDM log q


def expected_accepted(records, length, threshold):
    return sum(r.retrieval_p if r.pdm_top1 < threshold else r.pdm_overlap
               for r in records if min(r.match_len, 4) == length and not r.agree)


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_thresholds_maximise_the_expected_accepted_drafts(seed):
    """Retrieval is right (the argmax) as often as in the greedy records, but a right argmax is
    accepted at T > 0 with p(token) only, so the sampled thresholds take it less often."""
    rng = random.Random(seed)
    records = random_records(seed)
    for r in records:
        r.retrieval_p = rng.uniform(0.3, 0.7) if r.retrieval_right else rng.uniform(0.0, 0.1)
        r.pdm_overlap = rng.uniform(0.2, 0.6)
    gate = fit_gate(records, max_len=4, min_count=20, temperature=1.0)
    assert gate.threshold == fit_gate(records, max_len=4, min_count=20).threshold   # greedy unchanged
    for length in (1, 2, 3, 4):
        candidates = [0.0, 1.01] + sorted({r.pdm_top1 + 1e-6 for r in records})
        assert expected_accepted(records, length, gate.sampled_threshold[length - 1]) == pytest.approx(max(
            expected_accepted(records, length, t) for t in candidates))
    assert sum(gate.sampled_threshold) < sum(gate.threshold) and gate.sampled_temperature == 1.0
    apart = fit_gate([], max_len=4, min_count=20, temperature=1.0, sampled_records=records)   # own answers
    assert apart.sampled_threshold == gate.sampled_threshold and apart.threshold == [0.0] * 4


def test_the_hybrid_drafter_gates_with_the_sampled_thresholds_when_sampling():
    """A gate that always takes retrieval when greedy and never when sampling: the drafter's
    sources follow the mode; a gate fitted before sampled thresholds existed uses the greedy ones."""
    from spd.engine import generate
    from spd.retrieval import HybridDrafter
    from spd.sampling import SamplingParams

    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=16, seed=3))
    pdm = PDM.create(target, [len(s) for s in split_layers(4, 2)], seed=1).eval()
    split = Gate(min_len=1, max_len=2, threshold=[1.01, 1.01], sampled_min_len=2, sampled_threshold=[0.0, 0.0],
                 sampled_temperature=1.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def sources(gate, temperature):
        result = generate(target, HybridDrafter(pdm, gate), prompt, split_layers(4, 2),
                          SamplingParams(temperature=temperature, seed=0), max_new_tokens=24, eos_token_ids=())
        return result.stats.drafts_by_source

    assert "retrieval" in sources(split, 0.0)   # (the PDM drafts where nothing matches)
    assert "retrieval" not in sources(split, 1.0)
    assert "retrieval" in sources(Gate(min_len=1, max_len=2, threshold=[1.01, 1.01]), 1.0)


def test_spd_gate_fits_the_sampled_thresholds_on_own_answers_and_refits_them_alone(tmp_path):
    """End to end on a tiny model: the sampled thresholds are saved beside the PDM; --sampled-only
    keeps the greedy ones of the saved gate and --temperature 0 its sampled ones; own answers are
    the target's seeded samples."""
    import json

    from typer.testing import CliRunner

    from conftest import WORDS, tiny_tokenizer
    from spd.baselines.ar import ar_generate
    from spd.checkpoint import save_pdm
    from spd.cli import app
    from spd.sampling import SamplingParams
    from spd.train.gate import own_answers

    model = tiny_model("llama", num_layers=4, vocab=64, seed=2)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    target = Target.from_hf(model)
    save_pdm(PDM.create(target, [2, 2], seed=1), tmp_path / "pdm")
    words = WORDS[:6]
    chats = [{"messages": [{"role": "user", "content": " ".join(words[i % 3:] * 2)},
                           {"role": "assistant", "content": " ".join((words * 4)[i:i + 20])}]} for i in range(6)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    args = ["gate", "--model", str(tmp_path / "model"), "--pdm", str(tmp_path / "pdm"), "--data",
            str(tmp_path / "chat.jsonl"), "--min-count", "1", "--own-answers", "24", "--max-len", "3"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "on own answers" in first.output
    saved = Gate.load(tmp_path / "pdm")
    assert saved.sampled_temperature == 1.0 and len(saved.sampled_threshold) == 3
    kept = Gate(min_len=1, max_len=3, threshold=[0.5, 0.6, 0.7], fitted_on="by hand")
    kept.save(tmp_path / "pdm")
    second = CliRunner().invoke(app, args + ["--sampled-only"])
    assert second.exit_code == 0, second.output
    refit = Gate.load(tmp_path / "pdm")
    assert (refit.threshold, refit.fitted_on) == (kept.threshold, "by hand")
    assert refit.sampled_threshold == saved.sampled_threshold   # the same seeded own answers
    greedy = CliRunner().invoke(app, args + ["--temperature", "0"])
    assert greedy.exit_code == 0, greedy.output
    assert Gate.load(tmp_path / "pdm").sampled_threshold == saved.sampled_threshold   # greedy only: kept
    assert Gate.load(tmp_path / "pdm").fitted_on != "by hand"
    prompts = [[1, 2, 3], [4, 5]]
    answers = own_answers(target, prompts, 1.0, 8, seed=7)
    assert answers[1] == ar_generate(target, [4, 5], SamplingParams(temperature=1.0, seed=8), 8)[0]
    assert all(1 <= len(a) <= 8 for a in answers)
