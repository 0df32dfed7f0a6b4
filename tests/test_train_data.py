"""Training data: readers, chat rendering with assistant-only loss, stores, batches, vocab."""

import json

import numpy as np
import pytest
import torch

from conftest import tiny_model, tiny_tokenizer
from spd.baselines.ar import ar_generate
from spd.sampling import SamplingParams
from spd.target import Target
from spd.train.data import (
    DataError,
    Example,
    chat_example,
    cut,
    iter_records,
    locate_batch,
    open_token_store,
    plan_batches,
    record_example,
    regenerate,
    split_eval,
)
from spd.train.features import BatchLoader, FeatureStore, target_pass
from spd.vocab import count_tokens, load_vocab, save_vocab, top_ids

CHAT = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "good day"},
        {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine thanks"}]


def ids_of(tok, words):
    return tok.convert_tokens_to_ids(words)


def test_chat_scores_only_assistant_tokens():
    tok = tiny_tokenizer()
    ex = chat_example(CHAT, tok)
    scored = [i for i, m in zip(ex.ids, ex.mask) if m]
    assert scored == ids_of(tok, ["good", "day", "<|im_end|>", "fine", "thanks", "<|im_end|>"])
    assert len(ex.ids) == len(ex.mask) > len(scored)


def test_chat_without_template_is_a_clear_error():
    with pytest.raises(DataError, match="chat template"):
        record_example({"messages": CHAT}, tiny_tokenizer(chat_template=None))
    with pytest.raises(DataError, match="no tokenizer"):
        record_example({"messages": CHAT}, None)


def test_readers_text_jsonl_parquet(tmp_path):
    tok = tiny_tokenizer()
    (tmp_path / "a.txt").write_text("the cat sat\non the mat\n\n\na dog ran far\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"text": "hello world"}, {"messages": CHAT}, {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["good day", "fine thanks"]}), tmp_path / "c.parquet")
    records = list(iter_records([tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet"]))
    assert records[:2] == [{"text": "the cat sat\non the mat"}, {"text": "a dog ran far"}]
    assert [r.get("text") for r in records[5:]] == ["good day", "fine thanks"]
    examples = [record_example(r, tok) for r in records]
    assert examples[0].ids == ids_of(tok, ["the", "cat", "sat", "on", "the", "mat"]) and all(examples[0].mask)
    assert examples[4] == Example([1, 2, 3], [False, True, True])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_records([tmp_path / "missing.jsonl"]))
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(DataError, match="unknown format"):
        list(iter_records([tmp_path / "d.csv"]))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="bad.jsonl:1"):
        list(iter_records([tmp_path / "bad.jsonl"]))


def test_cut_and_pack():
    exs = [Example(list(range(5)), [True] * 5), Example([7, 8], [False, True])]
    assert [e.ids for e in cut(iter(exs), 2)] == [[0, 1], [2, 3], [4], [7, 8]]
    assert [e.ids for e in cut(iter(exs), 3, pack=True)] == [[0, 1, 2], [3, 4, 7], [8]]
    with pytest.raises(DataError, match="at least 2"):
        list(cut(iter(exs), 1))


def write_ids(path, seqs):
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return path


def test_token_store_roundtrip_and_skips(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"input_ids": [5, 6, 7, 8]}, {"input_ids": [9]}, {"input_ids": [1, 2], "loss_mask": [1, 0]},
        {"input_ids": [3, 4, 5], "loss_mask": [0, 0, 1]}]) + "\n")
    store = open_token_store(tmp_path / "s", [data], None, vocab_size=64, max_len=8)
    assert len(store) == 2 and store.meta["skipped"] == 2 and store.num_tokens == 7
    assert store.sequence(1)[0].tolist() == [3, 4, 5]
    assert store.scored([0, 1], 4).tolist() == [[True, True, True, False], [False, True, False, False]]
    ids, lengths = store.padded([1, 0])
    assert ids.tolist() == [[3, 4, 5, 0], [5, 6, 7, 8]] and lengths == [3, 4]
    assert open_token_store(tmp_path / "s", [data], None, 64, 8).folder == store.folder  # reused
    write_ids(tmp_path / "e.jsonl", [[1]])
    with pytest.raises(DataError, match="no sequence with a scored token"):
        open_token_store(tmp_path / "s2", [tmp_path / "e.jsonl"], None, 64, 8)
    write_ids(tmp_path / "f.jsonl", [[1, 99]])
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        open_token_store(tmp_path / "s3", [tmp_path / "f.jsonl"], None, 64, 8)


