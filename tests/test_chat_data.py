"""scripts/make_chat_data.py with a tiny random chat model: a crashed run resumed writes the
same file as an uninterrupted one, the resume guards refuse what would break that, and the
chat frame (question head, end-of-turn token) is read from any template that has one."""

import json

import pytest

from conftest import load_script, stop_at_second_kept_round, tiny_tokenizer

LLAMA3_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}")


def _args(model, eval_dir, out, n, *extra):
    # top-p 1: with uniform probabilities a nucleus cut would drop an arbitrary tied token
    return ["--model", str(model), "--eval-dir", str(eval_dir), "--output", str(out),
            "--num-conversations", str(n), "--batch-size", "4", "--q-max-new-tokens", "12",
            "--a-max-new-tokens", "12", "--q-top-p", "1.0", "--min-words", "2",
            "--dtype", "float32", "--threads", "1", "--seed", "3", *extra]


def test_chat_frame_reads_the_template():
    script = load_script("make_chat_data")
    tok = tiny_tokenizer()
    assert script.chat_frame(tok) == ("<|im_start|>user\n", tok.convert_tokens_to_ids("<|im_end|>"))
    llama3 = tiny_tokenizer(LLAMA3_TEMPLATE, specials=("<|start_header_id|>", "<|end_header_id|>",
                                                       "<|eot_id|>"))
    assert script.chat_frame(llama3) == ("<|start_header_id|>user<|end_header_id|>\n\n",
                                         llama3.convert_tokens_to_ids("<|eot_id|>"))
    with pytest.raises(SystemExit, match="no chat template"):
        script.chat_frame(tiny_tokenizer(chat_template=None))
    plain_end = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(SystemExit, match="does not end a user turn with a special token"):
        script.chat_frame(tiny_tokenizer(plain_end))


def test_crashed_run_resumes_to_the_same_file(chat_model, eval_dir, tmp_path, monkeypatch):
    script = load_script("make_chat_data")
    whole = tmp_path / "whole.jsonl"
    assert script.main(_args(chat_model, eval_dir, whole, 6)) == 0
    lines = whole.read_text().splitlines()
    meta = json.loads(whole.with_suffix(".meta.json").read_text())
    assert len(lines) == 6 and meta["device"] == "cpu" and meta["head"] == "<|im_start|>user\n"
    for line in lines:
        user, assistant = json.loads(line)["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant" and user["content"]

    # Crash at the second round that keeps lines, after they are written but before its
    # progress is: the resume must cut them back and redo that round from its own seed.
    crashed = tmp_path / "crashed.jsonl"
    real_write = script._write_meta
    write_then_crash, kept_rounds = stop_at_second_kept_round(real_write)

    monkeypatch.setattr(script, "_write_meta", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        script.main(_args(chat_model, eval_dir, crashed, 6))
    monkeypatch.setattr(script, "_write_meta", real_write)
    recorded = json.loads(crashed.with_suffix(".meta.json").read_text())["progress"]["lines"]
    assert recorded == kept_rounds[0] < len(crashed.read_text().splitlines())  # a torn round

    with pytest.raises(SystemExit, match="--resume"):
        script.main(_args(chat_model, eval_dir, crashed, 6))
    assert script.main(_args(chat_model, eval_dir, crashed, 6, "--resume")) == 0
    assert crashed.read_text() == whole.read_text()


def test_resume_refuses_other_parameters_device_or_template(chat_model, eval_dir, tmp_path):
    script = load_script("make_chat_data")
    out = tmp_path / "chat.jsonl"
    meta_path = out.with_suffix(".meta.json")
    assert script.main(_args(chat_model, eval_dir, out, 1)) == 0
    with pytest.raises(SystemExit, match="different data parameters"):
        script.main(_args(chat_model, eval_dir, out, 2, "--resume", "--a-temperature", "0.9"))

    def edit_meta(**changes):
        meta = json.loads(meta_path.read_text())
        meta.update(changes)
        meta_path.write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))

    edit_meta(device="cuda")
    with pytest.raises(SystemExit, match="pass --device cuda"):
        script.main(_args(chat_model, eval_dir, out, 2, "--resume"))
    edit_meta(device="cpu", head="<|im_start|>system\nYesterday's date<|im_end|>\n<|im_start|>user\n")
    with pytest.raises(SystemExit, match="chat template now starts a question differently"):
        script.main(_args(chat_model, eval_dir, out, 2, "--resume"))
    edit_meta(device=None, head=None)  # a file made before either was recorded: cpu, any head
    assert script.main(_args(chat_model, eval_dir, out, 2, "--resume")) == 0
    assert len(out.read_text().splitlines()) == 2


def test_a_run_that_keeps_nothing_stops_with_an_error(chat_model, eval_dir, tmp_path):
    # one-token questions never reach 10 words (as when a model never ends its turn with the
    # expected token, every question is rejected): no endless loop, an error that says why
    args = _args(chat_model, eval_dir, tmp_path / "chat.jsonl", 2, "--q-max-new-tokens", "1",
                 "--min-words", "10")
    with pytest.raises(SystemExit, match="no conversation kept in 20 rounds"):
        load_script("make_chat_data").main(args)
