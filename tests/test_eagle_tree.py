"""EAGLE-style tree drafting: greedy == AR, the tree's shape and scores, cache compaction, budgets."""

import pytest
import torch

import spd.baselines.eagle_tree as eagle_tree
from conftest import tiny_model
from spd.baselines.ar import ar_generate
from spd.baselines.eagle import EagleHead
from spd.baselines.eagle_tree import TreeOptions, draft_tree, eagle_tree_generate
from spd.cache import KVCache
from spd.sampling import SamplingParams
from spd.target import Target, attention_mask
from spd.tree import Node

PROMPTS = [[3, 17, 5, 9, 22], [1], [40, 2, 2, 2, 2, 2, 2, 7, 11, 60]]
NEW = 20
SHAPES = [TreeOptions(1), TreeOptions(4), TreeOptions(16), TreeOptions(32, depth=5, top_k=4),
          TreeOptions(6, depth=2, top_k=3)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])   # gemma2: sliding windows of 4
def test_greedy_tree_equals_ar(family):
    for vocab, seed in ((64, 3), (6, 4)):   # 6 ids: a random head is often right, accepts and rejects mix
        target = Target.from_hf(tiny_model(family, num_layers=4, vocab=vocab, seed=seed))
        head = EagleHead.create(target, seed=1).eval()
        accepted = 0
        for prompt in PROMPTS:
            prompt = [t % vocab for t in prompt]
            reference, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
            for options in SHAPES:
                tokens, s = eagle_tree_generate(target, head, prompt, options, max_new_tokens=NEW, eos_token_ids=())
                assert tokens == reference, (family, vocab, options, prompt)
                assert s.new_tokens - 1 == s.rounds + s.accepted   # each round: accepted path + 1 own
                assert s.accepted == sum(s.accepted_by_position) and s.verified == sum(s.verified_by_position)
                assert s.draft_tokens <= options.budget * s.rounds
                assert sum(s.verify_sizes.values()) == s.rounds and max(s.verify_sizes) <= options.budget + 1
                accepted += s.accepted
        assert vocab == 64 or accepted > 0


def prefilled(target, head, prompt):
    """(tokens with the target's first token, head cache, features) as a round sees them."""
    cache = target.new_cache()
    _, snaps = target.prefill(torch.tensor(prompt), cache, set(head.feature_layers))
    features = torch.stack([snaps[i] for i in head.feature_layers], 1)
    return prompt + [0], KVCache([0]), features


@torch.no_grad()
def chain_scores(head, tokens, features, path):
    """Path log-score of each node of `path` from a no-cache recompute of the head's chain."""
    c = len(tokens) - 1
    g = head.fused(features[:c])
    ids, feats, score, out = tokens[1:c + 1], [g[t] for t in range(c)], 0.0, []
    for j, node in enumerate(path):
        pos = torch.arange(c + j)
        a = head(torch.tensor(ids)[None], torch.stack(feats)[None], pos, attention_mask(pos, c + j, g.dtype))
        score += float(torch.log_softmax(head.logits(a[0, -1]), -1)[node.token])
        out.append(score)
        ids, feats = ids + [node.token], feats + [a[0, -1]]
    return out


@pytest.mark.parametrize("options", [TreeOptions(5), TreeOptions(12, depth=3, top_k=3), TreeOptions(40, depth=4, top_k=4)])
def test_tree_shape_and_scores(options, monkeypatch):
    """Budget respected, parents first, siblings distinct, best-B kept, scores = the chain's."""
    real_best, ranked = eagle_tree._best, []
    monkeypatch.setattr(eagle_tree, "_best", lambda nodes, count: ranked.append(list(nodes)) or real_best(nodes, count))
    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=64, seed=2))
    head = EagleHead.create(target, seed=5).eval()
    tokens, cache, features = prefilled(target, head, [5, 9, 2, 33, 7, 1])
    c = len(tokens) - 1
    with torch.inference_mode():
        root, nodes, calls = draft_tree(head, cache, tokens, features, c, options, SamplingParams())
    proposed = options.top_k + (options.depth - 1) * options.top_k ** 2
    assert len(nodes) == min(options.budget, proposed) and calls == options.depth
    seen = {root.uid: root}
    for n in nodes:
        assert n.parent.uid in seen and n.position == n.parent.position + 1 <= c + options.depth
        seen[n.uid] = n
    siblings = {}
    for n in nodes:
        siblings.setdefault(n.parent.uid, []).append(n.token)
    assert all(len(set(t)) == len(t) for t in siblings.values())
    assert cache.length(0) == c + (options.depth - 1) * options.top_k
    for n in nodes:   # every node's score is its path's log-probability under the head alone
        path, x = [], n
        while x is not root:
            path.append(x)
            x = x.parent
        assert chain_scores(head, tokens, features, path[::-1])[-1] == pytest.approx(n.score, abs=1e-4)
    everything = ranked[-1]   # the final re-ranking sees every proposed node, expanded or not
    assert len(everything) == proposed and {n.uid for n in nodes} <= {n.uid for n in everything}
    dropped = [n for n in everything if n.uid not in {m.uid for m in nodes}]
    assert not dropped or max(n.score for n in dropped) <= min(n.score for n in nodes)


