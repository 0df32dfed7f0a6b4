"""EAGLE-style chain drafting (the EAGLE-3 idea, in spd's own code) and its decode loop.

The draft head reads, for each finished position t, a *fused feature* of the target's pre-norm
hidden states at a low, a mid and a high layer (EAGLE-3's multi-layer feature; default hidden-state
indices {2, L/2, L-3}) together with the embedding of the token at t+1, and predicts the token at
t+2 with one decoder layer of the target's own architecture, the target's final norm and a draft
lm_head:

    row_t = fc([rms(embed(x_{t+1})) ; g_t]),   g_t = fuse([rms(h_low_t) ; rms(h_mid_t) ; rms(h_high_t)])
    a_t   = layer(row_t | rows < t)       logits(x_{t+2}) = lm_head(norm(a_t))

Drafting k tokens is autoregressive: after the first draft, the target's feature of the newest
(unverified) token does not exist, so the head's own output a replaces g (EAGLE-3's
"training-time test" input). The target then verifies all k drafts in ONE forward over
[x_c, d_1..d_k] with a causal mask (the same `Target.run_layers` as every other forward): the
longest accepted prefix is kept, plus the target's own token after it (recovered or bonus);
`KVCache.crop` drops the rest. Greedy or speculative sampling, lossless either way.

This module knows the head, the decode loop (`decode_rounds`: prefill, rounds, budget, EOS; tree
drafting in `eagle_tree` runs the same loop with its own round) and the chain round; training
lives in `train_heads`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch
from torch import nn

from ..cache import KVCache
from ..pdm import TargetFingerprint, _body_config
from ..retrieval import SuffixIndex
from ..sampling import SamplingParams, sample, verify
from ..target import Target, attention_mask
from .heads import DraftVocabHead, pick


def default_feature_layers(num_layers: int) -> list[int]:
    """Low / mid / high pre-norm hidden-state indices {2, L/2, L-3}, clipped to [1, L]."""
    return sorted({min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3)})


@dataclass(frozen=True)
class EagleConfig:
    target: TargetFingerprint
    feature_layers: tuple[int, ...]       # hidden-state indices fused into g (pre-norm)
    draft_vocab_size: int | None = None   # None: the full vocabulary
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "EagleConfig":
        data = dict(data)
        data["target"] = TargetFingerprint(**data["target"])
        data["feature_layers"] = tuple(data["feature_layers"])
        return cls(**data)


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Scale-free inputs: hidden states grow with depth and embeddings are small; all get unit RMS."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class EagleHead(nn.Module):
    """fuse (mH -> H) + fc (2H -> H) + one target-architecture decoder layer + draft lm_head."""

    METHOD = "eagle"

    def __init__(self, config: EagleConfig, target: Target):
        super().__init__()
        hidden, m = target.hidden_size, len(config.feature_layers)
        if not config.feature_layers or any(not 1 <= i <= target.num_layers for i in config.feature_layers):
            raise ValueError(f"feature layers {list(config.feature_layers)} must be layer-output "
                             f"hidden-state indices in [1, {target.num_layers}]")
        self.config = config
        self.fuse = nn.Linear(m * hidden, hidden, bias=False)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = target.layer_class(_body_config(target.config, 1), layer_idx=0)
        self.lm_head = DraftVocabHead(hidden, target.vocab_size, config.draft_vocab_size)
        # shared with the target, frozen, not part of the head's weights
        self._target = {"embed": target.embed_tokens, "norm": target.norm, "rotary_emb": target.rotary_emb}

    @property
    def feature_layers(self) -> list[int]:
        return list(self.config.feature_layers)

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """(..., m, H) target hidden states at the feature layers -> (..., H) fused feature g."""
        return self.fuse(_rms(features).flatten(-2))

    def forward(self, next_ids: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                mask=None, cache=None) -> torch.Tensor:
        """(B, r) ids of the tokens after each row, (B, r, H) features g or a, (r,) positions
        -> (B, r, H) pre-norm outputs a (the next step's feature)."""
        assert next_ids.shape == feature.shape[:2] and feature.shape[1] == len(positions)
        rows = self.fc(torch.cat([_rms(self._target["embed"](next_ids)), feature], dim=-1))
        position_ids = positions[None]
        rope = self._target["rotary_emb"](rows, position_ids=position_ids)
        return self.layer(rows, attention_mask=mask, position_ids=position_ids, cache=cache,
                          position_embeddings=rope)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """(..., H) outputs a -> (..., V) float32 full-vocabulary logits."""
        return self.lm_head(self._target["norm"](out))

    @classmethod
    def create(cls, target: Target, feature_layers: list[int] | None = None,
               draft_ids: list[int] | None = None, seed: int = 0) -> "EagleHead":
        """A fresh head; lm_head rows copied from the target, decoder layer randomly initialised."""
        layers = feature_layers if feature_layers is not None else default_feature_layers(target.num_layers)
        config = EagleConfig(TargetFingerprint.of(target), tuple(layers),
                             len(draft_ids) if draft_ids is not None else None)
        torch.manual_seed(seed)
        head = cls(config, target)
        head.lm_head.init_from(target, draft_ids)
        return head.to(device=target.device, dtype=target.dtype)


@dataclass
class EagleStats:
    k: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0                # target forwards after prefill (one verification each)
    draft_forwards: int = 0
    accepted: int = 0
    verified: int = 0              # drafts checked (up to and including the first rejection)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    verified_by_position: list[int] = field(default_factory=list)   # index j: the (j+1)-th draft
    accepted_by_position: list[int] = field(default_factory=list)
    drafts_by_source: dict[str, list[int]] = field(default_factory=dict)   # head/retrieval -> [verified, accepted]
    draft_tokens: int = 0          # drafts sent to the target (chain: up to k a round; tree: its nodes)
    verify_sizes: dict[int, int] = field(default_factory=dict)   # tokens in a verification forward -> rounds

    def count_forward(self, size: int) -> None:
        """One verification forward over `size` tokens (x_c and size - 1 drafts)."""
        self.draft_tokens += size - 1
        self.verify_sizes[size] = self.verify_sizes.get(size, 0) + 1

    @property
    def per_draft_acceptance(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward after prefill (accepted drafts + the target's own)."""
        return (self.new_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return (self.new_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "per_draft_acceptance": self.per_draft_acceptance,
                "mean_accepted_length": self.mean_accepted_length,
                "decode_tokens_per_second": self.decode_tokens_per_second}


def draft_chain(head: EagleHead, cache: KVCache, tokens: list[int], features: torch.Tensor, c: int,
                k: int, params: SamplingParams, gen: torch.Generator, follow: list[int] | None = None
                ) -> tuple[list[int], list]:
    """k drafts for positions c+1..c+k; tokens[c] is the newest verified token. `follow` (a
    replay's known tokens) is fed to the next step instead of each draft: the q's of a chain whose
    drafts were all accepted.

    The head cache holds true-feature rows 0..start-1; rows start..c-1 (whose target features
    the last verification produced) run first, then one row per further draft on the head's own
    output. The caller crops the head cache back to c afterwards.
    """
    if k == 0:
        return [], []
    device = features.device
    start = cache.length(0)
    assert start < c, (start, c)
    positions = torch.arange(start, c, device=device)
    next_ids = torch.tensor(tokens[start + 1:c + 1], device=device)[None]
    mask = attention_mask(positions, start + len(positions), features.dtype)
    out = head(next_ids, head.fused(features[start:c])[None], positions, mask, cache)
    drafts, qs = [], []
    for j in range(k):
        draft, q = pick(head.logits(out[0, -1]), params, gen)
        drafts.append(draft)
        qs.append(q)
        if j + 1 < k:
            fed = draft if follow is None else follow[j]
            out = head(torch.tensor([[fed]], device=device), out[:, -1:],
                       torch.tensor([c + j], device=device), None, cache)
    return drafts, qs


def accept_prefix(drafts: list[int], qs: list, logits: torch.Tensor, params: SamplingParams,
                  gen: torch.Generator, stats: EagleStats, source: str = "head") -> tuple[int, int]:
    """Verify drafts in order against (k+1, V) target logits: (accepted count, target's token)."""
    counts = stats.drafts_by_source.setdefault(source, [0, 0])
    for j, (draft, q) in enumerate(zip(drafts, qs)):
        stats.verified += 1
        stats.verified_by_position[j] += 1
        counts[0] += 1
        accepted, token = verify(draft, q, logits[j], params, gen)
        if not accepted:
            return j, token                      # recovered token
        stats.accepted += 1
        stats.accepted_by_position[j] += 1
        counts[1] += 1
    return len(drafts), sample(logits[len(drafts)], params, gen)   # bonus token


@dataclass
class Decoding:
    """One sequence between rounds, shared by chain and tree drafting (`spd.baselines.eagle_tree`).

    tokens[c] (c = len(tokens) - 1) is the newest verified token: the target's cache holds
    positions 0..c-1, the head's cache true-feature rows 0..start-1 (start <= c), features[t]
    the target's (m, H) hidden states at the head's feature layers for every t < c."""

    target: Target
    head: EagleHead
    params: SamplingParams
    gen: torch.Generator
    stats: EagleStats
    tokens: list[int]
    cache: KVCache
    head_cache: KVCache
    features: torch.Tensor

    @property
    def c(self) -> int:
        return len(self.tokens) - 1

    @property
    def record(self) -> set[int]:
        return set(self.head.feature_layers)

    def keep(self, start: int, snapshots: dict, rows: list[int]) -> None:
        """Features of the verification forward's `rows` become those of positions start, start+1, ..."""
        index = torch.tensor(rows, device=self.features.device)
        self.features[start:start + len(rows)] = torch.stack(
            [snapshots[i][index] for i in self.head.feature_layers], 1)


@torch.inference_mode()
def decode_rounds(target: Target, head: EagleHead, prompt_ids: list[int], round_fn, params: SamplingParams,
                  max_new_tokens: int, eos_token_ids, stats: EagleStats, slack: int) -> Iterator[int]:
    """Prefill, then rounds until EOS or the budget; yields the new tokens.

    `round_fn(decoding, room)` drafts at most `room` tokens, verifies them in ONE target forward
    and leaves both caches and the features at the accepted path; it returns the tokens to emit
    (accepted drafts, then the target's own). `slack`: feature rows past the budget a round's
    forward may write (the chain writes its whole block)."""
    assert len(prompt_ids) >= 1
    stats.prompt_tokens = len(prompt_ids)
    if max_new_tokens < 1:
        return
    device, eos = target.device, set(eos_token_ids)
    features = torch.zeros(len(prompt_ids) + max_new_tokens + slack, len(head.feature_layers),
                           target.hidden_size, device=device, dtype=target.dtype)
    state = Decoding(target, head, params, params.generator(device), stats, list(prompt_ids),
                     target.new_cache(keep=slack), KVCache([0]), features)
    t0 = time.perf_counter()
    last, snapshots = target.prefill(torch.tensor(prompt_ids, device=device), state.cache, state.record)
    state.keep(0, snapshots, list(range(len(prompt_ids))))
    state.tokens.append(sample(target.logits(last[0, -1]), params, state.gen))
    stats.prefill_seconds, stats.new_tokens = time.perf_counter() - t0, 1
    yield state.tokens[-1]
    if state.tokens[-1] in eos or max_new_tokens == 1:
        return
    t_decode = time.perf_counter()
    while True:
        emitted = round_fn(state, max_new_tokens - stats.new_tokens - 1)   # no drafts past the budget
        stats.rounds += 1
        for new in emitted:
            state.tokens.append(new)
            stats.new_tokens += 1
            stats.decode_seconds = time.perf_counter() - t_decode
            yield new
            if new in eos or stats.new_tokens >= max_new_tokens:
                return


def chain_drafts(state: Decoding, k: int, room: int, index: SuffixIndex | None, retrieval_min_len,
                 follow: list[int] | None = None) -> tuple[list[int], list, str]:
    """The round's chain of at most min(k, room) drafts, their q's and its source: the tokens that
    followed the sequence's suffix earlier when it matches >= retrieval_min_len tokens, else the head's."""
    n_draft = min(k, room)
    if index is not None and n_draft > 0:
        index.sync(state.tokens, len(state.tokens) - 1)
        if index.lookup()[1] >= retrieval_min_len:   # the head's forward is skipped this round
            drafts = index.continuation(n_draft)
            if drafts:
                return drafts, [None] * len(drafts), "retrieval"
    drafts, qs = draft_chain(state.head, state.head_cache, state.tokens, state.features, state.c, n_draft,
                             state.params, state.gen, follow=follow)
    state.stats.draft_forwards += n_draft
    return drafts, qs, "head"


def chain_round(state: Decoding, k: int, room: int, index: SuffixIndex | None, retrieval_min_len) -> list[int]:
    """k (at most `room`) chain drafts, one causal target forward over [x_c, d_1..d_k], crop."""
    target, stats, params, gen, tokens = state.target, state.stats, state.params, state.gen, state.tokens
    c, device = state.c, target.device
    t = time.perf_counter()
    drafts, qs, source = chain_drafts(state, k, room, index, retrieval_min_len)
    stats.draft_seconds += time.perf_counter() - t
    t = time.perf_counter()
    block = torch.tensor([tokens[c]] + drafts, device=device)
    positions = torch.arange(c, c + len(block), device=device)
    hidden, snapshots = target.run_layers_stepwise(target.embed(block), positions, range(target.num_layers),
                                                   state.cache, state.record)
    n_acc, token = accept_prefix(drafts, qs, target.logits(hidden[0]), params, gen, stats, source)
    state.cache.crop(c + n_acc + 1)                  # keep x_c and the accepted drafts
    state.keep(c, snapshots, list(range(n_acc + 1)))
    state.head_cache.crop(c)                         # rows on the head's own features are redone
    stats.count_forward(len(block))
    stats.verify_seconds += time.perf_counter() - t
    return drafts[:n_acc] + [token]


def eagle_stream(target: Target, head: EagleHead, prompt_ids: list[int], k: int = 5,
                 params: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
                 eos_token_ids=(), stats: EagleStats | None = None,
                 retrieval_min_len: int | None = None) -> Iterator[int]:
    """Yield the new tokens of one sequence: per round k drafts, one target forward.

    retrieval_min_len: when the sequence's newest suffix of at least this many tokens occurred
    before (`spd.retrieval.SuffixIndex`), the chain is the tokens that followed it (point
    masses, SAM-Decoding style) instead of the head's; None drafts with the head only."""
    assert k >= 1
    stats = stats if stats is not None else EagleStats(k)
    stats.k = k
    stats.verified_by_position, stats.accepted_by_position = [0] * k, [0] * k
    index = SuffixIndex() if retrieval_min_len is not None else None
    step = lambda state, room: chain_round(state, k, room, index, retrieval_min_len)  # noqa: E731
    # recurrent targets: a state per verified position, so k + 2 kept states
    return decode_rounds(target, head, prompt_ids, step, params, max_new_tokens, eos_token_ids, stats, k + 2)


def eagle_generate(target: Target, head: EagleHead, prompt_ids: list[int], k: int = 5,
                   params: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
                   eos_token_ids=None, retrieval_min_len: int | None = None) -> tuple[list[int], EagleStats]:
    eos = target.eos_token_ids if eos_token_ids is None else eos_token_ids
    stats = EagleStats(k)
    tokens = list(eagle_stream(target, head, prompt_ids, k, params, max_new_tokens, eos, stats,
                               retrieval_min_len))
    return tokens, stats
