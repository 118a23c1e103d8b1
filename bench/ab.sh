#!/usr/bin/env bash
# GPU parts of bench/gpu_all.sh in two trees, one after the other, and each part's runs side by side:
#   bash bench/ab.sh OTHER_TREE [PART ...]      (parts: grpo, ppo, card, card_ppo; default grpo ppo)
# OTHER_TREE is A (e.g. the files of an earlier commit: `git archive REV | tar -x -C DIR`), this tree B.
# Each run's metrics go to $OUT/a_PART.jsonl and $OUT/b_PART.jsonl, its log to $OUT/a_PART.log and
# $OUT/b_PART.log; then bench/ab_table.py prints the medians of A and B. MODEL, DATA, PY, LIMIT as in gpu_all.sh.
set -u
OUT=${OUT:-bench_out}
other=$(cd "$1" && pwd); shift
parts=${*:-grpo ppo}
here=$(pwd)
mkdir -p "$OUT"
out=$(cd "$OUT" && pwd)
for part in $parts; do
  for side in a b; do
    tree=$here; [ $side = a ] && tree=$other
    runs=/tmp/ab_runs/$side
    rm -rf "$runs" && mkdir -p "$runs"
    # gpu_all.sh writes the run's folder (checkpoints too) under its OUT (grpo, ppo) or its RUNS
    # (card, card_ppo, gib_*): keep both outside this OUT
    (cd "$tree" && OUT=$runs RUNS=$runs bash bench/gpu_all.sh "$part") > "$out/${side}_$part.log" 2>&1
    cp "$runs/$part/metrics.jsonl" "$out/${side}_$part.jsonl"
  done
  echo "== $part: A = $other, B = $here"
  ${PY:-python3} bench/ab_table.py "$out/a_$part.jsonl" "$out/b_$part.jsonl"
done
