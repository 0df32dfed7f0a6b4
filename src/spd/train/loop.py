"""The PDM training loop: configuration, data and model setup, steps, eval, checkpoints, resume.

`train(TrainConfig)` is what `spd train` calls. One optimizer step = `grad_accum` micro-batches
(per process); each micro-batch draws its own per-position pipeline fills, from a generator
seeded by (seed, micro-batch index), and the data order is fixed by (seed, epoch), so a run
resumed from a checkpoint continues exactly as if it had not stopped. The loss is summed over
tokens and divided by the step's token count, so accumulation and DDP weigh every token alike.

The output folder is a PDM checkpoint (`spd generate --pdm OUT` loads it) plus `train_state.pt`
(optimizer state and step), `train_log.jsonl` and `train_summary.json`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from ..checkpoint import CONFIG, WEIGHTS, load_pdm, save_pdm
from ..pdm import PDM, default_anchors
from ..target import split_layers
from .data import locate_batch, open_token_store, plan_batches, split_eval
from .features import BatchLoader, FeatureStore
from .layout import pdm_layout, sample_fills, structural_mask
from .objective import DistillStats, DraftForward, distill, scale_projections, teacher_head, teacher_logits, vocab_index
from .session import STATE, Session, StopSignal, run_state, save_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    model: str                            # folder, hub id or "default"
    data: tuple[str, ...]                 # .txt / .jsonl / .parquet files
    out: str                              # the PDM checkpoint folder to write
    stages: int = 2
    split: tuple[int, ...] | None = None  # per-stage layer counts (default: most even)
    pdm_layers: int = 1                   # N_s
    anchors: tuple[int, ...] | None = None  # None: the spec's default for the split
    draft_vocab: str | None = None        # file from `spd vocab`
    init_from: str = "last"               # body init: "last" target layers, "none", or "12,13"
    proj_init: str = "scaled"             # scaled (to the data's anchor scales) | random
    layout: str = "auto"                  # auto | types | depths (see layout.py)
    partial_fill: float = 0.5             # share of cycles trained as partial pipelines
    temperature: float = 1.0              # distillation temperature
    max_len: int = 512
    pack: bool = False
    batch_tokens: int = 2048              # padded tokens per micro-batch
    max_steps: int | None = None
    epochs: float | None = None           # used when max_steps is None (default 1)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1             # cosine decays to lr * this
    warmup_steps: int | None = None       # default: 3% of the steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    grad_accum: int = 1
    precision: str = "fp32"               # fp32 | bf16 (autocast; use on GPU)
    device: str = "cpu"
    target_dtype: str = "float32"
    eval_fraction: float = 0.02
    eval_head: int = 0                    # hold out the first K sequences instead (a split fixed as data grows)
    train_tokens: int | None = None       # train on the leading training sequences up to this many tokens
    eval_every: int = 200                 # steps (0: only at the end)
    eval_tokens: int = 16384              # eval at most this many tokens
    save_every: int = 200                 # steps (0: only at the end / on a signal)
    log_every: int = 10
    resume: bool = False
    stop_after: int | None = None         # pause after this many steps (continue with resume)
    seed: int = 0
    cache: str | None = None              # token + feature cache folder (default OUT/cache)
    feature_cache: bool = True
    cache_anchors: tuple[int, ...] = ()   # extra anchors to store, for later runs with other n
    cache_dtype: str = "float16"
    feature_dtype: str | None = None      # target dtype of the feature-cache pass (default: target_dtype)
    regenerate: str | None = None         # None | greedy | sample: the target rewrites answers
    regen_temperature: float = 0.7
    regen_max_new_tokens: int = 256
    progress: bool = True

    # fields that must not change across a resume
    FIXED = ("model", "stages", "split", "pdm_layers", "anchors", "draft_vocab", "layout", "max_len",
             "pack", "batch_tokens", "grad_accum", "seed", "data", "eval_head", "train_tokens")


@dataclass
class TrainSummary:
    out: str
    step: int
    total_steps: int
    tokens: int = 0
    seconds: float = 0.0
    train_loss: float = 0.0
    train_agreement: float = 0.0
    eval: dict = field(default_factory=dict)
    interrupted: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up to lr, then cosine to lr * min_lr_ratio at `total`."""
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.03 * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# settings of one session, not of the run: never taken over from a saved run
SESSION_ONLY = ("resume", "stop_after", "progress")