def test_caches_and_features_are_compacted_to_the_accepted_path(monkeypatch):
    """After every round the target's cache and the features equal a fresh prefill of the sequence."""
    target = Target.from_hf(tiny_model("qwen3", num_layers=4, vocab=6, seed=6))
    head = EagleHead.create(target, seed=2).eval()
    real, rounds = eagle_tree.tree_round, []

    def checking(state, options, room):
        emitted = real(state, options, room)
        kept = state.tokens + emitted[:-1]
        fresh = target.new_cache()
        _, snaps = target.prefill(torch.tensor(kept), fresh, state.record)
        for layer in range(target.num_layers):
            assert state.cache.length(layer) == len(kept)
            have = state.cache._keys[layer][:, :, :len(kept)]
            assert torch.allclose(have, fresh._keys[layer][:, :, :len(kept)], atol=1e-5)
        for j, i in enumerate(head.feature_layers):
            assert torch.allclose(state.features[:len(kept), j], snaps[i], atol=1e-5)
        rounds.append(len(emitted))
        return emitted

    monkeypatch.setattr(eagle_tree, "tree_round", checking)
    prompt = [2, 0, 5, 1]
    reference, _ = ar_generate(target, prompt, max_new_tokens=40, eos_token_ids=())
    tokens, s = eagle_tree_generate(target, head, prompt, TreeOptions(8, depth=3, top_k=3),
                                    max_new_tokens=40, eos_token_ids=())
    assert tokens == reference and len(rounds) == s.rounds > 10 and max(rounds) > 1


def test_oracle_tree_accepts_a_whole_path_each_round(monkeypatch):
    """A tree holding the target's continuation (behind wrong siblings) is accepted to its depth."""
    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=6, seed=7))
    head = EagleHead.create(target).eval()
    prompt = [2, 0, 5]
    reference, _ = ar_generate(target, prompt, max_new_tokens=25, eos_token_ids=())

    def oracle(head, cache, tokens, features, c, options, params, depth=None):
        root = Node(tokens[c], c)
        nodes, parent = [], root
        for j in range(min(depth, options.depth)):
            true = reference[c - len(prompt) + 1 + j]
            wrong = Node((true + 1) % 6, parent.position + 1, parent=parent)
            nodes += [wrong, Node(true, parent.position + 1, parent=parent)]
            parent = nodes[-1]
        return root, nodes, 1

    monkeypatch.setattr(eagle_tree, "draft_tree", oracle)
    tokens, s = eagle_tree_generate(target, head, prompt, TreeOptions(8, depth=4), max_new_tokens=25,
                                    eos_token_ids=())
    assert tokens == reference
    # 24 tokens after the prefill: 4 rounds of 4 accepted + bonus, then 3 + bonus (the budget)
    assert s.rounds == 5 and s.accepted == s.verified == 19 and s.mean_accepted_length == pytest.approx(24 / 5)


def test_tree_eos_and_short_budgets():
    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=6, seed=5))
    head = EagleHead.create(target, seed=2).eval()
    prompt = [1, 2, 3]
    reference, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
    eos = reference[5]
    cut = reference[: reference.index(eos) + 1]
    for options in (TreeOptions(2), TreeOptions(8, depth=4, top_k=2)):
        assert eagle_tree_generate(target, head, prompt, options, max_new_tokens=NEW, eos_token_ids=[eos])[0] == cut
        for budget in range(0, options.depth + 3):
            tokens, stats = eagle_tree_generate(target, head, prompt, options, max_new_tokens=budget,
                                                eos_token_ids=())
            assert tokens == reference[:budget] and stats.new_tokens == budget


def test_bad_options_and_recurrent_targets_are_refused():
    with pytest.raises(ValueError, match="budget must be >= 1"):
        TreeOptions(0)
    with pytest.raises(ValueError, match="depth"):
        TreeOptions(4, depth=-1)
    assert (TreeOptions(4).depth, TreeOptions(4).top_k) == (4, 4)
    assert (TreeOptions(32).depth, TreeOptions(32).top_k) == (6, 8)
    recurrent = Target.from_hf(tiny_model("qwen3_5_text", num_layers=4))
    head = EagleHead.create(recurrent).eval()
    with pytest.raises(ValueError, match="recurrent"):
        eagle_tree_generate(recurrent, head, [1, 2], TreeOptions(4), max_new_tokens=4)
