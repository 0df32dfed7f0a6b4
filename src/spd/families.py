"""Which transformers decoder families spd runs, and the few things in which they differ.

spd runs a model through its own public modules (embedding, decoder layers, rotary embedding,
final norm, lm_head), so it must apply by hand what the family's `*Model.forward` and
`*ForCausalLM.forward` do around the layers. `FAMILIES` lists exactly those differences per
`model_type`; everything else lives inside the decoder layers and needs nothing from spd.
`check_against_hf` proves it at load time: spd's forward of a few tokens (prefill, then one
token at a time through the cache) must give the logits of transformers' own forward, else the
model is refused with the part that differs named.

`Rotary` wraps the model's rotary embedding so every caller gets (cos, sin) for a layer kind,
and so that "dynamic" RoPE depends only on the positions of the call: transformers' module is
stateful (it grows its base with the longest sequence seen), which breaks in SPD, where the
newest token runs first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# layer kinds (config.layer_types) whose token mixer keeps a recurrent state instead of keys and
# values; they take no attention mask. "hybrid" (Falcon-H1) runs attention and Mamba2 side by side.
RECURRENT_KINDS = {"linear_attention", "conv", "hybrid"}
ATTENTION_KINDS = {"full_attention", "sliding_attention"}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class Family:
    """What spd applies around the decoder layers (each a config attribute name, or None)."""

    note: str = ""
    embed_multiplier: str | None = None   # inputs_embeds * config.<attr> (granite, falcon_h1)
    logit_multiplier: str | None = None   # logits * config.<attr> (cohere, falcon_h1)
    logit_divisor: str | None = None      # logits / config.<attr> (granite)
    softcap: str | None = None            # c * tanh(logits / c) (gemma2, gemma3)
    norm: str = "norm"                    # final-norm attribute of model.model
    rope_per_kind: bool = False           # rotary_emb(x, position_ids, layer_type) (gemma3)
    dense_body: dict | None = None        # config overrides making a draft body layer dense (MoE)


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 2/3, SmolLM2, TinyLlama"),
    "mistral": Family("Mistral (sliding window)"),
    "qwen2": Family("Qwen2 / Qwen2.5"),
    "qwen3": Family("Qwen3"),
    "phi3": Family("Phi-3 / Phi-4-mini"),
    "olmo2": Family("OLMo 2"),
    "smollm3": Family("SmolLM3 (NoPE layers)"),
    "glm4": Family("GLM-4 (partial rotary)"),
    "exaone4": Family("EXAONE 4 (sliding + full layers)"),
    "gemma": Family("Gemma (scaled embedding module)"),
    "gemma2": Family("Gemma 2 (final logit soft-capping)", softcap="final_logit_softcapping"),
    "gemma3_text": Family("Gemma 3 text (rotary per layer kind)", softcap="final_logit_softcapping",
                          rope_per_kind=True),
    "granite": Family("Granite 3 (embedding multiplier, logits scaling)",
                      embed_multiplier="embedding_multiplier", logit_divisor="logits_scaling"),
    "cohere": Family("Command-R (logit scale)", logit_multiplier="logit_scale"),
    "gpt_oss": Family("gpt-oss (MoE, attention sinks)"),
    "qwen2_moe": Family("Qwen1.5/2 MoE", dense_body={"mlp_only_layers": "all"}),
    "qwen3_moe": Family("Qwen3 MoE", dense_body={"mlp_only_layers": "all"}),
    "mixtral": Family("Mixtral (MoE)"),
    "deepseek_v3": Family("DeepSeek-V3 (MLA, MoE)", dense_body={"first_k_dense_replace": "n"}),
    "qwen3_5_text": Family("Qwen3.5 text (Gated DeltaNet + full attention)"),
    "qwen3_next": Family("Qwen3-Next (Gated DeltaNet, MoE)", dense_body={"mlp_only_layers": "all"}),
    "lfm2": Family("LFM2 (short convolutions + attention)", norm="embedding_norm"),
    "falcon_h1": Family("Falcon-H1 (attention + Mamba2 in every layer)", norm="final_layernorm",
                        embed_multiplier="embedding_multiplier", logit_multiplier="lm_head_multiplier"),
}


def family_of(config) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by spd; supported families: "
            f"{', '.join(sorted(FAMILIES))}. (spd needs a decoder-only causal LM whose layers it "
            f"can run one at a time through transformers' public modules.)")
    return FAMILIES[model_type]


def layer_kinds(config) -> list[str]:
    """Kind of every decoder layer: full_attention, sliding_attention, linear_attention, conv, hybrid."""
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        kind = "hybrid" if config.model_type == "falcon_h1" else "full_attention"
        kinds = [kind] * config.num_hidden_layers
    return list(kinds)


def check_supported(config) -> None:
    """Refuse, in one line, a model spd cannot decode exactly (by family, layer kind, RoPE)."""
    family_of(config)
    unknown = sorted(set(layer_kinds(config)) - ATTENTION_KINDS - RECURRENT_KINDS)
    if unknown:
        raise UnsupportedModelError(f"{config.model_type}: layer kinds {unknown} are not supported by spd "
                                    f"(supported: {sorted(ATTENTION_KINDS | RECURRENT_KINDS)})")
    for kind, params in rope_parameters(config).items():
        if params.get("rope_type") not in (None, "default", "linear", "dynamic", "yarn", "longrope", "llama3"):
            raise UnsupportedModelError(f"{config.model_type}: rope_type {params.get('rope_type')!r}"
                                        f"{'' if kind is None else f' ({kind} layers)'} is not supported by spd")


def rope_parameters(config) -> dict:
    """{layer kind or None: rope parameters} (gemma3 keeps one set per layer kind)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return dict(params)
    return {None: params}