def test_plan_batches_bucketing():
    lengths = np.array([3, 50, 4, 48, 10, 12, 49, 5, 11, 2] * 5)
    idx = np.arange(len(lengths))
    batches = plan_batches(idx, lengths, batch_tokens=100, seed=1)
    assert sorted(i for b in batches for i in b) == list(idx)
    assert all(len(b) * max(lengths[b]) <= 100 for b in batches)
    assert batches == plan_batches(idx, lengths, 100, seed=1) != plan_batches(idx, lengths, 100, seed=2)
    pad = sum(len(b) * max(lengths[b]) for b in batches) / lengths.sum()
    assert pad < 1.3  # similar lengths together
    train, held = split_eval(np.full(50, 10), 0.1, 0)
    assert len(held) == 5 and not set(train) & set(held) and len(train) + len(held) == 50


def test_a_held_out_head_stays_fixed_and_training_takes_a_token_prefix():
    lengths = np.array([5, 7, 3, 10, 4, 6, 8])
    train, held = split_eval(lengths, 0.5, 0, eval_head=2)
    assert held.tolist() == [0, 1] and train.tolist() == [2, 3, 4, 5, 6]
    grown = np.concatenate([lengths, [9, 9]])        # data appended behind: the same held-out set
    assert split_eval(grown, 0.5, 0, eval_head=2)[1].tolist() == [0, 1]
    train, held = split_eval(lengths, 0.5, 0, eval_head=2, train_tokens=17)   # 3 + 10 + 4 = 17
    assert train.tolist() == [2, 3, 4] and held.tolist() == [0, 1]
    assert split_eval(lengths, 0.5, 0, eval_head=2, train_tokens=16)[0].tolist() == [2, 3]
    with pytest.raises(DataError, match="leaves no training data"):
        split_eval(lengths, 0.0, 0, eval_head=7)
    with pytest.raises(DataError, match="less than the first training sequence"):
        split_eval(lengths, 0.0, 0, eval_head=2, train_tokens=2)


def test_epochs_of_different_lengths_follow_one_another():
    """Reshuffled epochs bucket into different batch counts; micro-batch g walks them in turn.
    (g // len(epoch 0) once indexed past the end of a shorter epoch: IndexError mid-run.)"""
    lengths = np.random.default_rng(0).integers(2, 200, size=300)
    idx = np.arange(len(lengths))
    plans = [plan_batches(idx, lengths, 512, seed=e) for e in range(4)]
    sizes = [len(p) for p in plans]
    assert len(set(sizes)) > 1, sizes  # otherwise this test checks nothing
    walked = [plans[e][k] for e, k in (locate_batch(g, lambda e: sizes[e]) for g in range(sum(sizes)))]
    assert walked == [b for plan in plans for b in plan]


