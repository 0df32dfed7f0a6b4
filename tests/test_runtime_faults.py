"""Distributed runtime through its entry points: faults, bad arguments, torchrun across "nodes".

- a stage process killed (SIGKILL, through the CLI) or frozen (SIGSTOP, in process) mid-generation:
  the control rank names the stage and the cause within the timeout, the CLI exits non-zero, and
  no process is left behind;
- bad arguments fail before any weights load (the model folder here has no weights at all);
- two torchrun "nodes" on loopback run one job and produce the AR tokens.
"""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_model
from spd.baselines.ar import ar_generate
from spd.cli import app
from spd.drafters import OracleDrafter
from spd.runtime import StageFailure, plan, start
from spd.target import Target

PROMPT = [3, 17, 5, 9, 22]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = tiny_model("llama", num_layers=6, seed=3, max_position_embeddings=32768)   # room for 20,000 new tokens
    model.save_pretrained(root / "model")
    (root / "config_only").mkdir()
    (root / "config_only" / "config.json").write_text((root / "model" / "config.json").read_text())
    return model, root


def spd_generate(folder, *extra) -> list[str]:
    return [sys.executable, "-m", "spd.cli", "generate", "--model", str(folder), "--prompt-ids",
            ",".join(map(str, PROMPT)), "--distributed", "--threads", "1", *extra]


class Run:
    """A `spd generate --distributed` subprocess whose stderr is read line by line."""

    def __init__(self, command):
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines, self.stderr = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                match = re.search(pattern, self.lines.get(timeout=0.2))
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.stderr)
                continue
            if match:
                return match
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{''.join(self.stderr)}")

    def kill(self):
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            child.kill()
        self.proc.kill()


def stage_pids(run: Run) -> dict[int, int]:
    line = run.wait_for(r"started (.*)", 120).group(1)
    return {int(k): int(pid) for k, pid in re.findall(r"stage (\d+) as rank \d+ \(pid (\d+)\)", line)}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_killed_stage_is_named_within_the_timeout_and_nothing_is_left(folders):
    """Through the CLI: SIGKILL one stage mid-generation; exit 1, the stage named, no process left."""
    _, root = folders
    timeout = 4.0
    run = Run(spd_generate(root / "model", "--stages", "3", "--draft-rank", "separate", "--timeout", str(timeout),
                           "--max-new-tokens", "20000", "--ignore-eos", "-v"))
    try:
        pids = stage_pids(run)
        run.wait_for(r"decoding a 5-token prompt", 120)
        time.sleep(0.5)   # mid-generation
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        run.proc.wait(timeout=timeout + 20)
        elapsed = time.monotonic() - t0
    finally:
        if run.proc.poll() is None:
            run.kill()
    err = "".join(run.stderr)
    assert run.proc.returncode == 1, err
    assert elapsed < timeout + 10, (elapsed, err)
    message = [line for line in err.splitlines() if line.startswith("error:")][-1]
    assert "stage 1 (rank 2" in message and "killed by SIGKILL" in message, message
    time.sleep(0.2)
    assert all(gone(pid) for pid in pids.values()), err


def test_frozen_stage_is_named_within_the_timeout(folders):
    """In process: SIGSTOP one stage mid-generation; StageFailure within the timeout, all reaped."""
    model, root = folders
    timeout = 3.0
    spec = plan(str(root / "model"), stages=2, draft_rank="with-first-stage", timeout=timeout, threads=1)
    session = start(spec)
    pids = {rank: proc.pid for rank, proc in session.workers.items()}
    tokens = session.stream(PROMPT, OracleDrafter([0] * 20000), max_new_tokens=20000, eos_token_ids=())
    with pytest.raises(StageFailure) as failure:
        for count, _ in enumerate(tokens):
            if count == 20:
                os.kill(pids[1], signal.SIGSTOP)
                t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    assert failure.value.stage == 1 and "stage 1 (rank 1" in str(failure.value)
    assert "stopped responding (no heartbeat)" in str(failure.value)
    assert timeout - 0.5 < elapsed < timeout + 8, elapsed
    assert session.closed and all(proc.exitcode is not None for proc in session.workers.values())
    assert all(gone(pid) for pid in pids.values()) and not torch.distributed.is_initialized()


def test_bad_arguments_fail_before_any_weights_load(folders, monkeypatch):
    _, root = folders
    runner = CliRunner()
    base = ["generate", "--model", str(root / "config_only"), "--prompt-ids", "1,2", "--distributed"]
    result = runner.invoke(app, [*base, "--stages", "7"])
    assert result.exit_code == 2 and "n=7 stages but the model has only 6 layers" in result.output
    result = runner.invoke(app, [*base, "--split", "4,4"])
    assert result.exit_code == 2 and "sum to 8, but the model has 6 layers" in result.output
    result = runner.invoke(app, [*base, "--stages", "2", "--draft-rank", "elsewhere"])
    assert result.exit_code == 2 and "--draft-rank must be one of separate, with-first-stage" in result.output
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    result = runner.invoke(app, [*base, "--stages", "2"])   # separate needs 3 processes
    assert result.exit_code == 2 and "world size 2 does not fit n=2 stages" in result.output
    assert "Launch 3 processes" in result.output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_nodes_on_loopback(folders):
    """rank 0 (control + stage 0) on "node" 0, rank 1 (stage 1) on "node" 1: one job, AR tokens."""
    model, root = folders
    port = free_port()
    nodes = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "spd.cli", "generate", "--model", str(root / "model"), "--prompt-ids",
                   ",".join(map(str, PROMPT)), "--distributed", "--draft-rank", "with-first-stage",
                   "--stages", "2", "--threads", "1", "--max-new-tokens", "12", "--ignore-eos", "--json"]
        nodes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    result = json.loads(outputs[0][0].strip().splitlines()[-1])
    reference, _ = ar_generate(Target.from_hf(model), PROMPT, max_new_tokens=12, eos_token_ids=())
    assert result["token_ids"] == reference
    assert result["stage_layers"] == [3, 3] and result["stats"]["cycles"] > 0
    assert outputs[1][0].strip() == ""   # only rank 0 prints


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """Wide MLPs: each stage's prefill of a 3,000-token prompt computes for seconds on one thread."""
    folder = tmp_path_factory.mktemp("slow") / "model"
    model = tiny_model("llama", num_layers=4, hidden=64, intermediate_size=16384, max_position_embeddings=4096, seed=5)
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("draft_rank", ["separate", "with-first-stage"])
def test_a_prefill_longer_than_the_timeout_passes(slow_model, draft_rank):
    """--timeout bounds waiting on a peer, not a peer's known compute: a stage computing the prefill
    with a live heartbeat is waited for, whoever waits (the control rank, the next stage)."""
    model, folder = slow_model
    timeout = 0.6
    prompt = [(7 * i) % 64 for i in range(3000)]
    # one prefill chunk (no pipelining): correctness must not depend on pipelined prefill
    spec = plan(str(folder), stages=2, draft_rank=draft_rank, timeout=timeout, threads=1, prefill_chunk=4096)
    with start(spec) as session:
        result = session.generate(prompt, OracleDrafter([0] * 8), max_new_tokens=6, eos_token_ids=())
    stage_ms = result.stats.breakdown["prefill_stage_ms"]
    assert min(stage_ms) > 1000 * timeout, stage_ms      # each stage computed longer than the timeout
    reference, _ = ar_generate(Target.from_hf(model), prompt, max_new_tokens=6, eos_token_ids=())
    assert result.tokens == reference
