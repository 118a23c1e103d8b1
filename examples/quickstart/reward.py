"""Your own reward, verl's signature: 1 for the word spelled backwards anywhere in the response,
and the response's brevity as an extra metric (logged as critic/brevity/mean, val-aux/...)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {
        "score": float(ground_truth in solution_str),
        "brevity": 1.0 / (1 + len(solution_str.split())),
    }