class Rotary(nn.Module):
    """(cos, sin) for positions, for a layer kind; position-pure for every rope_type.

    transformers' "dynamic" rotary embedding keeps the longest sequence it has seen and uses it
    for every later call, so its output depends on call order. Here a dynamic embedding is a
    fresh copy of the model's module per call: its frequencies depend only on the call's
    largest position, which is what plain decoding (positions in increasing order) gets.
    """

    def __init__(self, inner: nn.Module, config, per_kind: bool):
        super().__init__()
        self.inner, self.config, self.per_kind = inner, config, per_kind
        self.dynamic = any(p.get("rope_type") == "dynamic" for p in rope_parameters(config).values())

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        module = self.inner
        if self.dynamic:  # a fresh module: state from this call's positions only
            module = type(self.inner)(self.config).to(x.device)
        if self.per_kind:
            return module(x, position_ids, layer_type if layer_type in ATTENTION_KINDS else "full_attention")
        return module(x, position_ids=position_ids)


def _worst(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, max |b|) in float32."""
    return (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()


@torch.inference_mode()
def check_against_hf(target, model, n_tokens: int = 8, n_prefill: int = 5) -> None:
    """Refuse `target` unless spd's forward of a few tokens gives transformers' logits.

    The first `n_prefill` tokens run as a prefill, the rest one at a time through spd's cache,
    as in decoding. On a mismatch the error names the first part that differs: the embedding,
    a decoder layer (by index and kind), or the logits (a scale or soft-cap spd does not apply).
    """
    vocab = target.vocab_size
    ids = (torch.arange(n_tokens) * 7919 + 3) % vocab
    ids = ids.to(target.device)
    reference = model(ids[None], output_hidden_states=True, use_cache=False)
    tol = 1e-3 if target.dtype == torch.float32 else 5e-2
    cache = target.new_cache()
    states, last = [], None
    for start, stop in ((0, n_prefill), *((p, p + 1) for p in range(n_prefill, n_tokens))):
        positions = torch.arange(start, stop, device=target.device)
        hidden = target.embed(ids[start:stop])
        row = [hidden]
        for i in range(target.num_layers):
            hidden, _ = target.run_layers(hidden, positions, range(i, i + 1), cache)
            row.append(hidden)
        states.append(row)
    kinds = layer_kinds(target.config)
    for index in range(target.num_layers):  # index L of hidden_states is after the final norm
        ours = torch.cat([row[index] for row in states], dim=1)
        diff, scale = _worst(ours, reference.hidden_states[index])
        if diff > tol * max(1.0, scale):
            what = "the embedding output" if index == 0 else f"the output of layer {index - 1} ({kinds[index - 1]})"
            raise UnsupportedModelError(
                f"{target.config.model_type}: spd's forward differs from transformers' at {what} "
                f"(max abs diff {diff:.3g}); spd cannot decode this model exactly")
    ours = target.logits(torch.cat([row[-1] for row in states], dim=1))
    diff, scale = _worst(ours, reference.logits)
    if diff > tol * max(1.0, scale):
        raise UnsupportedModelError(
            f"{target.config.model_type}: spd's logits differ from transformers' (max abs diff {diff:.3g}, "
            f"the layers agree): a logit scale or soft-cap spd does not apply; spd cannot decode it exactly")
    del cache, last
