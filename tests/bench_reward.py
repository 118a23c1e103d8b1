"""How long scoring one GSM8K batch takes: python tests/bench_reward.py

1,280 made-up responses (a 256-prompt x 5-sample batch), each about 300 tokens of step-by-step
arithmetic, scored with strict and flexible through score_batch, as the train scripts call it.
Prints milliseconds per batch (best of 5).
"""

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reward import compute_score, score_batch  # noqa: E402

N_RESPONSES = 1280
STEPS = [  # (sentence, what it computes from a and b)
    ("First, we find how many {item} {name} has: {a} + {b} = {c}.", lambda a, b: a + b),
    ("Each {item} costs ${a}, so {b} of them cost {a} * {b} = ${c}.", lambda a, b: a * b),
    ("Then {name} gives away {b} {item}, leaving {a} - {b} = {c}.", lambda a, b: a - b),
    ("Over {b} weeks that is {a} * {b} = {c:,} {item} in total.", lambda a, b: a * b),
    ("Half of the {a} {item} is {a} / 2 = {c}.", lambda a, b: a / 2),
]
ENDINGS = [
    "\n#### {answer}",
    "\nThe answer is {answer}.",
    "\nSo the final answer is \\boxed{{{answer}}}.",
    "\n#### {answer:,}",
]


def make_response(rng):
    """About 1,200 characters (~300 tokens) of GSM8K-style working and an ending in one of four
    forms."""
    lines = []
    while sum(map(len, lines)) < 1150:
        a, b = rng.randint(2, 400), rng.randint(2, 400)
        sentence, compute = rng.choice(STEPS)
        lines.append(
            sentence.format(
                item=rng.choice(["apples", "tickets", "eggs", "pages"]),
                name=rng.choice(["Janet", "Tom", "Maria", "the shop"]),
                a=a,
                b=b,
                c=compute(a, b),
            )
        )
    answer = rng.randint(1, 20000)
    return " ".join(lines) + rng.choice(ENDINGS).format(answer=answer), str(answer)


def main():
    rng = random.Random(0)
    responses, truths = zip(*(make_response(rng) for _ in range(N_RESPONSES)))
    sources, infos = ["openai/gsm8k"] * N_RESPONSES, [None] * N_RESPONSES
    print(
        f"{N_RESPONSES} responses, {sum(map(len, responses)) / N_RESPONSES:.0f} characters on "
        f"average"
    )
    print(f"{'method':<10}{'ms / batch':>12}{'mean score':>12}")
    for method in ("strict", "flexible"):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            scores, _, _ = score_batch(
                compute_score, sources, responses, truths, infos, method=method
            )
            times.append(time.perf_counter() - start)
        print(f"{method:<10}{1000 * min(times):>12.1f}{sum(scores) / len(scores):>12.3f}")


if __name__ == "__main__":
    main()
