#!/usr/bin/env python3
"""Reassemble the staged GGUF chunks, verify sha256, convert to a Hugging Face folder (bf16
safetensors + tokenizer with chat template) that vLLM and transformers load offline.

Runs on the GPU test machine (python3.12, torch 2.11.0+cu130, transformers 5.17.0; no network, no
gguf package: the gguf wheel comes in .whl/model1 and is unzipped to /tmp/gguf_site).

    python3 bench/gguf_to_hf.py [--stage /tmp/stage] [--out /tmp/models/qwen2.5-coder-0.5b-instruct]

Inputs in --stage (the parts from .whl/model1..8, copied there):
    qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.partNN   (NN = 01..K, concatenated in order)
    qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.sha256   (sha256sum format)
    gguf-*.whl                                        (pure python; needs numpy, pyyaml, requests
                                                       and tqdm, which the machine has)
Output: --out with config.json, generation_config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json (chat_template inside) [+ chat_template.jinja]; prints a JSON summary line.
Skips everything if --out already holds a finished conversion (marker file CONVERTED).
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def log(*a):
    print("[gguf_to_hf]", *a, flush=True)


def assemble(stage, dst_dir):
    parts = sorted(glob.glob(os.path.join(stage, GGUF_NAME + ".part*")))
    if not parts:
        sys.exit(f"no chunks {GGUF_NAME}.part* in {stage}")
    want = open(os.path.join(stage, GGUF_NAME + ".sha256")).read().split()[0]
    os.makedirs(dst_dir, exist_ok=True)
    dst = os.path.join(dst_dir, GGUF_NAME)
    h = hashlib.sha256()
    t = time.time()
    with open(dst, "wb") as fo:
        for p in parts:
            with open(p, "rb") as fi:
                while True:
                    b = fi.read(16 << 20)
                    if not b:
                        break
                    h.update(b)
                    fo.write(b)
    got = h.hexdigest()
    log(
        f"assembled {len(parts)} parts -> {dst} ({os.path.getsize(dst)} bytes) "
        f"in {time.time() - t:.1f}s"
    )
    if got != want:
        sys.exit(
            f"SHA256 MISMATCH: got {got} want {want} "
            f"(parts: {[os.path.basename(p) for p in parts]})"
        )
    log(f"sha256 OK {got}")
    return dst


def ensure_gguf(stage):
    try:
        import gguf  # noqa: F401

        return
    except ImportError:
        pass
    whls = sorted(glob.glob(os.path.join(stage, "gguf-*.whl")))
    if not whls:
        sys.exit("gguf package missing and no gguf-*.whl in stage dir")
    site = "/tmp/gguf_site"
    if not os.path.isdir(os.path.join(site, "gguf")):
        with zipfile.ZipFile(whls[-1]) as z:
            z.extractall(site)
    sys.path.insert(0, site)
    import gguf  # noqa: F401

    log("gguf", getattr(gguf, "__version__", "?"), "from", whls[-1])


def memoize_gguf_reader():
    """transformers builds a GGUFReader (slow: pure-python parse of ~300k vocab/merge strings) once
    for the config and again for the weights/tokenizer; reuse one reader per file."""
    import gguf

    orig = gguf.GGUFReader
    if getattr(orig, "_memoized", False):
        return
    cache = {}

    def reader(path, *a, **k):
        key = (os.path.abspath(str(path)), a, tuple(sorted(k.items())))
        if key not in cache:
            cache[key] = orig(path, *a, **k)
        return cache[key]

    reader._memoized = True
    gguf.GGUFReader = reader  # transformers does `from gguf import GGUFReader` at call time


def convert(gguf_path, out):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    memoize_gguf_reader()
    d, name = os.path.split(gguf_path)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    # The tokenizer conversion (pure-python parse of 151,936 tokens + 151,387 merges) runs in a
    # second process, in parallel with the model's dequantization.
    t = t0_tok = time.time()
    tok_proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--tokenizer-only", gguf_path, "--out", out],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16)
    t_model = time.time() - t
    # transformers keeps a (non-serializable) GGUF quantizer on the model; the weights are plain
    # dequantized tensors, so drop it to allow save_pretrained.
    model.hf_quantizer = None
    for obj in (model.config,):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    cfg = model.config
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = emb.data_ptr() == head.data_ptr()
    log(
        f"loaded {type(model).__name__} in {t_model:.1f}s; "
        f"params {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M; "
        f"tie_word_embeddings={cfg.tie_word_embeddings} (tensors shared: {tied}); "
        f"|emb-head| max {float((emb.detach().float() - head.detach().float()).abs().max()):.4f}"
    )

    # Special tokens of Qwen2.5-Instruct: eos <|im_end|> 151645, pad/bos <|endoftext|> 151643.
    im_end, eot = 151645, 151643  # checked against the saved tokenizer below
    cfg.eos_token_id = im_end
    cfg.bos_token_id = eot
    cfg.pad_token_id = eot
    # Neutral generation config: stop on <|im_end|> or <|endoftext|>, no sampling defaults (so
    # vLLM's generation_config="auto" adds no temperature/top_p/repetition_penalty of its own).
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot
    )

    t = time.time()
    model.save_pretrained(out, safe_serialization=True)
    t_save = time.time() - t
    rc = tok_proc.wait()
    t_tok = time.time() - t0_tok
    if rc != 0:
        sys.exit(f"tokenizer conversion failed (rc={rc})")

    # Self-checks: chat template present, specials are single tokens, reload works.
    tok2 = AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "What is 1+1?"}]
    text = tok2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok2(text, add_special_tokens=False)["input_ids"]
    assert tok2.chat_template, "chat template missing after save"
    assert (
        tok2.convert_tokens_to_ids("<|im_end|>") == im_end
        and tok2.convert_tokens_to_ids("<|endoftext|>") == eot
    )
    assert tok2.eos_token == "<|im_end|>", tok2.eos_token
    assert ids.count(tok2.convert_tokens_to_ids("<|im_start|>")) == 3, (text, ids)
    cfg2 = json.load(open(os.path.join(out, "config.json")))
    files = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
    summary = dict(
        out=out,
        transformers=transformers.__version__,
        torch=torch.__version__,
        load_s=round(t_model, 1),
        save_s=round(t_save, 1),
        tokenizer_s=round(t_tok, 1),
        tied=tied,
        tokenizer={k: getattr(tok2, k) for k in ["eos_token", "pad_token", "bos_token"]},
        config={
            k: cfg2.get(k)
            for k in [
                "architectures",
                "dtype",
                "torch_dtype",
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "rope_theta",
                "rope_parameters",
                "rms_norm_eps",
                "max_position_embeddings",
                "tie_word_embeddings",
                "bos_token_id",
                "eos_token_id",
                "use_sliding_window",
            ]
        },
        files=files,
        chat_prompt=text,
        chat_prompt_ids=ids,
    )
    open(os.path.join(out, "CONVERTED"), "w").write(json.dumps(summary, indent=1))
    print("CONVERT_SUMMARY " + json.dumps(summary), flush=True)
    return model, tok2


def tokenizer_only(gguf_path, out):
    from transformers import AutoTokenizer

    memoize_gguf_reader()
    t = time.time()
    d, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    tok.eos_token = (
        "<|im_end|>"  # Qwen2.5-Instruct: eos <|im_end|>, pad <|endoftext|>, no bos added
    )
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    tok.save_pretrained(out)
    log(
        f"tokenizer converted in {time.time() - t:.1f}s: {type(tok).__name__} vocab {len(tok)} "
        f"eos {tok.eos_token!r} pad {tok.pad_token!r} bos {tok.bos_token!r} "
        f"chat_template {bool(tok.chat_template)}"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage", default="/tmp/stage")
    ap.add_argument("--gguf-dir", default="/tmp/models/gguf")
    ap.add_argument("--out", default="/tmp/models/qwen2.5-coder-0.5b-instruct")
    ap.add_argument(
        "--check-generate", type=int, default=1, help="greedy HF generate on one prompt (sanity)"
    )
    a = ap.parse_args()
    if a.tokenizer_only:
        return tokenizer_only(a.tokenizer_only, a.out)
    t0 = time.time()
    if os.path.exists(os.path.join(a.out, "CONVERTED")):
        log("already converted:", a.out)
        return
    ensure_gguf(a.stage)
    g = assemble(a.stage, a.gguf_dir)
    model, tok = convert(g, a.out)
    if a.check_generate:
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        model = model.to(dev).eval()
        msgs = [
            {
                "role": "user",
                "content": "Natalia sold clips to 48 of her friends in April, and then she sold "
                "half as many clips in May. How many clips did Natalia sell altogether in April "
                "and May? Let's think step by step "
                'and output the final answer after "####".',
            }
        ]
        ids = tok.apply_chat_template(
            msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(dev)
        with torch.no_grad():
            o = model.generate(ids, max_new_tokens=160, do_sample=False)
        log("HF greedy sample:", repr(tok.decode(o[0, ids.shape[1] :], skip_special_tokens=False)))
    log(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