def test_feature_store_matches_the_target_pass(tmp_path):
    target = Target.from_hf(tiny_model("llama", num_layers=4))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 64, size=n).tolist() for n in (5, 9, 3, 7)]
    tokens = open_token_store(tmp_path / "t", [write_ids(tmp_path / "d.jsonl", seqs)], None, 64, 16)
    store = FeatureStore.open_or_create(tmp_path / "f", tokens, target, [0, 1, 2, 3], "float32")
    store.build(target, batch_tokens=16, progress=False)
    assert store.complete and store.anchors == [1, 2, 3, 4]
    reopened = FeatureStore.open_or_create(tmp_path / "f", tokens, target, [0, 2])
    with pytest.raises(ValueError, match="holds anchors"):
        FeatureStore.open_or_create(tmp_path / "f", tokens, target, [0, 2, 7])
    anchors = [0, 2, 4]
    cached, live = BatchLoader(target, tokens, anchors, reopened)([1, 0]), BatchLoader(target, tokens, anchors)([1, 0])
    assert cached.tokens == live.tokens == 14 and torch.equal(cached.score, live.score)
    real = torch.zeros(2, 9, dtype=torch.bool)
    real[0, :9], real[1, :5] = True, True
    torch.testing.assert_close(cached.features[real], live.features[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(cached.last, live.last, atol=1e-5, rtol=0)
    assert torch.equal(cached.argmax, live.argmax)
    # features of one unpadded sequence equal the padded batch's rows
    snaps, _ = target_pass(target, torch.tensor([seqs[0]]), anchors)
    torch.testing.assert_close(live.features[1, :5, 1], snaps[2][0], atol=1e-5, rtol=0)


def test_caches_follow_the_data_content_not_its_path(tmp_path):
    """A moved copy of the data reuses the token store and the feature cache; other data rebuilds
    the (cheap) token store, and the (costly) feature cache refuses instead of being overwritten."""
    target = Target.from_hf(tiny_model("llama", num_layers=2))
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    tokens = open_token_store(tmp_path / "t", [write_ids(tmp_path / "d.jsonl", seqs)], None, 64, 16)
    FeatureStore.open_or_create(tmp_path / "f", tokens, target, [0, 1], "float32").build(target, 16, progress=False)
    moved = write_ids(tmp_path / "elsewhere.jsonl", seqs)
    again = open_token_store(tmp_path / "t", [moved], None, 64, 16)
    assert again.meta == tokens.meta  # not rebuilt
    assert FeatureStore.open_or_create(tmp_path / "f", again, target, [0, 1]).complete
    other = open_token_store(tmp_path / "t", [write_ids(tmp_path / "o.jsonl", [[1, 2, 3, 9]])], None, 64, 16)
    assert other.meta["content"] != tokens.meta["content"] and other.sequence(0)[0].tolist() == [1, 2, 3, 9]
    with pytest.raises(ValueError, match="other token data.*delete"):
        FeatureStore.open_or_create(tmp_path / "f", other, target, [0, 1])
    assert json.loads((tmp_path / "f" / "meta.json").read_text())["complete"]  # left as it was


def test_regenerate_uses_the_targets_answers():
    tok = tiny_tokenizer()
    target = Target.from_hf(tiny_model("llama", num_layers=2, vocab=len(tok)))
    params = SamplingParams()
    out = regenerate(CHAT, target, tok, params, max_new_tokens=4)
    assert [m["role"] for m in out] == [m["role"] for m in CHAT] and out[0] == CHAT[0]
    prompt = tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    answer, _ = ar_generate(target, tok(prompt, add_special_tokens=False)["input_ids"], params, 4)
    assert out[1]["content"] == tok.decode(answer, skip_special_tokens=True)


def test_vocab_count_top_and_files(tmp_path):
    counts = count_tokens([([1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 1, 0]), ([5, 5], [1, 1])], 8)
    assert counts.tolist() == [0, 1, 2, 2, 0, 2, 0, 0]
    assert top_ids(counts, 2) == [2, 3] and top_ids(counts, 3, always=[7]) == [2, 3, 7]  # K in all
    path = save_vocab(tmp_path / "v.json", [2, 3, 5], counts)
    assert load_vocab(path, 8) == [2, 3, 5] and json.loads(path.read_text())["coverage"] == pytest.approx(6 / 7)
    with pytest.raises(ValueError, match="vocabulary of 8 tokens"):
        load_vocab(path, 16)
    (tmp_path / "v.txt").write_text("4\n1,9\n")
    assert load_vocab(tmp_path / "v.txt") == [1, 4, 9]
    with pytest.raises(FileNotFoundError, match="spd vocab"):
        load_vocab(tmp_path / "nope.json")


def test_feature_cache_pass_in_another_dtype(saved_llama6, tmp_path):
    """--feature-dtype bfloat16: the cache is built by the model loaded again in bf16 (the float32
    target trains on it), its features are the bf16 pass's, and the meta says which pass made them."""
    from spd.target import load_target
    from spd.train import TrainConfig, train

    model, folder = saved_llama6
    target = Target.from_hf(model)
    seqs = [np.random.default_rng(k).integers(0, 64, size=12).tolist() for k in range(6)]
    data = write_ids(tmp_path / "d.jsonl", seqs)
    cfg = TrainConfig(model=str(folder / "model"), data=(str(data),), out=str(tmp_path / "o"), stages=2,
                      max_steps=1, batch_tokens=48, eval_fraction=0.0, cache_dtype="float32",
                      feature_dtype="bfloat16", progress=False)
    train(cfg, target=target)
    features = tmp_path / "o" / "cache" / "features"
    assert json.loads((features / "meta.json").read_text())["pass_dtype"] == "bfloat16"
    tokens = open_token_store(tmp_path / "o" / "cache" / "tokens", [data], None, 64, 512)
    store = FeatureStore.open_or_create(features, tokens, target, [0, 3])
    cached, _, _ = store.read(0, [3])
    bf16 = load_target(str(folder / "model"), torch.bfloat16)[0]
    for pass_target, equal in ((bf16, True), (target, False)):
        snaps, _ = target_pass(pass_target, torch.tensor([seqs[0]]), [3])
        assert torch.equal(torch.from_numpy(np.array(cached[:, 0])), snaps[3][0].float()) == equal
