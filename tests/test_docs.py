"""What a newcomer reads is true: the parameter reference is generated from the models, so it
cannot drift from what the commands accept."""

from __future__ import annotations

import runpy

from tests.helpers import ROOT


def test_the_parameter_reference_is_what_the_parameter_models_declare_today():
    generator = runpy.run_path(str(ROOT / "docs" / "parameters.py"))
    written = (ROOT / "docs" / "parameters.md").read_text()
    assert written == generator["render"](), "docs/parameters.md is stale: run .venv/bin/python docs/parameters.py"


def test_the_reference_names_every_option_of_every_command():
    from gpuflow.flows.cli import parser

    written = (ROOT / "docs" / "parameters.md").read_text()
    top = parser(False)
    commands = next(a for a in top._actions if a.dest == "command").choices
    for name, sub in commands.items():
        if name == "probe":
            continue
        for action in sub._actions:
            flag = next((o for o in action.option_strings if o.startswith("--") and o != "--help"), None)
            if flag and not flag.startswith("--no-"):
                assert f"`{flag}`" in written, f"gpuflow {name} {flag} is not in docs/parameters.md"
