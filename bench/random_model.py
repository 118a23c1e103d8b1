"""A random-init model folder with a real model's shape, for speed measurements without its weights.

    python bench/random_model.py --shape qwen3-1.7b --tokenizer /path/to/a/qwen/model --out DIR

The tokenizer (and chat template) comes from --tokenizer, a Hugging Face folder of the same
vocabulary (any Qwen2.5 or Qwen3 model). Weights are bf16, seeded. Generation from random weights
rarely stops, so responses run to the length limit: the slowest case for the engine, the largest for
training.
"""

import argparse
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SHAPES = {
    # Qwen/Qwen3-1.7B's config.json
    "qwen3-1.7b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen/Qwen2.5-0.5B-Instruct's config.json
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
}


def make(shape, tokenizer, out, seed=0):
    """Write the model of `shape` with `tokenizer` (a folder, or a tokenizer object) to `out`."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    kwargs = dict(SHAPES[shape])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    (
        AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, str) else tokenizer
    ).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument(
        "--tokenizer", required=True, help="a Hugging Face folder with the same vocabulary"
    )
    p.add_argument("--out", required=True)
    a = p.parse_args()
    print(make(a.shape, a.tokenizer, a.out))
