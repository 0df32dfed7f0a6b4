"""The methods a benchmark compares, by name, each turned into one per-prompt record.

Names: `ar`, `spd-n<N>`, `ppsd-n<N>`, `eagle-k<K>`; `spd-n<N>-w<W>` is tree SPD keeping W candidates
per pipeline level (`spd.tree`); `eagle-tree-b<B>` is EAGLE-2-style tree drafting with a budget of B
draft nodes (`spd.baselines.eagle_tree`; `-d<D>` / `-k<K>` after it set the depth and top-k); `spd-n<N>+retrieval` is SPD with the hybrid
drafter (`spd.retrieval`), `eagle-k<K>+retrieval` drafts a retrieved chain when the sequence's
suffix matches earlier text (at least EAGLE_RETRIEVAL_MIN_LEN tokens), else the head's chain. A method runs on the shared target with
spd's own cache and sampling code and returns the fields the report needs (same names for
every method; a field a method has no notion of is None):

    tokens, cycles, target_forwards, draft_forwards, verified, accepted,
    verified_by_position, accepted_by_position, drafts_by_source, prefill_seconds, decode_seconds,
    draft_seconds, draft_tokens, verify_sizes

"position" is where a draft sat: for SPD / PPSD the pipeline fill when it was drafted
(1..n, n = steady state), for EAGLE-style drafting its index in the chain (1..k) or its depth in
the tree.

Records can also come from a replay over AR's tokens (`spd.bench.acceptance`; sampled: one draw of
the counts' law given AR's sample): `Runner.replay` gives the same count fields from the hidden
states of one target forward (`replay_anchors`), with no timings (None); tree SPD (width > 1) has none.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from ..baselines.ar import ar_generate
from ..baselines.eagle import EagleHead, eagle_generate
from ..baselines.eagle_tree import TreeOptions, eagle_tree_generate
from ..baselines.heads import read_head_config
from ..baselines.load import load_head
from ..baselines.ppsd import PPSDConfig, PPSDDrafter, PPSDHead
from ..checkpoint import load_pdm, read_config
from ..engine import generate
from ..pdm import PDM
from ..retrieval import Gate, make_drafter
from ..sampling import SamplingParams
from ..shipped import shipped_head, shipped_pdm
from ..target import Target, split_layers
from ..tree import TreeConfig
from . import costs
from .acceptance import eagle_replay, replay

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(ar)$|^(spd|ppsd)-n(\d+)$|^(eagle)-k(\d+)$")
_WIDTH = re.compile(r"^(spd-n\d+)-w(\d+)")   # spd-n4-w4 -> spd-n4, width 4
_TREE = re.compile(r"^eagle-tree-b(\d+)(?:-d(\d+))?(?:-k(\d+))?$")   # eagle-tree-b16[-d6][-k8]
RETRIEVAL = "+retrieval"    # suffix: spd-n<N>+retrieval (the hybrid drafter), eagle-k<K>+retrieval
EAGLE_RETRIEVAL_MIN_LEN = 3  # a retrieved chain replaces the head's from a match this long (SAM-Decoding style)


@dataclass(frozen=True)
class MethodSpec:
    kind: str                  # ar | spd | ppsd | eagle
    n: int | None = None       # pipeline stages (spd, ppsd)
    k: int | None = None       # drafts per round (eagle)
    retrieval: bool = False    # drafts from the sequence itself beside the PDM / head
    width: int = 1             # tree SPD: candidates kept per pipeline level (spd only)
    tree: TreeOptions | None = None   # eagle only: tree drafting with this budget / depth / top-k

    @property
    def verify_tokens(self) -> int | None:
        """Tokens in a full verification forward (eagle: k + 1 or B + 1), a tree SPD level's W
        tokens per stage, else None."""
        if self.kind == "spd" and self.width > 1:
            return self.width
        if self.kind != "eagle":
            return None
        return self.tree.budget + 1 if self.tree is not None else self.k + 1

    @property
    def name(self) -> str:
        if self.kind == "ar":
            return "ar"
        if self.tree is not None:
            t, default = self.tree, TreeOptions(self.tree.budget)
            return (f"eagle-tree-b{t.budget}" + (f"-d{t.depth}" if t.depth != default.depth else "")
                    + (f"-k{t.top_k}" if t.top_k != default.top_k else ""))
        base = f"{self.kind}-n{self.n}" if self.kind in ("spd", "ppsd") else f"eagle-k{self.k}"
        base += f"-w{self.width}" if self.width > 1 else ""
        return base + (RETRIEVAL if self.retrieval else "")

    @classmethod
    def parse(cls, name: str) -> "MethodSpec":
        name = name.strip()
        tree = _TREE.match(name)
        if tree:
            budget, depth, top_k = (int(g or 0) for g in tree.groups())
            if budget < 1 or (tree.group(2) and depth < 1) or (tree.group(3) and top_k < 1):
                raise ValueError(f"{name!r}: tree budget, depth and top-k must be >= 1 (e.g. eagle-tree-b16-d6-k8)")
            return cls("eagle", tree=TreeOptions(budget, depth, top_k))
        retrieval = name.endswith(RETRIEVAL)
        width = _WIDTH.match(name)
        if width:
            name = width.group(1) + name[width.end():]
        m = _NAME.match(name.removesuffix(RETRIEVAL))
        if (not m or (m.group(3) and int(m.group(3)) < 1) or (m.group(5) and int(m.group(5)) < 1)
                or (retrieval and not (m.group(2) == "spd" or m.group(4)))
                or (width and (int(width.group(2)) < 1 or m.group(2) != "spd"))):
            raise ValueError(f"unknown method {name!r}: use ar, spd-n<N>, spd-n<N>-w<W>, ppsd-n<N>, eagle-k<K> or "
                             f"eagle-tree-b<B> (optionally -d<depth>-k<top-k>), and "
                             f"spd-n<N>+retrieval or eagle-k<K>+retrieval for drafting with retrieval beside "
                             f"them (e.g. ar,spd-n2,spd-n2+retrieval,ppsd-n4,eagle-k3,eagle-k5+retrieval)")
        if m.group(1):
            return cls("ar")
        if m.group(2):
            return cls(m.group(2), n=int(m.group(3)), retrieval=retrieval,
                       width=int(width.group(2)) if width else 1)
        return cls("eagle", k=int(m.group(5)), retrieval=retrieval)


def parse_methods(text: str) -> list[MethodSpec]:
    """'ar,spd-n4,...' -> specs, AR first (it is the reference of every comparison), no repeats."""
    specs = [MethodSpec.parse(x) for x in text.split(",") if x.strip()]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"method listed twice in {text!r}")
    return [MethodSpec("ar")] + [s for s in specs if s.kind != "ar"]


@dataclass
class Runner:
    """One method, ready: `run()` decodes a prompt and returns its record fields."""

    spec: MethodSpec
    target: Target
    checkpoint: str | None
    untrained: bool
    _decode: object = None
    _probe: object = None
    _replay: object = None              # (prompt, continuation, max_new, snapshots, params) -> record fields
    replay_anchors: tuple[int, ...] = ()   # hidden-state indices the replay reads

    def run(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int, eos) -> dict:
        return self._decode(prompt_ids, params, max_new_tokens, eos)

    @property
    def replayable(self) -> bool:
        return self._replay is not None

    def replay(self, prompt_ids: list[int], continuation: list[int], max_new_tokens: int, snapshots: dict,
               params: SamplingParams) -> dict:
        """Record fields for decoding `continuation` (AR's tokens under `params`), without decoding."""
        fields = self._replay(prompt_ids, continuation, max_new_tokens, snapshots, params)
        return {**fields, "tokens": list(continuation), "prefill_seconds": None, "decode_seconds": None,
                "draft_seconds": None}

    def draft_step(self, context: int):
        """A callable making one steady-state draft forward, or None (AR drafts nothing)."""
        return self._probe(context) if self._probe is not None else None

    def info(self) -> dict:
        tree = self.spec.tree
        return {"kind": self.spec.kind, "n": self.spec.n, "k": self.spec.k,
                "tree": None if tree is None else {"budget": tree.budget, "depth": tree.depth, "top_k": tree.top_k},
                "checkpoint": self.checkpoint, "untrained": self.untrained}


def _pipeline_record(tokens: list[int], s) -> dict:
    return {"tokens": tokens, "cycles": s.cycles, "target_forwards": None,
            "draft_forwards": s.cycles, "verified": s.accepted + s.rejected, "accepted": s.accepted,
            "drafts_by_source": s.drafts_by_source,
            "verified_by_position": list(s.verified_by_fill), "accepted_by_position": list(s.accepted_by_fill),
            "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
            "draft_seconds": s.pdm_seconds, "tree_width": s.tree_width, "mean_width": s.mean_width,
            "stage_tokens": s.stage_tokens, "cycles_by_width": s.cycles_by_width}


def _eagle_record(tokens: list[int], s) -> dict:
    return {"tokens": tokens, "cycles": None, "target_forwards": s.rounds,
            "draft_forwards": s.draft_forwards, "verified": s.verified, "accepted": s.accepted,
            "drafts_by_source": s.drafts_by_source,
            "verified_by_position": s.verified_by_position, "accepted_by_position": s.accepted_by_position,
            "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
            "draft_seconds": s.draft_seconds, "draft_tokens": s.draft_tokens,
            "verify_sizes": s.verify_sizes}


def _find(paths, n: int, read_n) -> str | None:
    found = [p for p in paths if read_n(p) == n]
    if len(found) > 1:
        raise ValueError(f"several checkpoints for n={n}: {found}; give one per n")
    return found[0] if found else None


def build_runner(spec: MethodSpec, target: Target, model: str, pdms=(), ppsds=(), eagle: str | None = None
                 ) -> Runner:
    """The runner for a method; checkpoints are matched to it by their n (untrained if none)."""
    if spec.kind == "ar":
        def decode(prompt, params, max_new, eos):
            tokens, s = ar_generate(target, prompt, params, max_new, eos)
            return {"tokens": tokens, "cycles": None, "target_forwards": s.forwards, "draft_forwards": 0,
                    "verified": 0, "accepted": 0, "verified_by_position": [], "accepted_by_position": [],
                    "drafts_by_source": {},
                    "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
                    "draft_seconds": 0.0}
        return Runner(spec, target, None, False, decode)

    if spec.kind == "eagle":
        eagle = eagle or shipped_head(model, "eagle")
        head = load_head(eagle, target, "eagle") if eagle else None
        if head is None:
            log.warning("%s: no --eagle head given: a random head (almost every draft rejected)", spec.name)
            head = EagleHead.create(target).eval()

        min_len = EAGLE_RETRIEVAL_MIN_LEN if spec.retrieval else None

        def decode(prompt, params, max_new, eos):
            if spec.tree is not None:
                tokens, s = eagle_tree_generate(target, head, prompt, spec.tree, params, max_new, eos)
            else:
                tokens, s = eagle_generate(target, head, prompt, spec.k, params, max_new, eos, min_len)
            return _eagle_record(tokens, s)

        def replayed(prompt, continuation, max_new, snapshots, params):
            k = None if spec.tree is not None else spec.k
            return _eagle_record(continuation, eagle_replay(target, head, prompt, continuation, max_new, k, spec.tree,
                                                            min_len, snapshots, params))
        probe = (lambda context: costs.eagle_tree_draft_step(target, head, spec.tree, context)) if spec.tree \
            else (lambda context: costs.eagle_draft_step(target, head, context))
        return Runner(spec, target, eagle, eagle is None, decode, probe, replayed,
                      (*head.feature_layers, target.num_layers))

    n = spec.n
    if spec.kind == "spd":
        path = _find(pdms, n, lambda p: read_config(p).n_stages) or shipped_pdm(model, n, None)
        if path is not None:
            stage_layers = list(read_config(path).stage_layers)
            pdm = load_pdm(path, target, stage_layers)
        else:
            log.warning("spd-n%d: no PDM for n=%d: a random PDM (almost every draft rejected)", n, n)
            stage_layers = [len(s) for s in split_layers(target.num_layers, n)]
            pdm = PDM.create(target, stage_layers).eval()
        gate = Gate.load(path) if path is not None else Gate()
        make = lambda: make_drafter("hybrid" if spec.retrieval else "pdm", pdm, gate)  # noqa: E731
    else:
        path = _find(ppsds, n, lambda p: PPSDConfig.from_json(read_head_config(p)[1]).n_stages) or shipped_head(model, "ppsd", n)
        if path is not None:
            head = load_head(path, target, "ppsd")
            stage_layers = list(head.config.stage_layers)
        else:
            log.info("ppsd-n%d: no --ppsd head for n=%d: the target's own early exit (untrained head)", n, n)
            stage_layers = [len(s) for s in split_layers(target.num_layers, n)]
            head = PPSDHead.create(target, stage_layers).eval()
        make = lambda: PPSDDrafter(head)  # noqa: E731
    stages = split_layers(target.num_layers, n, stage_layers)

    def decode(prompt, params, max_new, eos):
        result = generate(target, make(), prompt, stages, params, max_new, eos, tree=TreeConfig(spec.width))
        return _pipeline_record(result.tokens, result.stats)

    def replayed(prompt, continuation, max_new, snapshots, params):
        return _pipeline_record(continuation, replay(target, make(), prompt, continuation, n, snapshots, params))
    return Runner(spec, target, path, path is None, decode,
                  lambda context: costs.pipeline_draft_step(target, make(), n, context),
                  replayed if spec.width == 1 else None, (*make().anchors, target.num_layers))


@torch.inference_mode()
def warm_up(runner: Runner, vocab_size: int) -> None:
    """One short untimed decode: first calls allocate and pick kernels."""
    runner.run([1 % vocab_size, 2 % vocab_size, 3 % vocab_size], SamplingParams(), 6, ())
