"""`spd data` (spd.distill) on tiny random models: the sampler draws from the softmax it is given,
batched rows that leave the batch decode exactly as alone, a stopped run resumes to the file an
uninterrupted one writes, prompt files of every format are read, and bad input gets one error line."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from typer.testing import CliRunner

from conftest import EVAL, stop_at_second_kept_round, tiny_model, tiny_tokenizer
from spd.cli import app
from spd.distill import run as distill_run
from spd.distill.prompts import PromptError, read_prompts
from spd.distill.run import DataConfig, distill
from spd.distill.sample import ATTENTION, SampleConfig, pick, sample_batch


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """The same without a chat template (a base model)."""
    folder = tmp_path_factory.mktemp("base_model")
    tok = tiny_tokenizer(chat_template=None)
    tiny_model("llama", num_layers=2, vocab=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _cfg(model, out, eval_dir, **kw) -> DataConfig:
    base = dict(model=str(model), out=str(out), num_conversations=6, max_new_tokens=12, batch_size=4,
                question_tokens=12, dtype="float32", eval_dir=str(eval_dir), seed=3)
    return DataConfig(**{**base, **kw})


# ----- the sampler ------------------------------------------------------------------------------

def _counts(logits, cfg, draws=40_000, seed=0):
    picked = pick(logits.expand(draws, -1), cfg, torch.Generator().manual_seed(seed))
    return Counter(picked.tolist())


def test_pick_draws_from_the_tempered_softmax_and_the_nucleus():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    for cfg in (SampleConfig(temperature=0.7), SampleConfig(temperature=1.3, top_p=0.8)):
        probs = torch.softmax(logits[0].double() / cfg.temperature, -1)
        if cfg.top_p < 1:   # the nucleus: the fewest top tokens whose mass reaches top_p
            ranked = probs.sort(descending=True)
            keep = (ranked.values.cumsum(0) - ranked.values) < cfg.top_p
            probs = torch.zeros_like(probs).scatter(0, ranked.indices[keep], ranked.values[keep])
            probs /= probs.sum()
        counts = _counts(logits, cfg)
        assert all(probs[t] > 0 for t in counts)   # nothing outside the nucleus
        support = [t for t in range(6) if probs[t] > 0]
        observed = [counts.get(t, 0) for t in support]
        expected = [float(probs[t]) * sum(observed) for t in support]
        assert chisquare(observed, expected).pvalue > 1e-3
        # control: the same counts against the untempered softmax must fail
        wrong = torch.softmax(logits[0].double(), -1)[support]
        assert chisquare(observed, (wrong / wrong.sum() * sum(observed)).tolist()).pvalue < 1e-6
    assert pick(logits.expand(3, -1), SampleConfig(temperature=0), None).tolist() == [0, 0, 0]


def test_batched_rows_that_end_decode_exactly_as_alone():
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=2, vocab=64).eval()
    prompts = [[5, 9, 11, 3], [7], [2, 8, 8, 1, 30, 4, 6], [40, 41]]
    greedy = SampleConfig(max_new_tokens=10, temperature=0)
    free = [r.tokens for r in sample_batch(model, prompts, greedy, stop_ids=[], pad_id=0)]
    with torch.no_grad():   # the reference: transformers' own greedy decode, one prompt at a time
        for p, toks in zip(prompts, free):
            ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            assert ref[0, len(p):].tolist() == toks
    stop = free[0][3]   # row 0 ends at its 4th token: it leaves the batch while the others go on
    alone = [sample_batch(model, [p], greedy, [stop], 0)[0] for p in prompts]
    batched = sample_batch(model, prompts, greedy, [stop], 0)
    assert batched[0].finished and batched[0].tokens == free[0][:free[0].index(stop)]
    assert [(b.tokens, b.finished) for b in batched] == [(a.tokens, a.finished) for a in alone]
    # the grouped decode attention computes what SDPA does (padding rows included)
    model.set_attn_implementation(ATTENTION)
    assert [r.tokens for r in sample_batch(model, prompts, greedy, [], 0)] == free
    assert [(r.tokens, r.finished) for r in sample_batch(model, prompts, greedy, [stop], 0)] == \
        [(a.tokens, a.finished) for a in alone]


# ----- runs -------------------------------------------------------------------------------------

def test_a_stopped_run_resumes_to_the_same_file(chat_model, eval_dir, tmp_path, monkeypatch):
    whole = tmp_path / "whole.jsonl"
    done = distill(_cfg(chat_model, whole, eval_dir), show_progress=False)
    lines = whole.read_text().splitlines()
    assert len(lines) == done.lines == 6 and done.answer_tokens > 0
    for line in lines:
        user, assistant = json.loads(line)["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant" and user["content"]

    # Stop at the second round that keeps lines, after they are written but before its progress
    # is: the resume must cut them back and redo that round from its own seed.
    stopped, real_write = tmp_path / "stopped.jsonl", distill_run._write_meta
    write_then_stop, kept = stop_at_second_kept_round(real_write)

    monkeypatch.setattr(distill_run, "_write_meta", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        distill(_cfg(chat_model, stopped, eval_dir), show_progress=False)
    monkeypatch.setattr(distill_run, "_write_meta", real_write)
    recorded = json.loads((tmp_path / "stopped.jsonl.meta.json").read_text())["progress"]["lines"]
    assert recorded == kept[0] < len(stopped.read_text().splitlines())   # a torn round on disk

    with pytest.raises(ValueError, match="--resume"):
        distill(_cfg(chat_model, stopped, eval_dir), show_progress=False)
    distill(_cfg(chat_model, stopped, eval_dir, resume=True), show_progress=False)
    assert stopped.read_text() == whole.read_text()
    with pytest.raises(ValueError, match="other data parameters"):
        distill(_cfg(chat_model, stopped, eval_dir, resume=True, temperature=0.9), show_progress=False)

    meta_path = tmp_path / "stopped.jsonl.meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "device": "cuda"}))
    with pytest.raises(ValueError, match="pass --device cuda"):
        distill(_cfg(chat_model, stopped, eval_dir, resume=True), show_progress=False)
    meta_path.write_text(json.dumps({**meta, "head": "<|im_start|>system\ntoday<|im_end|>\n"}))
    with pytest.raises(ValueError, match="starts a question differently"):
        distill(_cfg(chat_model, stopped, eval_dir, resume=True), show_progress=False)

    # rounds sampled side by side in two worker processes, written in order: the same file
    parallel = tmp_path / "parallel.jsonl"
    distill(_cfg(chat_model, parallel, eval_dir, workers=2), show_progress=False)
    assert parallel.read_text() == whole.read_text()


def test_prompt_file_answers_each_kept_prompt_once(chat_model, eval_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"turns": ["hello world how are you"]}, {"turns": [EVAL["gsm8k"][0]]},   # an eval prompt
            {"messages": [{"role": "system", "content": "fine"}, {"role": "user", "content": "the cat sat"},
                          {"role": "assistant", "content": "on the mat"}]},
            {"conversations": [{"from": "human", "value": "a dog ran far"}, {"from": "gpt", "value": "and"}]},
            {"prompt": "hello world how are you"}]   # a duplicate
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "answers.jsonl"
    done = distill(_cfg(chat_model, out, eval_dir, prompts=str(prompts), num_conversations=None, batch_size=2),
                   show_progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    asked = [r["messages"][-2]["content"] for r in records]
    assert sorted(asked) == sorted(["hello world how are you", "the cat sat", "a dog ran far"])
    assert records[asked.index("the cat sat")]["messages"][0] == {"role": "system", "content": "fine"}
    assert done.rounds == 2 and done.lines == 3


def test_raw_mode_scores_only_the_continuation(base_model, eval_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\n\nhello world\n")
    out = tmp_path / "raw.jsonl"
    distill(_cfg(base_model, out, eval_dir, prompts=str(prompts), num_conversations=None, raw=True),
            show_progress=False)
    for line in out.read_text().splitlines():
        rec = json.loads(line)
        n_prompt = len(rec["prompt"].split())
        assert rec["loss_mask"][:n_prompt] == [0] * n_prompt and all(rec["loss_mask"][n_prompt:])
        assert len(rec["input_ids"]) == len(rec["loss_mask"]) > n_prompt and rec["text"].startswith(rec["prompt"])


def test_read_prompts_formats_and_errors(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("one\n\n  two  \n")
    assert read_prompts(text) == [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]
    cases = {"missing.jsonl": (None, FileNotFoundError, "no such file"),
             "empty.jsonl": ("\n\n", PromptError, "holds no prompt"),
             "bad.jsonl": ("{not json\n", PromptError, "p.jsonl:1|bad.jsonl:1: not valid JSON"),
             "odd.jsonl": ('{"question": "x"}\n', PromptError, "unknown record format"),
             "noturn.jsonl": ('{"messages": [{"role": "assistant", "content": "x"}]}\n', PromptError, "no user turn"),
             "p.csv": ("a,b\n", PromptError, "unknown format")}
    for name, (content, error, message) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        with pytest.raises(error, match=message):
            read_prompts(path)


def test_cli_refuses_bad_input_with_one_error_line(chat_model, base_model, eval_dir, tmp_path):
    runner = CliRunner()
    (tmp_path / "odd.jsonl").write_text('{"question": "x"}\n')
    (tmp_path / "empty.txt").write_text("\n")
    cases = [([], "--prompts .*missing.jsonl: no such file", ["--prompts", str(tmp_path / "missing.jsonl")]),
             ([], "holds no prompt", ["--prompts", str(tmp_path / "empty.txt")]),
             ([], "unknown record format", ["--prompts", str(tmp_path / "odd.jsonl")]),
             ([], "--num-conversations", []),
             (["--model", str(base_model)], "no chat template: pass --raw", ["--num-conversations", "2"])]
    for model_args, message, extra in cases:
        args = ["data", "--model", str(chat_model), *model_args, "--out", str(tmp_path / "o.jsonl"),
                "--eval-dir", str(eval_dir), "--dtype", "float32", *extra]
        result = runner.invoke(app, args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
        assert __import__("re").search(message, lines[0]), lines[0]


def test_raw_openers_drawn_twice_in_a_round_are_answered_once(base_model, eval_dir):
    """Without --prompts in raw mode the openers are the prompts; a round draws the same free
    opener several times (1 in 10 draws is one of ~20), and each is answered once."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spd.distill.prompts import normalize, opener
    from spd.distill.run import Distiller, Progress

    cfg = _cfg(base_model, "unused.jsonl", eval_dir, raw=True, batch_size=128)
    tok, model = AutoTokenizer.from_pretrained(base_model), AutoModelForCausalLM.from_pretrained(base_model)
    rng = random.Random(f"{cfg.seed}-0")   # round 0's openers, as Distiller.questions draws them
    drawn = [opener(rng) for _ in range(cfg.batch_size)]
    assert len(set(drawn)) < len(drawn)   # else this test checks nothing
    progress = Progress()
    prompts = Distiller(cfg, model, tok, None).questions(0, torch.Generator(), set(), progress)
    texts = [normalize(p[-1]["content"]) for p in prompts]
    assert sorted(set(texts)) == sorted(texts) == sorted({normalize(d) for d in drawn})
    assert progress.rejected["duplicate"] == len(drawn) - len(texts)


def test_bench_data_runs_on_a_tokenizer_without_a_pad_token(chat_model):
    """`spd bench data` times both samplers on the same prompts; generate's left padding works
    for a tokenizer that names no pad token (Llama's have none)."""
    result = CliRunner().invoke(app, ["bench", "data", "--model", str(chat_model), "--batch-size", "2",
                                      "--max-new-tokens", "4", "--repeats", "1", "--dtype", "float32", "--threads", "1",
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["best"]["generate"] > 0 and report["best"]["spd_data"] > 0
