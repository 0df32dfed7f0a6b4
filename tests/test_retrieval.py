"""Retrieval drafting: the suffix index against brute force, drafters through the one engine."""

import random

import pytest

from conftest import tiny_model
from spd.baselines.ar import ar_generate
from spd.engine import generate
from spd.pdm import PDM
from spd.retrieval import Gate, HybridDrafter, RetrievalDrafter, SuffixIndex
from spd.target import Target, split_layers


def brute_lookup(tokens, max_len):
    """Longest suffix (<= max_len) of tokens that ends earlier too; its newest earlier end."""
    t = len(tokens) - 1
    for k in range(min(max_len, t), 0, -1):
        suffix = tokens[t - k + 1:]
        for end in range(t - 1, k - 2, -1):
            if tokens[end - k + 1:end + 1] == suffix:
                return tokens[end + 1], k
    return None, 0


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_suffix_index_matches_brute_force_through_appends_and_truncations(vocab):
    rng = random.Random(vocab)
    index, tokens = SuffixIndex(max_len=5), []
    for step in range(600):
        if tokens and rng.random() < 0.2:   # a rejection drops the in-flight tail
            keep = rng.randrange(max(0, len(tokens) - 5), len(tokens))
            tokens = tokens[:keep]
            index.truncate(keep)
        else:
            tokens.append(rng.randrange(vocab))
            index.append(tokens[-1])
        assert index.tokens == tokens
        assert index.lookup() == (brute_lookup(tokens, 5) if tokens else (None, 0)), step


def test_sync_rewrites_only_the_changed_tail():
    index = SuffixIndex(max_len=4)
    index.sync([1, 2, 3, 1, 2])
    assert index.lookup() == (3, 2)
    index.sync([1, 2, 3, 1, 5, 1, 2], stable=3)   # position 4 was a rejected draft
    assert index.tokens == [1, 2, 3, 1, 5, 1, 2] and index.lookup() == (3, 2)
    assert index.continuation(3) == [3, 1, 5]
    index.sync([1, 2, 3, 1, 5, 9], stable=4)   # the last two were dropped, 9 came instead
    assert index.tokens == [1, 2, 3, 1, 5, 9] and index.lookup() == (None, 0)
    assert index.continuation(3) == []


def test_index_memory_is_linear_in_the_context():
    index = SuffixIndex(max_len=8)
    for i in range(4000):
        index.append(i % 97)
    entries = sum(len(table) for table in index._tables)
    assert entries <= 8 * 4000 and len(index._undo) == 4000


NEW = 40
PROMPTS = [[3, 17, 5, 9, 22, 3, 17, 5], [1], [40, 2, 2, 2, 2, 2, 2, 2, 2, 7, 11, 60]]


# retrieval drafts from tokens alone: llama runs by default; qwen3 (slow) adds nothing the family
# tests (test_families.py: every family, greedy SPD == HF generate) do not cover
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_retrieval_and_hybrid_greedy_equal_ar(family):
    model = tiny_model(family, num_layers=6, seed=3)
    target = Target.from_hf(model)
    for n in (2, 3, 6):
        stages = split_layers(6, n)
        pdm = PDM.create(target, [len(s) for s in stages], num_layers=1, seed=1).eval()
        gates = [Gate(), Gate(min_len=1, max_len=3, threshold=[1.01, 1.01, 1.01]),   # always retrieval
                 Gate(min_len=1, max_len=2, threshold=[0.6, 0.9]),
                 Gate(min_len=1, max_len=2, threshold=[0.4, 0.6], adapt=1.0)]   # follows the sequence's lead
        for prompt in PROMPTS:
            reference, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
            kinds = [RetrievalDrafter()] + [HybridDrafter(pdm, g) for g in gates]
            for drafter in kinds:
                result = generate(target, drafter, prompt, stages, max_new_tokens=NEW, eos_token_ids=())
                assert result.tokens == reference, (family, n, prompt, drafter)
                s = result.stats
                assert s.accepted + s.rejected == NEW - 1
                by_source = s.drafts_by_source
                assert sum(v for v, _ in by_source.values()) == NEW - 1
                assert sum(a for _, a in by_source.values()) == s.accepted


def test_the_hybrids_lead_counts_each_position_once_verified_and_drops_what_a_rejection_dropped():
    from types import SimpleNamespace as State
    target = Target.from_hf(tiny_model("llama", num_layers=2, seed=0))
    drafter = HybridDrafter(PDM.create(target, [1, 1], num_layers=1, seed=0), Gate(adapt=0.5))
    disputes = drafter.disputes
    disputes.open = {5: (7, 8), 6: (9, 1), 7: (2, 3)}      # position -> (retrieved, PDM top-1)
    tokens = [0] * 5 + [7, 1, 4]                           # 5: retrieval right, 6: the PDM, 7 not verified yet

    def lead(state):
        return disputes.lead(len(state.tokens), state.first_inflight, state.tokens.__getitem__)
    assert lead(State(tokens=tokens, first_inflight=5)) == 0.0 and len(disputes.open) == 3
    assert lead(State(tokens=tokens, first_inflight=6)) == 1.0     # position 5 verified
    assert lead(State(tokens=tokens, first_inflight=7)) == 0.0     # and 6: one each
    assert lead(State(tokens=tokens[:7], first_inflight=7)) == 0.0   # 7 is drafted again: dropped
    assert disputes.open == {} and disputes.settled == 2
