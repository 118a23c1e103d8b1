#!/usr/bin/env bash
# Build an offline vLLM payload for the GPU test machine (H200, python3.12, torch 2.11.0+cu130,
# transformers 5.17, no network). Runs on a CPU machine that reaches PyPI (about 7 minutes, most of
# them xz's).
# Output: <=60 MiB parts, one per folder, so that each transfer to the GPU machine stays under 64 MiB.
#
#   bash bench/fetch_vllm.sh [REPO_ROOT]     # default REPO_ROOT = current git root
#
# Produces  REPO_ROOT/.whl/vllm1/site.tar.xz.part00   (60 MiB)
#           REPO_ROOT/.whl/vllm2/site.tar.xz.part01   (~20 MiB) + site.tar.xz.sha256
# (.whl/ is git-ignored)
#
# Why vllm 0.26.0: it is the newest vllm whose wheel pins torch==2.11.0 (0.20.0..0.26.0 pin 2.11.0,
# 0.27.x..0.29.0 pin 2.13.0, 0.33.0 pins 2.14.0) and its kernels link libcudart.so.13 (CUDA 13),
# matching the GPU machine's torch 2.11.0+cu130.
set -euo pipefail
REPO=${1:-$(git rev-parse --show-toplevel)}
WORK=${WORK:-/tmp/vllm_payload}
VLLM_VERSION=0.26.0
PIP=${PIP:-python3 -m pip}
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64"
TGT="--only-binary=:all: --python-version 3.12 --implementation cp $PLAT"

# Exactly what `from vllm import LLM` + an offline dense-model engine needs beyond the GPU machine's own packages
# (found by importing vllm module-by-module; the GPU machine already has torch, transformers, tokenizers,
# numpy, triton, aiohttp, cloudpickle, psutil, pyyaml, regex, requests, tqdm, typing_extensions 4.16, ...).
# xgrammar is held at 0.2.7: 0.2.8+ need a newer apache-tvm-ffi than vllm's pin (0.1.10)
# ("load_lib_module() got an unexpected keyword argument 'extra_lib_paths'").
DEPS="annotated-types==0.8.0 apache-tvm-ffi==0.1.10 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0
      fastapi==0.136.3 httpx2==2.16.2 llguidance==1.7.6 msgspec==0.23.0 openai==3.57.0
      openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4
      pydantic-core==2.50.5 pyzmq==27.3.0 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0
      typing-extensions==4.16.0 typing-inspection==0.4.5 xgrammar==0.2.7"

rm -rf "$WORK" && mkdir -p "$WORK/wheels" "$WORK/site"
cd "$WORK"
t0=$(date +%s)
$PIP download -q --no-deps $TGT -d wheels "vllm==$VLLM_VERSION" $DEPS
echo "downloaded: $(du -sh wheels | cut -f1) in $(( $(date +%s) - t0 ))s"; ls -l wheels | awk 'NR>1{print $5, $9}'

# Unpack for python3.12 (pure file copy: the target python is not this one).
$PIP install -q --no-index --no-deps --no-compile $TGT --target site wheels/*.whl

# Slim: drop what a dense bf16 model on Hopper never loads (each import below is guarded in vllm
# 0.26.0: FA2 is try/except in vllm_flash_attn/flash_attn_interface.py, _moe_C/_qutlass_C are
# contextlib.suppress(ImportError) in platforms/cuda.py; deep_gemm/flashmla are probed with find_spec).
# Keeps _C_stable_libtorch (mandatory), vllm_flash_attn/_vllm_fa3_C (FlashAttention 3 on sm_90),
# cumem_allocator (sleep mode).
rm -rf site/bin \
  site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
  site/vllm/_moe_C_stable_libtorch.abi3.so \
  site/vllm/vllm-rs \
  site/vllm/third_party/deep_gemm site/vllm/third_party/fmha_sm100 \
  site/vllm/_flashmla_C.abi3.so site/vllm/_flashmla_extension_C.abi3.so site/vllm/_qutlass_C.abi3.so \
  site/vllm/entrypoints/serve/instrumentator/static
echo "slim site: $(du -sh site | cut -f1)"

t1=$(date +%s)
tar -C site -cf - . | xz -6 -T0 > site.tar.xz     # ~4 min on 2 cores; gzip -6 gives 119 MB (also 2 chunks) in 18 s
sha256sum site.tar.xz > site.tar.xz.sha256
split -b 60M -d site.tar.xz site.tar.xz.part
echo "site.tar.xz: $(stat -c %s site.tar.xz) bytes, xz took $(( $(date +%s) - t1 ))s"

# One part per folder, so each transfer takes one folder (<= 64 MiB each).
rm -rf "$REPO"/.whl/vllm[0-9]*
i=1
for p in site.tar.xz.part*; do
  mkdir -p "$REPO/.whl/vllm$i"; cp "$p" "$REPO/.whl/vllm$i/"; i=$((i+1))
done
cp site.tar.xz.sha256 "$REPO/.whl/vllm$((i-1))/"
du -sh "$REPO"/.whl/vllm*
