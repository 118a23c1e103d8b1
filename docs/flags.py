"""Write docs/flags.md, every flag of both train scripts with its defaults, its --help and verl's key,
from the scripts' Args: `python docs/flags.py`. tests/test_docs.py fails when a flag has no verl
entry (cli.VERL for the shared flags, a script's Args.VERL for its own) or the file is not what
this writes."""

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cli import VERL_ELSEWHERE, settled_as, verl_settled, verl_table  # noqa: E402
from flags import DOCS  # noqa: E402


def rows():
    """(flag, GRPO default, PPO default, help, verl key) for every flag of either script."""
    import train_grpo
    import train_ppo

    def defaults(Args):
        return {f.name: (f.default, DOCS.get(f, f.metadata["help"])) for f in dataclasses.fields(Args)}

    grpo, ppo = defaults(train_grpo.Args), defaults(train_ppo.Args)
    keys = verl_table(train_grpo.Args) | verl_table(train_ppo.Args)
    for name in dict.fromkeys([*grpo, *ppo]):
        help = (grpo.get(name) or ppo.get(name))[1]
        g = repr(grpo[name][0]) if name in grpo else "-"
        p = repr(ppo[name][0]) if name in ppo else "-"
        yield name, g, p, help, keys.get(name, "MISSING")


def markdown():
    import train_grpo
    import train_ppo

    lines = [
        "# Every flag",
        "",
        "Written by `python docs/flags.py` from the train scripts' `Args` (tests/test_docs.py checks",
        "that it is current). Defaults as declared; `None` means chosen at start-up (the --help text",
        "says how). Booleans take `--flag` or `--flag true|false`. A verl key of `-` is ours: verl",
        "has no such setting.",
        "",
        "| flag | GRPO default | PPO default | what it does | verl's key |",
        "|---|---|---|---|---|",
    ]
    for name, g, p, help, key in rows():
        help = help.replace("|", "\\|")
        lines.append(f"| `--{name}` | `{g}` | `{p}` | {help} | {f'`{key}`' if key else '-'} |")
    lines += [
        "",
        "## verl's keys with no flag here",
        "",
        "A pasted verl command line may hold these. A key whose values are listed is left out",
        "(with a note) when it asks for what the scripts do, and refused otherwise; `any`: left",
        "out whatever its value. The rest are refused, saying why. Any key set to `null` asks",
        "for verl's default and is left out.",
        "",
        "| verl's key | train_grpo.py leaves out | train_ppo.py leaves out | why |",
        "|---|---|---|---|",
    ]
    grpo, ppo = verl_settled(train_grpo.Args), verl_settled(train_ppo.Args)

    def left(entry):
        if entry is None:
            return "(a flag, or refused)"
        return "any" if entry[0] is None else ", ".join(f"`{v}`" for v in entry[0])

    for key in sorted(grpo.keys() | ppo.keys()):
        g, p = settled_as(key, grpo), settled_as(key, ppo)
        whys = {e[1] for e in (g, p) if e}
        why = whys.pop() if len(whys) == 1 else f"GRPO: {g[1]}; PPO: {p[1]}"
        name = f"{key}*" if key.endswith(".") else key
        lines.append(f"| `{name}` | {left(g)} | {left(p)} | {why} |")
    for key, why in sorted(VERL_ELSEWHERE.items()):
        lines.append(f"| `{key}` | refused | refused | {why} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(os.path.join(ROOT, "docs", "flags.md"), "w") as f:
        f.write(markdown())
