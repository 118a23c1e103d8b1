"""The reference docs that are generated cannot drift: every flag of both train scripts has its row
in docs/flags.md (with verl's key, or none), and the file is what docs/flags.py writes."""

import dataclasses
import importlib.util
from pathlib import Path

import cli
import train_grpo
import train_ppo

ROOT = Path(__file__).resolve().parents[1]


def flags_doc():
    spec = importlib.util.spec_from_file_location("flags_doc", ROOT / "docs" / "flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_flag_has_its_row_and_verl_key():
    both = set()
    for Args in (train_grpo.Args, train_ppo.Args):
        names = {f.name for f in dataclasses.fields(Args)}
        both |= names
        missing = names - set(cli.verl_table(Args))
        assert not missing, f"{Args.__module__}: flags without a verl entry in cli.VERL: {missing}"
    assert not set(cli.VERL) - both, f"entries for no flag: {set(cli.VERL) - both}"


def test_docs_flags_md_is_current():
    assert (ROOT / "docs" / "flags.md").read_text() == flags_doc().markdown(), (
        "docs/flags.md is stale: run python docs/flags.py"
    )


def test_every_script_the_docs_name_is_here():
    """Every script the README, docs/ and examples/ name in code (`...`, or a command line) is in
    the repository: a path at that path, a bare name as some file's; but the reader's own files."""
    import re
    import subprocess

    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.sh")]
    code = []
    for t in texts:
        text = t.read_text()
        if t.suffix == ".md":  # fenced blocks whole, then the inline code of the rest
            code += re.findall(r"```.*?```", text, re.S)
            text = "\n".join(re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))
        code.append(text)
    code = "\n".join(code)
    named = set(re.findall(r"(?<![\w/.~$-])((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b", code))
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(listed, cwd=ROOT, capture_output=True, text=True).stdout
    tracked = tracked.split()
    names = {Path(f).name for f in tracked}
    yours = {"my_reward.py", "train_rloo.py"}  # the README's examples of a reader's files
    missing = {
        n
        for n in named
        if Path(n).name not in yours and (n not in tracked if "/" in n else n not in names)
    }
    assert len(named) > 30 and not missing, missing
