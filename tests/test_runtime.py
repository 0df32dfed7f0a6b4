"""Distributed runtime, pure parts (no processes): layout, plan checks, partial loading, the command
protocol, the shared schedule pieces, the timing breakdown and the failure diagnosis."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from conftest import tiny_model
from spd.cache import KVCache
from spd.checkpoint import save_pdm
from spd.drafters import Candidate
from spd.lookahead import LookaheadPolicy
from spd.pdm import PDM
from spd.runtime import Layout, LayoutError, plan, start
from spd.runtime.controller import breakdown
from spd.runtime.faults import StatusBoard, diagnose
from spd.runtime.layout import backend_for, pick_device
from spd.runtime.protocol import Command, Op, report_indices
from spd.runtime.stage import prefill_chunks
from spd.runtime.weights import load_partial_target, parameter_count
from spd.sampling import SamplingParams
from spd.stats import CycleTimes
from spd.target import Target
from spd.tree import TreeConfig, TreePipeline


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A 6-layer model with weights, and the same config without any weights."""
    root = tmp_path_factory.mktemp("models")
    model = tiny_model("llama", num_layers=6, seed=3)
    model.save_pretrained(root / "full")
    (root / "config_only").mkdir()
    (root / "config_only" / "config.json").write_text((root / "full" / "config.json").read_text())
    return model, root / "full", root / "config_only"


def test_layout_ranks_and_world_size():
    sep = Layout.of(30, 3, draft_rank="separate")
    assert [len(s) for s in sep.stages] == [10, 10, 10] and sep.world_size == 4
    assert [sep.stage_rank(k) for k in range(3)] == [1, 2, 3] and sep.stage_of(0) is None
    assert sep.role(0) == "control" and sep.role(2) == "stage 1"
    col = Layout.of(30, 3, draft_rank="with-first-stage")
    assert col.world_size == 3 and col.stage_rank(0) == 0 and col.role(0) == "control + stage 0"
    with pytest.raises(LayoutError, match="world size 2 does not fit n=3 stages.*4 processes"):
        sep.check_world_size(2)
    with pytest.raises(LayoutError, match="one of separate, with-first-stage"):
        Layout.of(30, 3, draft_rank="own")
    with pytest.raises(LayoutError, match="n=31 stages but the model has only 30 layers"):
        Layout.of(30, 31)
    assert backend_for(torch.device("cpu")) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"
    assert pick_device(1, 0, ["cpu", "cpu"], 2) == torch.device("cpu")
    with pytest.raises(LayoutError, match="lists 1 devices"):
        pick_device(0, 0, ["cpu"], 2)


def test_plan_checks_arguments_from_json_alone(folders, tmp_path):
    """Bad n / split / PDM fail in plan(), which reads config.json only (no weights exist here)."""
    model, _, config_only = folders
    spec = plan(str(config_only), stages=3, draft_rank="with-first-stage")
    assert spec.stage_layers == (2, 2, 2) and spec.layout.world_size == 3
    with pytest.raises(LayoutError, match="n=7 stages but the model has only 6 layers"):
        plan(str(config_only), stages=7)
    with pytest.raises(LayoutError, match=r"sum to 5, but the model has 6 layers"):
        plan(str(config_only), split=[2, 3])
    with pytest.raises(LayoutError, match="--split has 2 counts"):
        plan(str(config_only), stages=3, split=[3, 3])
    pdm = PDM.create(Target.from_hf(model), [3, 3])
    save_pdm(pdm, tmp_path / "pdm")
    assert plan(str(config_only), pdm=str(tmp_path / "pdm")).stage_layers == (3, 3)  # n from the PDM
    with pytest.raises(LayoutError, match="trained for n=2 stages split \\[3, 3\\].*--stages 2"):
        plan(str(config_only), stages=3, pdm=str(tmp_path / "pdm"))


def test_torchrun_world_size_mismatch_fails_before_loading(folders, monkeypatch):
    _, _, config_only = folders
    spec = plan(str(config_only), stages=3, draft_rank="separate")
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LayoutError, match="world size 3 does not fit n=3 stages with --draft-rank separate"):
        start(spec)
    assert not dist.is_initialized()


