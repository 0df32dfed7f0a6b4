"""Training the baseline heads (EAGLE-style, PPSD) on the same data and target as the PDM.

`train_head(TrainConfig, method)` takes the PDM's own `spd.train.TrainConfig` (data, cache,
draft vocabulary, steps, lr, ...) and reuses spd.train's pieces: the token store and feature
cache (`prepare_data`), the eval split and length bucketing, the lr schedule, the teacher's
logits on the draft vocabulary and the KL(teacher || draft) objective with top-1 agreement.
Only the loss differs per method:

- PPSD: each position's stage-1 output h_s (pre-norm) -> head -> the target's next-token
  distribution at that position (causal attention over earlier h_s rows, as at inference).
- EAGLE-style: row t = [embed(x_{t+1}) ; g_t] -> the target's distribution at position t+1;
  plus `ttt_steps - 1` unrolled steps (EAGLE-3's training-time test) in which the head's own
  output replaces the target feature, with the attention pattern chain drafting has at
  inference: a step-j row of source t sees the true rows <= t and its own chain rows only.

The target's lm_head rows stay frozen by default (`train_lm_head`), as in EAGLE-1/2 and in a
self-speculative early exit; the output folder is a head checkpoint (`spd bench --eagle/--ppsd`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..target import attention_mask, split_layers
from ..train.data import plan_batches, split_eval
from ..train.loop import TrainConfig, TrainSummary, lr_at, prepare_data
from ..train.objective import DistillStats, distill, teacher_head, teacher_logits, vocab_index
from ..train.session import STATE, StopSignal, run_state, save_state
from .eagle import EagleHead
from .heads import save_head
from .ppsd import PPSDHead

log = logging.getLogger(__name__)

METHODS = ("eagle", "ppsd")
STEP_WEIGHT = 0.8     # weight of unrolled step j is STEP_WEIGHT ** (j - 1)


def build_head(target, cfg: TrainConfig, method: str, feature_layers=None):
    """A fresh head for the config (fp32 master weights)."""
    from ..vocab import load_vocab

    draft_ids = load_vocab(cfg.draft_vocab, target.vocab_size) if cfg.draft_vocab else None
    if method == "eagle":
        head = EagleHead.create(target, feature_layers, draft_ids, cfg.seed)
    elif method == "ppsd":
        stage_layers = [len(s) for s in split_layers(target.num_layers, cfg.stages, list(cfg.split) if cfg.split else None)]
        head = PPSDHead.create(target, stage_layers, cfg.pdm_layers, draft_ids,
                               init_from_target=cfg.init_from != "none", seed=cfg.seed)
    else:
        raise ValueError(f"unknown head method {method!r}; use one of {', '.join(METHODS)} (or train a PDM)")
    return head.float()


def saved_method(out) -> str | None:
    """The head a run folder trains ("eagle" / "ppsd"), None for a PDM run or no run."""
    path = Path(out) / STATE
    return torch.load(path, map_location="cpu", weights_only=True).get("method") if path.is_file() else None


def head_anchors(head) -> list[int]:
    return head.feature_layers if isinstance(head, EagleHead) else [head.exit_index]


def ttt_mask(steps: int, rows: int, dtype, device) -> torch.Tensor:
    """Additive (1, 1, steps*R, steps*R) mask over rows [step 1 | step 2 | ...] of R sources each.

    Step-1 rows are causal. A step-j row (j >= 2) of source t sees step-1 rows <= t and the
    rows of steps 2..j of the same source t: exactly what chain drafting's row sees.
    """
    t = torch.arange(rows, device=device)
    causal = t[None, :] <= t[:, None]
    same = t[None, :] == t[:, None]
    allowed = torch.zeros(steps, rows, steps, rows, dtype=torch.bool, device=device)
    for a in range(steps):
        allowed[a, :, 0] = causal
        for b in range(1, a + 1):
            allowed[a, :, b] = same
    allowed = allowed.reshape(steps * rows, steps * rows)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _student(head, hidden: torch.Tensor) -> torch.Tensor:
    """(N, H) pre-norm (EAGLE) or normed (PPSD) outputs -> (N, V_d) draft-vocabulary logits."""
    if isinstance(head, EagleHead):
        hidden = head._target["norm"](hidden)
    return head.lm_head.proj(hidden).float()


def ppsd_loss(head, target, batch, ids, teacher, index, temperature):
    B, S = ids.shape
    positions = torch.arange(S, device=ids.device)
    hidden = head(batch.features[:, :, 0], positions, attention_mask(positions, S, batch.features.dtype))
    loss, stats = distill(_student(head, hidden[batch.score]), teacher_logits(target, teacher, batch.last),
                          batch.argmax, index, head.lm_head.draft_ids, temperature)
    return loss, [stats]


def unroll(head, ids: torch.Tensor, g: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Outputs of `steps` chain steps for every source t = 0..R-1 (R = S-1), teacher-forced.

    Step j of source t reads the id x_{t+j} and g_t (j = 1) or its step j-1 output, at position
    t+j-1, so its output predicts the token at t+j+1. (B, S) ids, (B, R, H) g -> [(B, R, H)] * steps.
    """
    B, S = ids.shape
    R, device, dtype = S - 1, ids.device, g.dtype
    inputs_ids, inputs_feat, positions, outs = [], [], [], []
    for j in range(1, steps + 1):
        shift = (torch.arange(R, device=device) + j).clamp(max=S - 1)   # past the end: unscored
        inputs_ids.append(ids.gather(1, shift[None].expand(B, R)))
        inputs_feat.append(g if j == 1 else outs[-1])
        positions.append(torch.arange(R, device=device) + j - 1)
        mask = ttt_mask(j, R, dtype, device) if j > 1 else attention_mask(positions[0], R, dtype)
        hidden = head(torch.cat(inputs_ids, 1), torch.cat(inputs_feat, 1), torch.cat(positions), mask)
        outs.append(hidden[:, (j - 1) * R:])
    return outs