def make_config(out: str, resume: bool = False, **given) -> TrainConfig:
    """TrainConfig from the settings given; with resume, the saved run's settings fill the rest."""
    names = {f.name for f in fields(TrainConfig)}
    unknown = set(given) - names
    if unknown:
        raise ValueError(f"unknown training settings: {sorted(unknown)}")
    settings = {}
    if resume:
        path = Path(out) / STATE
        if not path.is_file():
            raise FileNotFoundError(f"--resume: {out} holds no training state ({STATE})")
        saved = torch.load(path, map_location="cpu", weights_only=True)["config"]
        settings = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                    if k in names and k not in SESSION_ONLY}
    settings.update(given, out=str(out), resume=resume)
    missing = [f"--{k}" for k in ("model", "data") if not settings.get(k)]
    if missing:
        raise ValueError(f"{' and '.join(missing)} required (or --resume a run in --out)")
    return TrainConfig(**settings)


def build_pdm(target, cfg: TrainConfig) -> PDM:
    """A fresh PDM for the config (fp32 master weights)."""
    from ..vocab import load_vocab

    stage_layers = [len(s) for s in split_layers(target.num_layers, cfg.stages, list(cfg.split) if cfg.split else None)]
    anchors = list(cfg.anchors) if cfg.anchors else default_anchors(stage_layers)
    draft_ids = load_vocab(cfg.draft_vocab, target.vocab_size) if cfg.draft_vocab else None
    if cfg.init_from == "none":
        init = None
    elif cfg.init_from == "last":
        init = list(range(target.num_layers - cfg.pdm_layers, target.num_layers))
    else:
        init = [int(x) for x in cfg.init_from.split(",")]
        if len(init) != cfg.pdm_layers or not all(0 <= i < target.num_layers for i in init):
            raise ValueError(f"--init-from needs {cfg.pdm_layers} target layer indices in "
                             f"[0, {target.num_layers}), got {cfg.init_from!r}")
    pdm = PDM.create(target, stage_layers, anchors, cfg.pdm_layers, draft_ids, init, cfg.seed).float()
    return pdm


def check_config(cfg: TrainConfig) -> None:
    if cfg.max_len < 2:
        raise ValueError(f"--max-len must be at least 2 (one token and the next), got {cfg.max_len}")
    if cfg.batch_tokens < 2:
        raise ValueError(f"--batch-tokens must be at least 2, got {cfg.batch_tokens}")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {cfg.max_steps}")
    if cfg.epochs is not None and cfg.epochs <= 0:
        raise ValueError(f"--epochs must be > 0, got {cfg.epochs}")
    if not 0 <= cfg.partial_fill <= 1:
        raise ValueError(f"--partial-fill must be in [0, 1], got {cfg.partial_fill}")
    if cfg.precision not in ("fp32", "bf16"):
        raise ValueError(f"--precision must be fp32 or bf16, got {cfg.precision!r}")
    if cfg.proj_init not in ("scaled", "random"):
        raise ValueError(f"--proj-init must be scaled or random, got {cfg.proj_init!r}")
    if cfg.regenerate not in (None, "greedy", "sample"):
        raise ValueError(f"--regenerate must be greedy or sample, got {cfg.regenerate!r}")
    if cfg.grad_accum < 1 or cfg.temperature <= 0:
        raise ValueError("--grad-accum must be >= 1 and --temperature > 0")


def prepare_data(cfg: TrainConfig, target, tokenizer, anchors, rank: int = 0):
    """Token store (+ feature cache, built by rank 0) -> (tokens, BatchLoader)."""
    from ..sampling import SamplingParams

    cache = Path(cfg.cache) if cfg.cache else Path(cfg.out) / "cache"
    regen = None
    if cfg.regenerate:
        if tokenizer is None:
            raise ValueError("--regenerate needs a tokenizer with a chat template")
        temp = 0.0 if cfg.regenerate == "greedy" else cfg.regen_temperature
        regen = (target, SamplingParams(temperature=temp, seed=cfg.seed), cfg.regen_max_new_tokens)
    tokens = open_token_store(cache / "tokens", cfg.data, tokenizer, target.vocab_size, cfg.max_len, cfg.pack, regen)
    store = None
    if cfg.feature_cache:
        store = FeatureStore.open_or_create(cache / "features", tokens, target,
                                            sorted(set(anchors) | set(cfg.cache_anchors)), cfg.cache_dtype)
        if rank == 0 and not store.complete:
            store.build(_feature_target(cfg, target), batch_tokens=max(cfg.batch_tokens, 4096), progress=cfg.progress)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if rank != 0:  # reopen read-only now that rank 0 finished it
            store = FeatureStore.open_or_create(cache / "features", tokens, target, anchors, cfg.cache_dtype)
    return tokens, BatchLoader(target, tokens, anchors, store)


