"""Would the hybrid drafter gain from more than the PDM's top-1 probability, or from a corpus?

Replays held-out conversations like `spd gate` (one target forward each; every answer position
drafted from the saturated pipeline) and records per position: the in-sequence retrieval match
(length, token), the PDM's top-1 and its probability, the PDM's probability of the retrieved
token, and the prediction of a corpus n-gram table (REST-style: the longest suffix, up to 8
tokens, seen in the TRAINING token store, and the target's own argmax that most often followed
it there). Then, fitting on the first half of the conversations and scoring on the second:

- the shipped gate (retrieval where the PDM's top-1 probability is below a threshold per length);
- a two-feature gate per length (log q(retrieved) - a log p(top-1) above a cut);
- either of them, plus the corpus token where its rule (match length, share, support, PDM
  top-1 probability) was right more often than the current draft on the fitting half.

    python scripts/gate_sources.py --pdm src/spd/assets/pdm/smollm2-135m-n2-15-15 \\
        --heldout data/distill/heldout.jsonl --store runs/cache-4x --out runs/gate-sources-n2.npy

`--store` is a feature cache folder of `spd train` (tokens/ and features/argmax.bin) whose first
sequences are the held-out file's conversations (runs/all.jsonl of docs/pdm-smollm2.md); only the
tokens after them go into the n-gram table. `--records FILE` scores saved records again.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

MAX_LEN, PRIME = 8, np.int64(1000003)
COLUMNS = ("conversation", "t", "match_len", "top1_p", "q_retrieved", "retrieved", "top1", "corpus",
           "corpus_len", "corpus_count", "corpus_total", "target_next")


def suffix_hashes(ids: np.ndarray, k: int) -> np.ndarray:
    """Hash of ids[i-k+1..i] at every i, newest token first (wraps at the sequence start)."""
    h = np.zeros(len(ids), np.int64)
    with np.errstate(over="ignore"):
        for j in range(k):
            h = h * PRIME + np.roll(ids, j) + 1
    return h


def hash_suffix(tokens: list[int]) -> np.int64:
    h = np.int64(0)
    with np.errstate(over="ignore"):
        for x in reversed(tokens):
            h = h * PRIME + np.int64(x) + 1
    return h


def ngram_tables(store, skip_tokens: int) -> dict:
    """Per suffix length k: (sorted hashes, most frequent next token, its count, all counts)."""
    from spd.train.data import TokenStore

    tokens = TokenStore(f"{store}/tokens")
    argmax = np.memmap(f"{store}/features/argmax.bin", dtype=np.int32, mode="r", shape=(tokens.num_tokens,))
    ids, offsets = np.asarray(tokens.ids, np.int64), tokens.offsets
    start = np.repeat(offsets[:-1], np.diff(offsets))
    position = np.arange(len(ids)) - start
    tables = {}
    for k in range(1, MAX_LEN + 1):
        valid = (position >= k - 1) & (np.arange(len(ids)) >= skip_tokens)
        valid[:-1] &= start[:-1] == start[1:]
        valid[-1] = False
        at = np.nonzero(valid)[0]
        key = suffix_hashes(ids, k)[at]
        after = np.where(argmax[at] >= 0, argmax[at], ids[at + 1])   # the target's own next token
        order = np.lexsort((after, key))
        key, after = key[order], after[order]
        new = np.ones(len(key), bool)
        new[1:] = (key[1:] != key[:-1]) | (after[1:] != after[:-1])
        first = np.nonzero(new)[0]
        count, key, after = np.diff(np.append(first, len(key))), key[first], after[first]
        group = np.cumsum(np.append(True, key[1:] != key[:-1])) - 1
        order = np.lexsort((-count, group))
        top = order[np.append(True, group[order][1:] != group[order][:-1])]
        tables[k] = (key[top], after[top], count[top], np.bincount(group, weights=count).astype(np.int64))
    return tables


def corpus_lookup(tables: dict, tokens: list[int]) -> tuple[int, int, int, int]:
    """(token, suffix length, its count, all counts) of the longest suffix in the table."""
    best = (-1, 0, 0, 0)
    for k in range(1, min(MAX_LEN, len(tokens)) + 1):
        keys, after, count, total = tables[k]
        h = hash_suffix(tokens[-k:])
        j = min(int(np.searchsorted(keys, h)), len(keys) - 1)
        if keys[j] != h:
            break
        best = (int(after[j]), k, int(count[j]), int(total[j]))
    return best


@torch.inference_mode()
def record(args) -> np.ndarray:
    from spd.bench.acceptance import sequence_features
    from spd.checkpoint import load_pdm
    from spd.drafters import DraftState, PDMDrafter
    from spd.retrieval import SuffixIndex
    from spd.target import load_target
    from spd.train.data import chat_example
    from spd.train.gate import conversations, split_conversation

    target, tokenizer = load_target(args.model)
    pdm = load_pdm(args.pdm, target)
    chats = conversations(args.heldout, 0, args.conversations)
    with open(args.heldout) as f:
        held_tokens = sum(len(chat_example(json.loads(line)["messages"], tokenizer).ids) for line in f)
    tables = ngram_tables(args.store, held_tokens)
    n, rows = pdm.config.n_stages, []
    for c, messages in enumerate(chats):
        prompt, answer = split_conversation(tokenizer, messages)
        sequence = list(prompt) + list(answer)
        features, last = sequence_features(target, sequence, pdm.anchors)
        target_next = target.logits(last).argmax(-1).tolist()
        drafter, index = PDMDrafter(pdm), SuffixIndex(MAX_LEN)
        drafter.begin(len(prompt))
        for t in range(len(prompt), len(sequence) - 1):
            state = DraftState(sequence[:t + 1], max(len(prompt), t - n + 1), n, features)
            index.sync(state.tokens, t)
            retrieved, length = index.lookup()
            q = torch.softmax(drafter.logits(state), -1)
            top1_p, top1 = q.max(-1)
            corpus = corpus_lookup(tables, sequence[:t + 1])
            rows.append((c, t, length or 0, float(top1_p), -1.0 if retrieved is None else float(q[retrieved]),
                         -1 if retrieved is None else retrieved, int(top1), *corpus, target_next[t]))
        print(f"conversation {c + 1}/{len(chats)}: {len(rows)} positions", flush=True)
    return np.array(rows, dtype=np.float64)


def score(records: np.ndarray) -> None:
    col = {name: records[:, i] for i, name in enumerate(COLUMNS)}
    length = np.minimum(col["match_len"].astype(int), MAX_LEN)
    p, q_ret = col["top1_p"], col["q_retrieved"]
    retrieved, top1, corpus, truth = (col[k].astype(int) for k in ("retrieved", "top1", "corpus", "target_next"))
    pdm_ok, ret_ok, corpus_ok = top1 == truth, retrieved == truth, corpus == truth
    fit = col["conversation"] < np.median(np.unique(col["conversation"]))
    test = ~fit
    disagree = (length > 0) & (retrieved != top1)

    def per_length(scores_cuts) -> np.ndarray:
        """Retrieval where score > cut, per match length; the (score, cut) that is right most on `fit`."""
        take = np.zeros(len(records), bool)
        for k in range(1, MAX_LEN + 1):
            m = disagree & (length == k)
            best, choice = -1, None
            for s, cuts in scores_cuts(m):
                for cut in cuts:
                    right = np.where(s > cut, ret_ok[m], pdm_ok[m])[fit[m]].sum()
                    if right > best:
                        best, choice = right, s > cut
            take[m] = choice
        return take

    grid = np.concatenate([[-2.0], -np.linspace(0, 1, 101), [1.0]])
    gates = {
        "top-1 probability (shipped form)": per_length(lambda m: [(-p[m], grid)]),
        "log q(retrieved) - a log p(top-1)": per_length(lambda m: [
            (s, np.append(np.quantile(s, np.linspace(0, 1, 101)), [s.min() - 1, s.max() + 1]))
            for a in np.linspace(-1, 4, 21)
            for s in [np.log(np.maximum(q_ret[m], 0) + 1e-6) - a * np.log(p[m])]]),
    }
    print(f"{len(records):,} positions, {test.sum():,} scored (second half); PDM alone right "
          f"{pdm_ok[test].mean():.4f}, the corpus alone {corpus_ok[test].mean():.4f}; where retrieval and the PDM disagree ({(disagree & test).sum():,}): "
          f"PDM {pdm_ok[disagree & test].sum():,}, retrieval {ret_ok[disagree & test].sum():,}, "
          f"either {(pdm_ok | ret_ok)[disagree & test].sum():,}")
    share = col["corpus_count"] / np.maximum(col["corpus_total"], 1)
    for name, take in gates.items():
        draft = np.where(disagree & take, retrieved, top1)
        right = draft == truth
        print(f"{name}: right {right[test].mean():.4f} of all drafts")
        best, rule = 0, None
        for k in range(1, MAX_LEN + 1):
            for min_share in (0.5, 0.7, 0.8, 0.9):
                for min_total in (2, 4, 10):
                    for max_p in (0.2, 0.4, 0.6, 1.01):
                        switch = ((corpus >= 0) & (corpus != draft) & (col["corpus_len"] >= k) & (share >= min_share)
                                  & (col["corpus_total"] >= min_total) & (p < max_p))
                        gain = int(corpus_ok[switch & fit].sum() - right[switch & fit].sum())
                        if gain > best:
                            best, rule = gain, (k, min_share, min_total, max_p, switch)
        if rule is None:
            print("  + corpus: no rule gains on the fitting half")
            continue
        k, min_share, min_total, max_p, switch = rule
        gain = int(corpus_ok[switch & test].sum() - right[switch & test].sum())
        print(f"  + corpus (suffix >= {k}, share >= {min_share}, seen >= {min_total}, p(top-1) < {max_p}): "
              f"{gain:+d} right drafts of {test.sum():,} ({(switch & test).sum()} switched)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--pdm", help="PDM checkpoint folder")
    parser.add_argument("--heldout", default="data/distill/heldout.jsonl")
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--store", help="feature cache folder whose token store starts with --heldout")
    parser.add_argument("--out", help="save the records here (.npy)")
    parser.add_argument("--records", help="score these saved records instead of replaying")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.records:
        records = np.load(args.records)
    else:
        if not (args.pdm and args.store):
            parser.error("give --pdm and --store (or --records)")
        records = record(args)
        if args.out:
            np.save(args.out, records)
    score(records)


if __name__ == "__main__":
    main()