def eagle_loss(head, target, batch, ids, teacher, index, temperature, steps: int):
    """Summed loss over unrolled steps and per-step stats; step j of source t is scored against
    the target's distribution at position t+j."""
    B, S = ids.shape
    R, device = S - 1, ids.device
    scored = batch.score.nonzero()                # batch.last / argmax rows, in (b, s) order
    teacher_rows = torch.full((B, S), -1, dtype=torch.long, device=device)
    teacher_rows[scored[:, 0], scored[:, 1]] = torch.arange(len(scored), device=device)
    t_logits = teacher_logits(target, teacher, batch.last)
    outs = unroll(head, ids, head.fused(batch.features)[:, :R], min(steps, max(1, R)))
    loss, stats = 0.0, []
    for j, out in enumerate(outs, 1):
        position = torch.arange(R, device=device) + j
        rows = torch.where((position < S)[None], teacher_rows[:, position.clamp(max=S - 1)], -1)
        pick = rows >= 0
        step_loss, step_stats = distill(_student(head, out[pick]), t_logits[rows[pick]],
                                        batch.argmax[rows[pick]], index, head.lm_head.draft_ids, temperature)
        loss = loss + STEP_WEIGHT ** (j - 1) * step_loss
        stats.append(step_stats)
    return loss, stats


HEAD_DEFAULTS = {"ttt_steps": 2, "feature_layers": None, "train_lm_head": False}


def resume_state(cfg: TrainConfig, method: str, given: dict) -> tuple[dict, dict]:
    """(saved state or {}, head settings): a resumed run keeps its saved settings; one given that
    differs is refused, naming it (the run would not continue exactly)."""
    out = Path(cfg.out)
    state = run_state(out, cfg, method)
    saved = state.get("head_settings", {})
    settings = {}
    for name, default in HEAD_DEFAULTS.items():
        value = given.get(name)
        if state and value is not None and value != saved.get(name):
            raise ValueError(f"--resume: {out} was trained with {name}={saved.get(name)!r}, now {name}={value!r}; "
                             f"resume with the same setting or train into another --out")
        settings[name] = saved.get(name, default) if state else (default if value is None else value)
    if settings["ttt_steps"] < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {settings['ttt_steps']}")
    return state, settings


