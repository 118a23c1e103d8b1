"""What the memory planner knows of a model: its config (a local folder's, a common model's shape
known by hub id with no network, or the hub's config.json) and the counts it plans from (`Shape`:
the parameters of a layer and of the root unit, the activations a token keeps)."""

import functools
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace

# activations an update keeps per token and decoder layer, as a multiple of
# 2 bytes * (8 hidden + 2 q + 2 kv + 4 intermediate): the norms' fp32 inputs, q/k/v and their
# rotary copies, the attention output, the MLP's gate, up and product. Measured on an H200
# (Qwen2.5-0.5B shape, 2026-11-30): 1.38 MiB a token with eager layers, 0.97 with --compile_update.
ACT_EAGER = 1.05
ACT_COMPILED = 0.74

# The shapes of common models (their config.json), by hub id, so that --print_plan plans them
# with no network: hidden, intermediate, layers, attention heads, key-value heads, head size,
# vocabulary, embeddings tied to the output layer. An -Instruct variant has its base's shape.
KNOWN = {
    "Qwen/Qwen2.5-0.5B": (896, 4864, 24, 14, 2, 64, 151936, True),
    "Qwen/Qwen2.5-1.5B": (1536, 8960, 28, 12, 2, 128, 151936, True),
    "Qwen/Qwen2.5-3B": (2048, 11008, 36, 16, 2, 128, 151936, True),
    "Qwen/Qwen2.5-7B": (3584, 18944, 28, 28, 4, 128, 152064, False),
    "Qwen/Qwen3-0.6B": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "Qwen/Qwen3-1.7B": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "Qwen/Qwen3-4B": (2560, 9728, 36, 32, 8, 128, 151936, True),
    "Qwen/Qwen3-8B": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "meta-llama/Llama-3.2-1B": (2048, 8192, 16, 32, 8, 64, 128256, True),
    "meta-llama/Llama-3.2-3B": (3072, 8192, 28, 24, 8, 128, 128256, True),
}


def known_config(name):
    """A config-like namespace for a hub id of `KNOWN` (or its -Instruct, -Base or 2507 variants,
    which share its shape), else None."""
    keys = "hidden_size intermediate_size num_hidden_layers num_attention_heads"
    keys += " num_key_value_heads head_dim vocab_size tie_word_embeddings"
    shapes = {hub_id.lower(): shape for hub_id, shape in KNOWN.items()}
    shape = shapes.get(re.sub(r"-(instruct|base|thinking)(-2507)?$", "", name.lower()))
    return SimpleNamespace(**dict(zip(keys.split(), shape))) if shape else None


@functools.cache
def config_of(path):
    """The config the planner reads for a model: a local folder's, a known hub id's shape (no
    network), or the hub's config.json. Names --model and the ways out when none can be read.
    Read once per process (the planner plans many times; a hub id means a network check); not to
    be changed by its callers."""
    from transformers import AutoConfig

    local = os.path.isdir(os.path.expanduser(path))
    known = None if local else known_config(path)
    if known is not None:
        return known
    if not local:  # reachable or cached, or said so in seconds
        import models

        try:
            models.check_source(path)
        except SystemExit as error:
            known = ", ".join(KNOWN)
            variants = "(and their -Instruct, -Base and 2507 variants)"
            why = f"{error.code}; with no network the planner knows {known} {variants}"
            raise SystemExit(why) from None
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as error:
        from flags import need

        need(
            False,
            f"--model {path}: its config.json cannot be read ({str(error).splitlines()[0]}); give "
            "a local folder, or with no network one of the shapes the planner knows: "
            + ", ".join(KNOWN),
        )


def scaled_logits(config):
    """Whether a model's logits are not its output layer's as they are (Gemma 2's soft-capping,
    Cohere's and Granite's scaling): --use_fused_kernels' chunked output layer cannot serve."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(
        getattr(config, "final_logit_softcapping", None)
        or getattr(config, "logit_scale", 1.0) not in (None, 1.0)
        or getattr(config, "logits_scaling", 1.0) not in (None, 1.0)
    )


@dataclass
class Shape:
    """What the planner needs of a Hugging Face config."""

    hidden: int
    intermediate: int
    layers: int
    q_dim: int  # heads * head_dim
    kv_dim: int  # key-value heads * head_dim
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config):
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            heads * head_dim,
            kv_heads * head_dim,
            config.vocab_size,
            bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def layer_params(self):
        h = self.hidden
        attention = h * self.q_dim * 2 + h * self.kv_dim * 2 + self.q_dim + 2 * self.kv_dim
        return attention + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self):
        """Embeddings, final norm and (untied) head: FSDP2's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self):
        return self.layers * self.layer_params + self.root_params

    def activations(self, compiled):
        """Bytes a token keeps per decoder layer for the backward."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return (ACT_COMPILED if compiled else ACT_EAGER) * 2 * (8 * h + 2 * q + 2 * kv + 4 * i)