def _feature_target(cfg: TrainConfig, target):
    """The target that runs the feature-cache pass: `target`, or the model loaded again in
    --feature-dtype (bfloat16 runs that pass ~2x faster on CPUs with bf16 instructions; the
    features are stored as float16 either way, and training reads them in float32)."""
    from ..loading import parse_dtype

    if cfg.feature_dtype is None or parse_dtype(cfg.feature_dtype) == target.dtype:
        return target
    from ..target import load_target
    log.info("feature cache pass in %s", cfg.feature_dtype)
    return load_target(cfg.model, parse_dtype(cfg.feature_dtype), target.device)[0]


def train(cfg: TrainConfig, target=None, tokenizer=None) -> TrainSummary:
    """Train a PDM as configured; returns the summary (also written to OUT/train_summary.json)."""
    check_config(cfg)
    session = Session.start(cfg.device)
    run = _Run.open(cfg, session, target, tokenizer)
    summary = TrainSummary(cfg.out, run.step, run.total, tokens=run.resumed.get("tokens", 0))
    seconds_before = run.resumed.get("seconds", 0.0)  # totals count the run's earlier parts too
    end = run.total if cfg.stop_after is None else min(run.total, run.step + cfg.stop_after)
    bar = _bar(cfg.progress and session.rank == 0, run.total, run.step)
    window, t_start = DistillStats(), time.perf_counter()
    with StopSignal() as stop:
        while run.step < end:
            lr, stats, n_tokens = run.train_step()
            step = run.step
            window.add(stats)
            summary.tokens += n_tokens * session.world
            summary.seconds = seconds_before + time.perf_counter() - t_start
            bar.update(1)
            bar.set_postfix(loss=f"{window.loss:.3f}", agree=f"{window.agreement:.3f}",
                            tok_s=f"{summary.tokens_per_second:.0f}", lr=f"{lr:.1e}")
            if step % cfg.log_every == 0 or step == end:
                summary.train_loss, summary.train_agreement = window.loss, window.agreement
                session.log_line(run.out, {"step": step, "lr": lr, "loss": window.loss, "agreement": window.agreement,
                                           "tokens_per_second": summary.tokens_per_second})
                window = DistillStats()
            if cfg.eval_every and step % cfg.eval_every == 0 and step < end and run.eval_batches:
                summary.eval = run.evaluate()
                session.log_line(run.out, {"step": step, "eval": summary.eval})
                if session.rank == 0:
                    _say(bar, f"step {step}: " + _format_eval(summary.eval))
            if stop.reason or (cfg.save_every and step % cfg.save_every == 0 and step < end):
                run.checkpoint(summary)
            if stop.reason:
                summary.interrupted = stop.reason
                break
    bar.close()
    summary.step = run.step
    if run.eval_batches and not summary.interrupted:
        summary.eval = run.evaluate()
    run.checkpoint(summary)
    if session.rank == 0:
        (run.out / "train_summary.json").write_text(json.dumps(summary.to_dict(), indent=1) + "\n")
    session.close()
    return summary


def evaluate_checkpoint(cfg: TrainConfig, folder, target=None, tokenizer=None) -> dict:
    """Held-out loss and agreement of the PDM in `folder` on the eval split that `cfg` defines (its
    data, --eval-head or --eval-fraction, and cache): a data-size curve's point for a PDM trained
    elsewhere. The PDM's own split, anchors, body depth and draft vocabulary are used; nothing is
    written but the feature cache, where `cfg.cache` is unset (then in `cfg.out`/cache)."""
    session = Session.start(cfg.device)
    if target is None:
        from ..loading import parse_dtype
        from ..target import load_target
        target, tokenizer = load_target(cfg.model, parse_dtype(cfg.target_dtype), session.device)
    pdm = load_pdm(folder, target).float()
    config = pdm.config
    cfg = replace(cfg, stages=len(config.stage_layers), split=tuple(config.stage_layers),
                  anchors=tuple(config.anchors), pdm_layers=config.num_layers, draft_vocab=None, resume=False)
    run = _Run.open(cfg, session, target, tokenizer, pdm=pdm)
    result = run.evaluate() if run.eval_batches else {}
    session.close()
    return result