def train_head(cfg: TrainConfig, method: str, target=None, tokenizer=None, ttt_steps: int | None = None,
               feature_layers=None, train_lm_head: bool | None = None) -> TrainSummary:
    """Train an EAGLE-style or PPSD head as configured; writes a head checkpoint to cfg.out.

    The training state (head, optimizer, step, place in the epoch, head settings) is saved every
    `cfg.save_every` steps, on Ctrl-C / SIGTERM and at `cfg.stop_after`; `cfg.resume` continues
    it exactly (the same batches in the same order). None: the default, or the resumed run's."""
    out = Path(cfg.out)
    state, settings = resume_state(cfg, method, dict(ttt_steps=ttt_steps, train_lm_head=train_lm_head,
                                                     feature_layers=list(feature_layers) if feature_layers else None))
    if target is None:
        from ..loading import parse_dtype
        from ..target import load_target
        target, tokenizer = load_target(cfg.model, parse_dtype(cfg.target_dtype), cfg.device)
    head = build_head(target, cfg, method, settings["feature_layers"])
    head.lm_head.requires_grad_(settings["train_lm_head"])
    if state:
        head.load_state_dict(state["head"])
    tokens, loader = prepare_data(cfg, target, tokenizer, head_anchors(head))
    train_idx, eval_idx = split_eval(tokens.lengths, cfg.eval_fraction, cfg.seed, cfg.eval_head, cfg.train_tokens)
    batches = EpochBatches(train_idx, tokens.lengths, cfg.batch_tokens, cfg.seed)
    total = cfg.max_steps or max(1, math.ceil((cfg.epochs or 1.0) * len(batches.plan(0)) / cfg.grad_accum))
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if state:
        optimizer.load_state_dict(state["optimizer"])
    loss_of = head_loss(method, head, target, tokens, loader, temperature=cfg.temperature,
                        ttt_steps=settings["ttt_steps"])

    out.mkdir(parents=True, exist_ok=True)
    step = state.get("step", 0)
    if state:
        batches.resume(state.get("epoch", -1), state["batches_left"])
    summary = TrainSummary(str(out), step, total, tokens=state.get("tokens", 0), seconds=state.get("seconds", 0.0))
    end = min(total, step + cfg.stop_after) if cfg.stop_after else total
    log.info("training a %s head for %s: %d train / %d eval sequences, steps %d..%d of %d", method, cfg.model,
             len(train_idx), len(eval_idx), step, end, total)

    from tqdm.auto import tqdm  # progress bar over steps (core dependency)
    bar = tqdm(total=total, initial=step, desc=f"train {method}", unit="step", disable=not cfg.progress, dynamic_ncols=True)
    t0, seconds_before, window = time.perf_counter(), summary.seconds, DistillStats()
    with StopSignal() as stop:
        while step < end and not stop.reason:
            optimizer_step(head, optimizer, params, loss_of, batches, lr=lr_at(step, cfg, total), cfg=cfg,
                           window=window, summary=summary)
            step += 1
            summary.seconds = seconds_before + time.perf_counter() - t0
            bar.update(1)
            bar.set_postfix(loss=f"{window.loss:.3f}", agree=f"{window.agreement:.3f}")
            if step % cfg.log_every == 0 or step == total:
                summary.train_loss, summary.train_agreement = window.loss, window.agreement
                _log(out, {"step": step, "loss": window.loss, "agreement": window.agreement})
                window = DistillStats()
            if stop.reason or step == end or (cfg.save_every and step % cfg.save_every == 0):
                save_run(out, method=method, settings=settings, step=step, batches=batches, head=head,
                         optimizer=optimizer, cfg=cfg, summary=summary)
        summary.interrupted = stop.reason or None
    bar.close()
    summary.step = step
    summary.eval = evaluate(head, eval_idx, tokens, cfg, loss_of, method)
    write_head(out, head, target, cfg=cfg, method=method, settings=settings, summary=summary)
    return summary


@dataclass
class EpochBatches:
    """The place in the epoch: the micro-batches left in it, popped from the end; each epoch's
    order is planned from the seed and the epoch number, so a resumed run sees the same batches."""

    train_idx: np.ndarray       # the training split's sequence indices
    lengths: np.ndarray         # every sequence's length
    batch_tokens: int
    seed: int
    epoch: int = -1
    left: list = field(default_factory=list)

    def plan(self, epoch: int) -> list:
        return plan_batches(self.train_idx, self.lengths, self.batch_tokens, seed=self.seed * 100003 + epoch)

    def resume(self, epoch: int, batches_left: int) -> None:
        self.epoch, self.left = epoch, self.plan(epoch)[:batches_left]

    def pop(self):
        if not self.left:
            self.epoch += 1  # epochs differ a little in length: count them, don't divide
            self.left = self.plan(self.epoch)
        return self.left.pop()


