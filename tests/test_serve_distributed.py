"""`spd serve --distributed`: the same OpenAI API over spd.runtime (a process per stage), on loopback.

The server spawns its stage processes (gloo); answers are checked token for token against
spd.engine.generate in this process. The stages' idle timeout is short, so the keep-alive test
would fail (the stages exit, the next request errs) if the server did not ping idle stages.
"""

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import psutil
import pytest

from spd.loading import encode_prompt
from spd.sampling import SamplingParams
from test_serve import (  # noqa: F401
    MODEL,
    chat,
    client,
    decoder,
    expected,
    health,
    model_dir,
    start_server,
    stop_server,
    wait_for,
    wait_ready,
)

IDLE_TIMEOUT = 6.0   # seconds a stage waits for a command; the server pings every quarter of it


@pytest.fixture(scope="module")
def url(model_dir):
    proc, url, log = start_server(model_dir, 64, "--distributed", "--idle-timeout", str(IDLE_TIMEOUT),
                                  "--timeout", "20")
    try:
        wait_ready(proc, url, log, timeout=120)
        yield url
    finally:
        stop_server(proc, log)


def test_health_reports_the_distributed_pipeline(url):
    state = health(url)
    assert state["status"] == "ok" and state["n_stages"] == 2


def test_greedy_chat_equals_engine_generate(url, decoder):
    r = chat(url, "w1 w2 w3", temperature=0, max_tokens=12, extra_body={"return_token_ids": True})
    want = expected(decoder, encode_prompt(decoder.tokenizer, "w1 w2 w3"), 12)
    assert r.choices[0].model_extra["token_ids"] == want.tokens
    assert r.choices[0].message.content == decoder.tokenizer.decode(want.tokens, skip_special_tokens=True)
    spd = r.model_extra["spd"]
    assert spd["cycles"] == want.stats.cycles and spd["accepted"] == want.stats.accepted


def test_streaming_and_sampling_match_the_engine(url, decoder):
    whole = chat(url, "w4 w5", temperature=0, max_tokens=15).choices[0].message.content
    chunks = list(chat(url, "w4 w5", temperature=0, max_tokens=15, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole
    kw = dict(temperature=0.9, top_p=0.8, seed=3, max_tokens=10, extra_body={"return_token_ids": True})
    got = chat(url, "w20", **kw).choices[0].model_extra["token_ids"]
    params = SamplingParams(temperature=0.9, top_p=0.8, seed=3)
    assert got == expected(decoder, encode_prompt(decoder.tokenizer, "w20"), 10, params).tokens


def test_disconnect_mid_stream_stops_and_the_pipeline_serves_on(url, decoder):
    before = health(url)
    stream = chat(url, "w40", temperature=0, max_tokens=3000, stream=True)
    for _ in zip(range(3), stream):
        pass
    stream.close()
    after = wait_for(lambda s: s["running"] == 0, url)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 3000
    r = client(url).completions.create(model=MODEL, prompt=[3, 4, 5], temperature=0, max_tokens=8,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == expected(decoder, [3, 4, 5], 8).tokens


def test_idle_stages_are_kept_alive(url, decoder):
    time.sleep(2.5 * IDLE_TIMEOUT)   # no request for longer than a stage would wait unpinged
    assert health(url)["status"] == "ok"
    r = client(url).completions.create(model=MODEL, prompt=[7, 8], temperature=0, max_tokens=8,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == expected(decoder, [7, 8], 8).tokens


def test_fifty_concurrent_requests_all_answered_correctly(url, decoder):
    prompts = [[3 + i % 50, 3 + (7 * i) % 50, 3 + (i // 7)] for i in range(50)]
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def ask(ids):
        r = await c.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6,
                                       extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    async def ask_all():
        async with c:
            return await asyncio.gather(*(ask(ids) for ids in prompts))

    assert asyncio.run(ask_all()) == [expected(decoder, ids, 6).tokens for ids in prompts]


def started_pids(log) -> list[dict[int, int]]:
    """{stage: pid} of every start of the stage processes, in order, from the server log."""
    return [{int(k): int(pid) for k, pid in re.findall(r"stage (\d+) as rank \d+ \(pid (\d+)\)", line)}
            for line in re.findall(r"spd.runtime.launch: started (.*)", open(log.name).read())]


def watch_health(url, until, timeout=120.0) -> list[str]:
    """Poll /health until `until(state)`; every status seen on the way, in order, repeats dropped."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(url + "/health", timeout=5).json()
        if not seen or seen[-1] != state["status"]:
            seen.append(state["status"])
        if until(state):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"/health never got there; seen {seen}")


def test_a_dead_stage_is_restarted_and_the_next_request_served_until_the_restarts_run_out(model_dir, decoder):
    proc, url, log = start_server(model_dir, 4, "--distributed", "--timeout", "3", "--max-restarts", "1", "-v")
    pids = []
    try:
        wait_ready(proc, url, log, timeout=120)
        # 1. a stage dies mid-stream: that request fails naming it; the pipeline restarts; the next is served
        stream = chat(url, "w40", temperature=0, max_tokens=3000, stream=True)
        for _ in zip(range(3), stream):
            pass
        os.kill(started_pids(log)[0][1], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="stage 1"):
            for _ in stream:
                pass
        seen = watch_health(url, lambda s: s["status"] == "ok" and s["restarts"] == 1)
        assert seen[-2:] == ["recovering", "ok"], seen
        r = client(url).completions.create(model=MODEL, prompt=[3, 4, 5], temperature=0, max_tokens=8,
                                           extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == expected(decoder, [3, 4, 5], 8).tokens
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert "spd_pipeline_restarts_total 1" in metrics and 'spd_pipeline_state{state="ok"} 1' in metrics
        assert 'spd_requests_total{outcome="failed"} 1' in metrics
        # 2. a stage of the new pipeline dies while idle: --max-restarts 1 is spent, so it stays failed
        pids = started_pids(log)
        assert len(pids) == 2 and pids[1][1] != pids[0][1]
        os.kill(pids[1][1], signal.SIGKILL)
        watch_health(url, lambda s: s["status"] == "failed", timeout=30)
        state = httpx.get(url + "/health", timeout=5)
        assert state.status_code == 503 and "not restarted again" in state.json()["reason"]
        assert "stage 1" in state.json()["reason"]
        with pytest.raises(openai.InternalServerError, match="not restarted again") as err:
            client(url).completions.create(model=MODEL, prompt=[3, 4], temperature=0, max_tokens=8)
        assert err.value.status_code == 503
    finally:
        stop_server(proc, log)
    time.sleep(0.5)
    left = [p for run in pids for p in run.values()
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, left