class _Run:
    """One training run's state (model, data, optimizer, step) and its computations."""

    @classmethod
    def open(cls, cfg: TrainConfig, session: Session, target=None, tokenizer=None, pdm=None) -> "_Run":
        """Load the target, build or resume the PDM and its optimizer, and prepare the data; or take
        `pdm` (fp32) as it is, to score a trained one: then no optimizer, and the PDM is left untouched."""
        out = Path(cfg.out)
        if target is None:
            from ..loading import parse_dtype
            from ..target import load_target
            target, tokenizer = load_target(cfg.model, parse_dtype(cfg.target_dtype), session.device)
        build, state = pdm is None, None
        if build:
            state = run_state(out, cfg) or None
            out.mkdir(parents=True, exist_ok=True)
            pdm = build_pdm(target, cfg)
        if state is not None:
            pdm.load_state_dict(load_pdm(out, target, list(pdm.config.stage_layers)).float().state_dict())
        layout, optimizer = pdm_layout(pdm, cfg.layout), None
        if build:
            for k, projection in enumerate(pdm.projections):  # a type no depth reaches is never trained
                projection.requires_grad_(k in layout.block_types)
            trained = [p for p in pdm.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trained, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                          fused=True)  # one kernel per step: the update is not free at 10M+ params
            if state is not None:
                optimizer.load_state_dict(state["optimizer"])
        tokens, loader = prepare_data(cfg, target, tokenizer, pdm.anchors, session.rank)
        run = cls(cfg, session, target, pdm, layout, optimizer, tokens, loader, state or {})
        if build and state is None and cfg.proj_init == "scaled":  # fresh weights: fit them to the data's scales
            batch = loader(run.plan(0)[0])
            rms = float(batch.last.float().pow(2).mean().sqrt()) if cfg.init_from != "none" else 1.0
            scale_projections(pdm, batch.features[batch.score], rms, cfg.seed)
        log.info("training %s: n=%d split=%s anchors=%s N_s=%d layout %s types %s; %d train / %d eval "
                 "sequences, %d micro-batches per epoch, %d steps", cfg.model, pdm.config.n_stages,
                 list(pdm.config.stage_layers), pdm.anchors, cfg.pdm_layers, layout.block_depths,
                 layout.block_types, len(run.train_idx), len(run.eval_idx), run.per_epoch, run.total)
        return run

    def __init__(self, cfg, session, target, pdm, layout, optimizer, tokens, loader, state: dict):
        """`state`: the saved training state of a resumed run, {} for a fresh one; `optimizer`: None
        for a run that only scores."""
        self.cfg, self.session, self.target, self.pdm, self.layout = cfg, session, target, pdm, layout
        self.optimizer, self.tokens, self.loader, self.step = optimizer, tokens, loader, state.get("step", 0)
        self.resumed = {k: state[k] for k in ("tokens", "seconds") if k in state}  # the run's earlier parts
        self.out = Path(cfg.out)
        self.forward = session.wrap(DraftForward(pdm, layout, target))
        self.head, self.index = teacher_head(target, pdm), vocab_index(pdm, target.vocab_size)
        self.autocast = dict(device_type=session.device.type, dtype=torch.bfloat16,
                             enabled=cfg.precision == "bf16")
        self.mask_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        self.train_idx, self.eval_idx = split_eval(tokens.lengths, cfg.eval_fraction, cfg.seed, cfg.eval_head,
                                                   cfg.train_tokens)
        self.eval_batches = _eval_batches(self.eval_idx, tokens, cfg)
        self._plans: dict[int, list[list[int]]] = {}
        self._plan_lengths: dict[int, int] = {}
        self.per_epoch = self.plan_length(0)
        self.micro_per_step = cfg.grad_accum * session.world
        self.total = cfg.max_steps or max(1, math.ceil((cfg.epochs or 1.0) * self.per_epoch / self.micro_per_step))

    def plan(self, epoch: int) -> list[list[int]]:
        """The epoch's batches (sequence indices), fixed by (seed, epoch)."""
        if epoch not in self._plans:
            self._plans = {epoch: plan_batches(self.train_idx, self.tokens.lengths, self.cfg.batch_tokens,
                                               seed=self.cfg.seed * 100003 + epoch)}
        return self._plans[epoch]

    def plan_length(self, epoch: int) -> int:
        if epoch not in self._plan_lengths:
            self._plan_lengths[epoch] = len(self.plan(epoch))
        return self._plan_lengths[epoch]

    def train_step(self) -> tuple[float, DistillStats, int]:
        """One optimizer step on this process's micro-batches -> (lr, stats, tokens)."""
        lr = lr_at(self.step, self.cfg, self.total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        world, rank = self.session.world, self.session.rank
        micro = [self.step * self.micro_per_step + k * world + rank for k in range(self.cfg.grad_accum)]
        batches = [self.plan(epoch)[k] for epoch, k in (locate_batch(g, self.plan_length) for g in micro)]
        stats, n_tokens = self._accumulate(batches, micro)
        self.step += 1
        return lr, stats, n_tokens

    def checkpoint(self, summary: TrainSummary) -> None:
        """PDM checkpoint (weights + config with provenance) and optimizer state, rank 0 only."""
        if self.session.rank != 0:
            return
        cfg = self.cfg
        extra = {"training": {"step": self.step, "total_steps": self.total, "tokens": summary.tokens,
                              "data": list(cfg.data), "layout": list(self.layout.block_depths),
                              "train_loss": summary.train_loss, "train_agreement": summary.train_agreement,
                              "eval": summary.eval, "model": cfg.model}}
        self.pdm.config = replace(self.pdm.config, extra=extra)
        tmp = self.out / ".checkpoint.tmp"
        save_pdm(self.pdm, tmp)
        for name in (CONFIG, WEIGHTS):
            os.replace(tmp / name, self.out / name)
        tmp.rmdir()
        save_state(self.out, {"step": self.step, "optimizer": self.optimizer.state_dict(), "config": asdict(cfg),
                              "tokens": summary.tokens, "seconds": summary.seconds})

    def loss(self, batch, fills):
        S = batch.features.shape[1]
        mask = structural_mask(self.layout, S, fills, self.mask_dtype, batch.features.device)
        with torch.autocast(**self.autocast):
            student = self.forward(batch.features, mask, batch.score)
        teacher = teacher_logits(self.target, self.head, batch.last)
        return distill(student, teacher, batch.argmax, self.index, self.pdm.draft_ids, self.cfg.temperature)

    def _accumulate(self, batch_indices, micro_ids) -> tuple[DistillStats, int]:
        self.pdm.train()
        stats, n_tokens = DistillStats(), 0
        for k, (indices, g) in enumerate(zip(batch_indices, micro_ids)):
            batch = self.loader(indices)
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + g)
            fills = sample_fills(batch.features.shape[1], self.layout.n_stages, self.cfg.partial_fill, gen)
            with self.session.no_sync(self.forward, last=k == len(batch_indices) - 1):
                loss, part = self.loss(batch, fills)
                loss.backward()
            stats.add(part)
            n_tokens += batch.tokens
        counted = self.session.all_sum(stats.in_vocab)
        scale = self.session.world / max(1, counted)  # DDP averaged the ranks' summed gradients
        for p in self.pdm.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.pdm.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats, n_tokens

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and agreement on held-out batches, with full pipelines and with partial fills."""
        self.pdm.eval()
        n = self.layout.n_stages
        full, partial = DistillStats(), DistillStats()
        gen = torch.Generator().manual_seed(self.cfg.seed + 7)
        for indices in self.eval_batches:
            batch = self.loader(indices)
            full.add(self.loss(batch, None)[1])
            if n > 1:
                S = batch.features.shape[1]
                partial.add(self.loss(batch, sample_fills(S, n, 1.0, gen))[1])
        a = full.agreement
        out = {"loss": full.loss, "agreement_full": a, "tokens": full.scored,
               "in_vocab": full.in_vocab / full.scored if full.scored else 0.0,
               "est_accept_length": n / (1 + (1 - a) * (n - 1))}
        if n > 1:
            out["agreement_partial"] = partial.agreement
        return out


def _eval_batches(eval_idx, tokens, cfg) -> list[list[int]]:
    batches, count = [], 0
    for batch in plan_batches(eval_idx, tokens.lengths, cfg.batch_tokens, seed=None):
        if count >= cfg.eval_tokens:
            break
        batches.append(batch)
        count += int(sum(tokens.lengths[i] for i in batch))
    return batches


def _format_eval(ev: dict) -> str:
    parts = [f"eval loss {ev['loss']:.3f}", f"agreement full {ev['agreement_full']:.3f}"]
    if "agreement_partial" in ev:
        parts.append(f"partial {ev['agreement_partial']:.3f}")
    parts.append(f"est. accept length {ev['est_accept_length']:.2f}")
    return "  ".join(parts)


def _say(bar, text: str) -> None:
    """A line of news: above the progress bar when there is one, else to the log."""
    bar.write(text) if not bar.disable else log.info(text)


def _bar(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm  # progress bars for long work (core dependency)
    return tqdm(total=total, initial=initial, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)
