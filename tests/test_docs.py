"""The reference docs that are generated cannot drift: every flag of both train scripts has its row
in docs/flags.md (with verl's key, or none), and the file is what docs/flags.py writes."""

import dataclasses
import importlib.util
from pathlib import Path

import train_grpo
import train_ppo

ROOT = Path(__file__).resolve().parents[1]


def flags_doc():
    spec = importlib.util.spec_from_file_location("flags_doc", ROOT / "docs" / "flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_flag_has_its_row_and_verl_key():
    doc = flags_doc()
    names = {f.name for Args in (train_grpo.Args, train_ppo.Args) for f in dataclasses.fields(Args)}
    assert not names - set(doc.VERL), (
        f"flags without an entry in docs/flags.py: {names - set(doc.VERL)}"
    )
    assert not set(doc.VERL) - names, f"entries for no flag: {set(doc.VERL) - names}"


def test_docs_flags_md_is_current():
    assert (ROOT / "docs" / "flags.md").read_text() == flags_doc().markdown(), (
        "docs/flags.md is stale: run python docs/flags.py"
    )
