"""Tiny random target models of several families, built from configs (offline, fp32, CPU)."""

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
