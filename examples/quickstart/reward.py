"""Your own reward, verl's signature: 1 for the word spelled backwards anywhere in the response,
else partial credit, half the share of its letters the response holds (so that a group's responses
differ and GRPO has something to learn from before any of them is right); and the response's
brevity as an extra metric (logged as critic/score/brevity/mean, val-aux/...)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    letters = sum(c in solution_str for c in ground_truth) / max(len(ground_truth), 1)
    return {
        "score": 1.0 if ground_truth in solution_str else 0.5 * letters,
        "brevity": 1.0 / (1 + len(solution_str.split())),
    }
