"""Tiny offline test assets: a byte-level BPE tokenizer with a Qwen-like chat template."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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

    pad = <|endoftext|> (256), eos = <|im_end|> (258), as in Qwen2.5-Instruct. No merges, so a string
    of k ASCII characters is exactly k tokens, which makes lengths in tests easy to work out.
    """
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}  # id = byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE)


def _bytes_to_unicode():
    """GPT-2's map from the 256 bytes to the printable characters that ByteLevel works on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
