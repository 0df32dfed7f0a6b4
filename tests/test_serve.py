"""`spd serve` end to end: real server processes on loopback, called with the official openai client.

The model is a tiny random llama saved with save_pretrained, with an offline WordLevel tokenizer
("w0".."w58" plus chat words) and a simple chat template; the PDM is a saved random one. Every
greedy answer is checked token for token against spd.engine.generate in this process.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

from conftest import tiny_model
from spd import engine
from spd.checkpoint import save_pdm
from spd.cli import app
from spd.loading import build_decoder, encode_prompt
from spd.pdm import PDM
from spd.sampling import SamplingParams
from spd.target import Target

MODEL = "tiny"
CONTEXT = 4096
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def save_tokenizer(folder, vocab_size: int) -> None:
    words = SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                 additional_special_tokens=["<|im_start|>"],
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_model")
    model = tiny_model("llama", max_position_embeddings=CONTEXT)
    model.save_pretrained(folder / "model")
    save_tokenizer(folder / "model", model.config.vocab_size)
    save_pdm(PDM.create(Target.from_hf(model), [2, 2], seed=1), folder / "pdm")
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, queue_size: int, *extra: str):
    port = free_port()
    log = open(model_dir / f"server-{port}.log", "w")
    cmd = [sys.executable, "-m", "spd.cli", "serve", "--model", str(model_dir / "model"),
           "--pdm", str(model_dir / "pdm"), "--stages", "2", "--served-model-name", MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--queue-size", str(queue_size), "--threads", "1", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", log


def wait_ready(proc, url, log, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log.name).read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout}s:\n{open(log.name).read()}")


@pytest.fixture(scope="module")
def servers(model_dir):
    """Two servers started together: {"main": queue 64, "small": queue 1} -> base URL."""
    started = {"main": start_server(model_dir, 64), "small": start_server(model_dir, 1)}
    try:
        for proc, url, log in started.values():
            wait_ready(proc, url, log)
        yield {name: url for name, (_, url, _) in started.items()}
    finally:
        for proc, _, log in started.values():
            stop_server(proc, log)


def stop_server(proc, log, timeout: float = 20.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def url(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def decoder(model_dir):
    return build_decoder(str(model_dir / "model"), 2, None, str(model_dir / "pdm"))


def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def expected(decoder, prompt_ids, max_tokens, params=SamplingParams()):
    return engine.generate(decoder.target, decoder.drafter(), prompt_ids, decoder.stages, params,
                           max_tokens, eos_token_ids=())


def health(url) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def wait_for(condition, url, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = health(url)
        if condition(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"server state never got there: {health(url)}")


def chat(url, content, **kw):
    messages = [{"role": "user", "content": content}]
    return client(url).chat.completions.create(model=MODEL, messages=messages, **kw)


def test_models_and_health(url):
    listed = client(url).models.list().data
    assert [m.id for m in listed] == [MODEL]
    state = health(url)
    assert state["status"] == "ok" and state["n_stages"] == 2 and state["queue_size"] == 64


def test_greedy_chat_equals_engine_generate(url, decoder):
    r = chat(url, "w1 w2 w3", temperature=0, max_tokens=12, extra_body={"return_token_ids": True})
    want = expected(decoder, encode_prompt(decoder.tokenizer, "w1 w2 w3"), 12)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want.tokens
    assert choice.message.content == decoder.tokenizer.decode(want.tokens, skip_special_tokens=True)
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"])
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    spd = r.model_extra["spd"]
    assert spd["cycles"] == want.stats.cycles and spd["accepted"] == want.stats.accepted
    assert spd["n_stages"] == 2 and 0 < spd["acceptance_rate"] <= 1


def test_greedy_chat_equals_spd_generate_json(url, model_dir):
    r = chat(url, "w9 w8", temperature=0, max_tokens=10, extra_body={"return_token_ids": True})
    result = CliRunner().invoke(app, ["generate", "--model", str(model_dir / "model"), "--pdm",
                                      str(model_dir / "pdm"), "--stages", "2", "--prompt", "w9 w8",
                                      "--max-new-tokens", "10", "--json"])
    assert result.exit_code == 0, result.output
    cli = json.loads(result.stdout)
    assert r.choices[0].model_extra["token_ids"] == cli["token_ids"]
    assert r.choices[0].message.content == cli["text"]


def test_streaming_chat_sends_the_same_text_in_pieces(url):
    whole = chat(url, "w4 w5", temperature=0, max_tokens=15).choices[0].message.content
    chunks = list(chat(url, "w4 w5", temperature=0, max_tokens=15, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].model_extra["spd"]["new_tokens"] == 15
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15


def test_completions_text_and_token_prompts_stream_and_not(url, decoder):
    c = client(url)
    ids_back = {"return_token_ids": True}
    text = "w7 w8 w9"
    r = c.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=10, extra_body=ids_back)
    want = expected(decoder, decoder.tokenizer.encode(text), 10)
    assert r.object == "text_completion" and r.choices[0].model_extra["token_ids"] == want.tokens
    assert r.choices[0].text == decoder.tokenizer.decode(want.tokens)

    ids = [11, 12, 13, 14]
    r = c.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=10, extra_body=ids_back)
    assert r.choices[0].model_extra["token_ids"] == expected(decoder, ids, 10).tokens
    assert r.usage.prompt_tokens == 4
    streamed = list(c.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=10, stream=True))
    assert "".join(s.choices[0].text for s in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"

    r = c.completions.create(model=MODEL, prompt=ids, temperature=0)   # OpenAI's default: 16 tokens
    assert r.usage.completion_tokens == 16


def test_sampling_parameters_and_seed_reach_the_engine(url, decoder):
    kw = dict(temperature=0.9, top_p=0.8, seed=3, max_tokens=10, extra_body={"return_token_ids": True})
    first = chat(url, "w20", **kw).choices[0].model_extra["token_ids"]
    assert chat(url, "w20", **kw).choices[0].model_extra["token_ids"] == first
    params = SamplingParams(temperature=0.9, top_p=0.8, seed=3)
    assert first == expected(decoder, encode_prompt(decoder.tokenizer, "w20"), 10, params).tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_generation_and_are_trimmed(url, stream):
    text = chat(url, "w30 w31", temperature=0, max_tokens=20).choices[0].message.content
    words = text.split()
    stop = " ".join(words[5:7])          # two tokens long, so part of it is held back once
    want = text[:text.find(stop)]
    r = chat(url, "w30 w31", temperature=0, max_tokens=20, stop=["w99999", stop], stream=stream)
    if stream:
        chunks = list(r)
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish, used = chunks[-1].choices[0].finish_reason, chunks[-1].usage.completion_tokens
    else:
        got, finish = r.choices[0].message.content, r.choices[0].finish_reason
        used = r.usage.completion_tokens
    assert got == want and finish == "stop" and used < 20


def test_errors_have_clear_statuses_and_messages(url):
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="messages") as err:
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert err.value.param == "messages"
    with pytest.raises(openai.BadRequestError, match="temperature") as err:
        chat(url, "w1", temperature=7, max_tokens=2)
    assert err.value.param == "temperature"
    bad_json = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=5,
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    surrogate = httpx.post(url + "/v1/chat/completions", timeout=5, headers={"content-type": "application/json"},
                           content=b'{"messages": [{"role": "user", "content": "w1 \\ud800"}], "max_tokens": 2}')
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "messages[0]"
    with pytest.raises(openai.BadRequestError, match="context is 4096 tokens"):
        c.completions.create(model=MODEL, prompt=[5] * (CONTEXT + 10), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="ask for at most"):
        c.completions.create(model=MODEL, prompt=[5] * 100, max_tokens=CONTEXT)
    with pytest.raises(openai.BadRequestError, match=r"\[0, 64\)"):
        c.completions.create(model=MODEL, prompt=[5, 64], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        chat(url, "w1", max_tokens=2, n=2)
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        c.completions.create(model="gpt-4", prompt="w1", max_tokens=2)
    assert health(url)["running"] == 0


def test_client_disconnect_mid_stream_stops_generation(url):
    before = health(url)
    stream = chat(url, "w40", temperature=0, max_tokens=4000, stream=True)
    for i, _ in zip(range(3), stream):
        pass
    stream.close()
    after = wait_for(lambda s: s["running"] == 0, url)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 4000


def test_client_that_gives_up_on_a_whole_completion_stops_it(url):
    before = health(url)
    with pytest.raises(openai.APITimeoutError):
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=0.5).completions.create(
            model=MODEL, prompt=[3, 4], temperature=0, max_tokens=4000)
    after = wait_for(lambda s: s["running"] == 0, url)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 4000


def test_queue_full_answers_429_and_the_queue_still_serves(servers, decoder):
    url = servers["small"]
    long = chat(url, "w41", temperature=0, max_tokens=4000, stream=True)   # holds the worker
    next(iter(long))
    waiting = {}
    thread = threading.Thread(target=lambda: waiting.update(r=client(url).completions.create(
        model=MODEL, prompt=[3, 4, 5], temperature=0, max_tokens=5, extra_body={"return_token_ids": True})))
    thread.start()
    wait_for(lambda s: s["running"] == 1 and s["waiting"] == 1, url)
    with pytest.raises(openai.RateLimitError, match="queue-size 1"):
        chat(url, "w42", max_tokens=2)
    long.close()                                                           # frees the worker
    thread.join(30)
    assert waiting["r"].choices[0].model_extra["token_ids"] == expected(decoder, [3, 4, 5], 5).tokens
    assert health(url)["rejected"] == 1


def test_fifty_concurrent_requests_all_answered_correctly(url, decoder):
    prompts = [[3 + i % 50, 3 + (7 * i) % 50, 3 + (i // 7)] for i in range(50)]
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def ask(i, ids):
        kw = dict(model=MODEL, prompt=ids, temperature=0, max_tokens=6, extra_body={"return_token_ids": True})
        if i % 2:
            return [t for chunk in [c async for c in await c.completions.create(stream=True, **kw)]
                    for t in chunk.choices[0].model_extra.get("token_ids", []) if chunk.choices]
        return (await c.completions.create(**kw)).choices[0].model_extra["token_ids"]

    async def ask_all():
        async with c:
            return await asyncio.gather(*(ask(i, ids) for i, ids in enumerate(prompts)))

    before = health(url)["finished"]
    answers = asyncio.run(ask_all())
    assert answers == [expected(decoder, ids, 6).tokens for ids in prompts]
    assert health(url)["finished"] - before == 50