def head_loss(method: str, head, target, tokens, loader, *, temperature: float, ttt_steps: int):
    """`loss_of(indices) -> (loss, [DistillStats per step], tokens)` for a micro-batch of sequences,
    against the teacher's logits on the head's draft vocabulary."""
    adapter = SimpleNamespace(config=head.config, draft_ids=head.lm_head.draft_ids)
    teacher, index = teacher_head(target, adapter), vocab_index(adapter, target.vocab_size)

    def loss_of(indices):
        batch = loader(indices)
        ids, _ = tokens.padded(indices, device=target.device)
        if method == "eagle":
            return eagle_loss(head, target, batch, ids, teacher, index, temperature, ttt_steps) + (batch.tokens,)
        return ppsd_loss(head, target, batch, ids, teacher, index, temperature) + (batch.tokens,)

    return loss_of


def optimizer_step(head, optimizer, params, loss_of, batches: EpochBatches, *, lr: float, cfg: TrainConfig,
                   window: DistillStats, summary: TrainSummary) -> None:
    """One optimizer step over `cfg.grad_accum` micro-batches; adds their stats to `window` and
    their tokens to `summary.tokens`."""
    head.train()
    for group in optimizer.param_groups:
        group["lr"] = lr
    counted = 0
    for _ in range(cfg.grad_accum):
        loss, stats, n_tokens = loss_of(batches.pop())
        loss.backward()
        counted += stats[0].in_vocab
        window.add(stats[0])
        summary.tokens += n_tokens
    # the losses are sums over in-vocabulary positions: a mean over all the step's micro-batches
    for p in params:
        if p.grad is not None:
            p.grad.div_(max(1, counted))
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def save_run(out: Path, *, method: str, settings: dict, step: int, batches: EpochBatches, head, optimizer,
             cfg: TrainConfig, summary: TrainSummary) -> None:
    """Save the training state that `--resume` continues from."""
    save_state(out, {"method": method, "head_settings": settings, "step": step, "epoch": batches.epoch,
                     "batches_left": len(batches.left), "head": head.state_dict(),
                     "optimizer": optimizer.state_dict(), "config": asdict(cfg),
                     "tokens": summary.tokens, "seconds": summary.seconds})


def write_head(out: Path, head, target, *, cfg: TrainConfig, method: str, settings: dict,
               summary: TrainSummary) -> None:
    """The head checkpoint (in the target's dtype, with how it was trained) and train_summary.json."""
    head.config = replace(head.config, extra={"training": {
        "method": method, "step": summary.step, "data": list(cfg.data), "ttt_steps": settings["ttt_steps"],
        "train_lm_head": settings["train_lm_head"], "eval": summary.eval, "model": cfg.model}})
    save_head(head.to(target.dtype), out)
    (out / "train_summary.json").write_text(json.dumps(summary.to_dict(), indent=1) + "\n")


@torch.no_grad()
def evaluate(head, eval_idx, tokens, cfg: TrainConfig, loss_of, method: str) -> dict:
    """Held-out loss and top-1 agreement per unrolled step (step 1 = 'agreement_full')."""
    head.eval()
    per_step: list[DistillStats] = []
    seen = 0
    for indices in plan_batches(eval_idx, tokens.lengths, cfg.batch_tokens, seed=None):
        if seen >= cfg.eval_tokens:
            break
        _, stats, n_tokens = loss_of(indices)
        seen += n_tokens
        for j, s in enumerate(stats):
            if j == len(per_step):
                per_step.append(DistillStats())
            per_step[j].add(s)
    if not per_step:
        return {}
    a = [s.agreement for s in per_step]
    out = {"loss": per_step[0].loss, "agreement_full": a[0], "agreement_by_step": a, "tokens": per_step[0].scored}
    if method == "ppsd":
        n = cfg.stages
        out["est_accept_length"] = n / (1 + (1 - a[0]) * (n - 1))
    else:  # chain: 1 + a1 + a1*a2 + ... (later steps reuse the last measured agreement)
        chain, prob = 1.0, 1.0
        for j in range(5):
            prob *= a[min(j, len(a) - 1)]
            chain += prob
        out["est_accept_length"] = chain
    return out


def _log(out: Path, record: dict) -> None:
    with open(out / "train_log.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
