"""Fuzzing the server's request handling in process (FastAPI's TestClient, a tiny model): whatever
the body, the answer is never a 5xx, and every error is OpenAI's error JSON with the status as code.

Bodies are drawn around the real fields (right names, wrong or extreme values, lone surrogates,
unknown fields, non-objects, bytes that are not JSON); valid ones really decode, on a 48-token
context so that each stays short.
"""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from spd.checkpoint import save_pdm
from spd.loading import build_decoder
from spd.pdm import PDM
from spd.serve.app import create_app
from spd.serve.backend import LocalBackend
from spd.target import Target
from test_serve import save_tokenizer

CONTEXT = 48


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    model = tiny_model("llama", num_layers=2, max_position_embeddings=CONTEXT)
    model.save_pretrained(folder / "model")
    save_tokenizer(folder / "model", model.config.vocab_size)
    save_pdm(PDM.create(Target.from_hf(model), [1, 1], seed=1), folder / "pdm")
    decoder = build_decoder(str(folder / "model"), 2, None, str(folder / "pdm"))
    with TestClient(create_app(LocalBackend(decoder, "tiny", CONTEXT), queue_size=4)) as c:
        yield c


text = st.text(alphabet=st.characters(codec=None), max_size=12) | st.sampled_from(["w1 w2", "\ud800", "w3 \udcff", ""])
scalar = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, 2, 5, 47, 48, 10**6])
          | st.floats(allow_nan=True, allow_infinity=True) | text)
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                     max_leaves=6)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | value},
                                optional={"content": text | value,
                                          "extra": value}) | value
FIELDS = {
    "model": st.sampled_from(["tiny", "gpt-4"]) | value,
    "max_tokens": st.integers(-2, 60) | value,
    "max_completion_tokens": st.integers(-2, 60) | value,
    "temperature": st.sampled_from([0, 0.7, 1e-300, 2, 2.5, -1]) | value,
    "top_p": st.sampled_from([0, 1e-9, 0.5, 1, 1.5]) | value,
    "top_k": st.sampled_from([-1, 0, 1, 2**40, 2**70]) | value,
    "seed": st.integers(-2**65, 2**65) | value,
    "stop": text | st.lists(text, max_size=3) | value,
    "n": st.integers(-1, 3) | value,
    "stream": st.booleans() | value,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | value,
    "ignore_eos": st.booleans() | value,
    "return_token_ids": st.booleans() | value,
    "unknown_field": value,
}
prompt = (text | st.lists(st.integers(-3, 70) | st.integers(-2**70, 2**70), max_size=60) | value)
chat_body = st.fixed_dictionaries({"messages": st.lists(message, max_size=3) | value},
                                  optional=FIELDS)
completion_body = st.fixed_dictionaries({"prompt": prompt}, optional=FIELDS)
body = (st.tuples(st.just("/v1/chat/completions"), chat_body | value)
        | st.tuples(st.just("/v1/completions"), completion_body | value))


def check_answer(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and isinstance(error["message"], str) and error["message"]
        assert error["type"] in ("invalid_request_error", "not_found_error", "rate_limit_error")
        if response.status_code == 400 and "JSON" not in error["message"]:
            assert error["param"] is None or isinstance(error["param"], str)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), response.text
    else:
        assert response.json()["choices"], response.text


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(request=body)
def test_no_body_makes_a_server_error(client, request):
    path, payload = request
    # json.dumps keeps lone surrogates as \ud800 escapes and NaN/Infinity as Python's json allows
    check_answer(client.post(path, content=json.dumps(payload), headers={"content-type": "application/json"}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=40), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data"]))
def test_bytes_that_are_not_json_are_a_400(client, raw, path, content_type):
    response = client.post(path, content=raw, headers={"content-type": content_type})
    check_answer(response)


def test_invalid_requests_are_400_naming_the_field(client):
    cases = [({"messages": [{"role": "user", "content": "w1"}], "temperature": 9}, "temperature"),
             ({"messages": [{"role": "robot", "content": "w1"}]}, "messages[0]"),
             ({"messages": [{"role": "user", "content": "w1 \ud800"}]}, "messages[0]"),
             ({"messages": [{"role": "user", "content": "w1"}], "seed": 2**70}, "seed"),
             ({"messages": [{"role": "user", "content": "w1"}], "top_p": 0}, "top_p"),
             ({"messages": [{"role": "user", "content": "w1"}], "n": 2}, "n"),
             ({"messages": [{"role": "user", "content": "w1"}], "max_tokens": 1000}, "max_tokens"),
             ({"prompt": " "}, "prompt"), ({"prompt": [3, 64]}, "prompt"), ({"prompt": "w1 \udcff"}, "prompt")]
    for payload, param in cases:
        path = "/v1/completions" if "prompt" in payload else "/v1/chat/completions"
        r = client.post(path, content=json.dumps(payload), headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (payload, r.text)
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}],
                                                    "temperature": 1e-300, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