@pytest.mark.parametrize("tied", [False, True])
def test_partial_target_holds_and_loads_only_its_parts(tmp_path, tied):
    model = tiny_model("qwen3", num_layers=4, seed=2, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    full = Target.from_hf(model)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    stage = load_partial_target(str(tmp_path), [2, 3], embed=False, head=False)
    assert stage.embed_tokens is None and stage.norm is None and stage.lm_head is None
    assert sorted(stage.layers) == [2, 3]
    assert parameter_count(stage) == count(full.layers[2]) + count(full.layers[3])
    control = load_partial_target(str(tmp_path), [], embed=True, head=True)
    assert control.layers == {} and control.layer_class is type(full.layers[0])
    head = count(full.embed_tokens) + count(full.norm) + (0 if tied else count(full.lm_head))
    assert parameter_count(control) == head
    x = torch.randn(1, 3, full.hidden_size)
    ours, _ = stage.run_layers(x, torch.arange(3), range(2, 4), KVCache([2, 3]))
    theirs, _ = full.run_layers(x, torch.arange(3), range(2, 4), KVCache([2, 3]))
    assert torch.equal(ours, theirs) and torch.equal(control.logits(ours), full.logits(theirs))
    assert torch.equal(control.embed(torch.tensor([5])), full.embed(torch.tensor([5])))


def test_command_roundtrip_and_who_runs_what():
    command = Command(Op.STEP, newest=12, first=10, crop=11)
    assert Command.decode(command.encode("cpu")) == command
    assert [command.position(k) for k in range(4)] == [12, 11, 10, None]
    assert Command(Op.PREFILL, newest=4).position(0) is None
    sampled = Command(Op.STEP, newest=3, first=2, crop=-1, sample=1)
    assert Command.decode(sampled.encode("cpu")) == sampled
    assert prefill_chunks(10, 4, recurrent=False) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert prefill_chunks(10, 4, recurrent=True) == [slice(0, 10)]
    assert Layout.of(30, 2, draft_rank="with-first-stage").head_on_last
    assert not Layout.of(30, 1, draft_rank="with-first-stage").head_on_last   # one process: head is local
    assert not Layout.of(30, 2, head="control").head_on_last
    with pytest.raises(LayoutError, match="--head must be one of last, control"):
        Layout.of(30, 2, head="middle")
    stage = range(10, 20)
    assert report_indices(stage, [0, 10, 15, 30], 30, last=False) == [15]
    assert report_indices(range(20, 30), [0, 10, 15], 30, last=True) == [30]
    assert report_indices(range(0, 10), [0, 10], 30, last=False) == [10]


def test_chain_schedule_pieces():
    """The controller's schedule is spd.tree's TreePipeline; width 1 is the chain of SPEC section 2."""
    pipe = TreePipeline([7, 8, 9], 2, TreeConfig(1), node_rows=0)
    positions = lambda: [([node.position for node in level], k) for level, k in pipe.work()]  # noqa: E731

    def step(draft: int) -> None:   # the cycle's stage step, then its draft joins at depth 0
        for level, k in pipe.work():
            pipe.ran(k, level)
        pipe.grow([[Candidate(draft)]], fill=len(pipe.work()))

    assert positions() == [([2], 0)] and not pipe.exits
    step(4)
    assert positions() == [([3], 0), ([2], 1)] and not pipe.exits
    step(5)
    assert pipe.exits   # the root (position 2) passed both stages: it verifies position 3
    logits = torch.zeros(10)
    logits[4] = 1.0  # the target agrees with the draft at position 3
    kept, token, _ = pipe.settle(logits, SamplingParams(), torch.Generator())
    assert (kept.position, token) == (3, 4) and pipe.pruned == [None, None]
    assert pipe.path_tokens() == [7, 8, 9, 4, 5] and positions() == [([4], 0), ([3], 1)]
    step(6)
    kept, token, _ = pipe.settle(logits, SamplingParams(), torch.Generator())   # 5 was wrong
    assert (kept, token) == (None, 4)
    assert pipe.path_tokens() == [7, 8, 9, 4, 4] and positions() == [([4], 0)]


def test_breakdown_separates_exposed_communication():
    # stage 0 computes 4 ms, stage 1 6 ms; the last report came 8 ms in: 2 ms exposed
    cycles = [CycleTimes(total=0.010, pdm=0.003, own=0.003, reports=0.008, verify=0.001)] * 2
    b = breakdown(cycles, [[0.004, 0.004], [0.006, 0.006]])
    assert b["cycle_ms"] == pytest.approx(10) and b["slowest_stage_ms"] == pytest.approx(6)
    assert b["communication_ms"] == pytest.approx(2) and b["idle_ms"] == pytest.approx(5)
    assert b["pdm_ms"] == pytest.approx(3) and b["stage_ms"] == pytest.approx([4, 6])
    hidden = breakdown([CycleTimes(total=0.01, pdm=0.009, own=0.009, reports=0.009)], [[0.004], [0.006]])
    assert hidden["communication_ms"] == 0.0   # the PDM outlasted the stages


def test_lookahead_policy_pays_only_with_high_acceptance():
    assert LookaheadPolicy("on").ahead() and not LookaheadPolicy("off").ahead()
    auto = LookaheadPolicy("auto")
    assert not auto.ahead()   # nothing measured yet
    for _ in range(40):       # verification is a quarter of a step: ahead pays above a = 0.75
        auto.update(True, 0.010, 0.040)
    assert auto.ahead()
    for _ in range(10):
        auto.update(False, 0.010, 0.040)
    assert not auto.ahead()
    with pytest.raises(ValueError, match="off, on, auto"):
        LookaheadPolicy("sometimes")


def test_diagnosis_blames_the_right_stage(monkeypatch):
    layout = Layout.of(6, 3, draft_rank="separate")
    store = dist.HashStore()
    boards = {rank: StatusBoard(store, rank, interval=0.05) for rank in (1, 2, 3)}
    for board in boards.values():
        board.set("waiting for the next command from the control rank")
        board.publish()
    quick = dict(interval=0.05, timeout=5.0)
    # stage 1 (rank 2) vanished: its heartbeat froze; the others lost contact with it
    boards[2].set("computing position 9")
    boards[2].publish()
    for rank in (1, 3):
        boards[rank].fail("lost contact: the hidden state from stage 1", peer=True)
    failure = diagnose(store, layout, 3, "connection closed", **quick)
    assert failure.stage == 1 and "stage 1 (rank 2" in str(failure) and "no heartbeat" in str(failure)
    assert "computing position 9" in str(failure)
    # known exit codes win: a signal over a peer's exit
    failure = diagnose(store, layout, 3, "closed", exit_codes=lambda: {1: 1, 2: -9, 3: None}, **quick)
    assert failure.stage == 1 and "killed by SIGKILL" in str(failure)
    # an own error (not a peer error) is named with its message
    boards[2].fail("RuntimeError: out of memory", peer=False)
    for board in boards.values():
        board.start()
    failure = diagnose(store, layout, 1, "closed", **quick)
    assert failure.stage == 1 and "failed: RuntimeError: out of memory" in str(failure)
    for board in boards.values():
        board.stop()
    record = json.loads(store.get("spd/status/2"))
    assert record["pid"] == os.getpid() and record["error"].startswith("RuntimeError")
