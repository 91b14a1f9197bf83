"""Every command in the README and in docs/ is one the tools accept as written: each line of their
```bash blocks goes through what its command does before it starts anything (gpuflow's parser,
the parameter models, the host check, the references imported; `make`'s targets; a deployment's
name and parameters). A command that needs GPUs is checked for its refusal on a host without them,
and its text must say so. Files a user brings are written as the docs describe them (the space
files of their ```yaml blocks, an inputs file); paths with `<...>` or `/abs/path` are placeholders.
The commands' full runs are the other tests' (the pipeline, scripts, sweeps, deployments)."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gpuflow.flows import cli
from gpuflow.tasks.devices.assign import AssignmentError, assign_devices_for, check_host
from gpuflow.tasks.devices.probe import read_environment
from gpuflow.training.errors import UserError
from gpuflow.training.refs import check_references
from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"<[^>]+>|/abs/path/")
NOT_CHECKED = {"cd", "export", "source", "set", "."}  # the shell's own
MAKE_TARGETS = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))


def blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(), re.S)


def commands() -> list[tuple[str, int, str]]:
    """(page, block number, command line) of each command in the pages' bash blocks."""
    found = []
    for page in PAGES:
        for n, block in enumerate(blocks(page, "bash")):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if shlex.split(line, comments=True):
                    found.append((page.name, n, line))
    return found


def needs_gpus(values: dict) -> bool:
    gpus = str(values.get("gpus", "auto"))
    return gpus not in ("auto", "cpu")


def says_gpus(page: str, line: str) -> bool:
    """The line's comment, or the text just above its block, says that it needs GPUs."""
    text = (ROOT / ("README.md" if page == "README.md" else f"docs/{page}")).read_text()
    before = text[:text.index(line.split("#")[0].strip())][-400:]
    return "GPU" in line.partition("#")[2] or re.search(r"needs? (two |those |\w+ )?GPU", before) is not None


def check_gpuflow(argv: list[str], page: str, line: str) -> None:
    if "--help" in argv:
        with pytest.raises(SystemExit) as e:
            cli.parse(argv)
        assert e.value.code == 0
        return
    command, model, values = cli.parse(argv)
    if model is None:  # probe
        return
    try:
        params = model(**values)
    except ValidationError as e:
        assert all(PLACEHOLDER.search(str(err.get("input"))) for err in e.errors()), f"{line}: {cli.one_line(e)}"
        return
    if command in ("run", "sweep"):
        check_references(params)
        if getattr(params, "nodes", 1) <= 1:
            check_host(params)
        if needs_gpus(values) and not torch.cuda.is_available():
            assert says_gpus(page, line), f"{page}: {line!r} needs GPUs and its text does not say so"
            with pytest.raises(AssignmentError, match="asks for GPUs but none are usable|not visible|no GPU"):
                assign_devices_for(read_environment(), params, getattr(params, "batch_size", None))


def check_deployment(argv: list[str], line: str) -> None:
    from gpuflow.flows import serve

    name = argv[0]
    served = {f"{d.flow_name}/{d.name}" for d in serve.deployments()}
    assert name in served, f"{line}: no deployment {name!r}; `gpuflow serve` serves {sorted(served)}"
    flows = {f.name: f for f in (serve.train_pipeline, serve.retrain, serve.evaluate_model, serve.train_script,
                                 serve.sweep)}
    given = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-p")
    known = flows[name.split("/")[0]].parameters.properties
    assert set(given) <= set(known), f"{line}: {sorted(set(given) - set(known))} are not parameters of {name}"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A copy of the checkout's examples, the docs' space files and an inputs file, as a user has them."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("mlflow.db", "runs"))
    for page in PAGES:
        for block in blocks(page, "yaml"):
            first = block.splitlines()[0]
            if re.fullmatch(r"# [\w.-]+\.yaml.*", first):
                for folder in (tmp_path, tmp_path / "examples" / "myproj"):
                    (folder / first.split()[1].rstrip(":")).write_text(block)
    torch.save({"inputs": torch.rand(2, 1, 28, 28)}, tmp_path / "x.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


@pytest.mark.parametrize("page", sorted({p for p, _, _ in commands()}))
def test_every_command_on_the_page_is_accepted_as_written(page, project, monkeypatch):
    checked, block = 0, None
    for where, n, line in commands():
        if where != page:
            continue
        if n != block:  # each block starts where the reader is: the top of the checkout
            block = n
            monkeypatch.chdir(project)
        argv = shlex.split(line, comments=True)
        while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the command
            argv = argv[1:]
        tool, args = Path(argv[0]).name, argv[1:]
        if tool == "cd":
            monkeypatch.chdir(project / args[0])
        elif tool in NOT_CHECKED:
            continue
        elif tool == "make":
            assert args[0] in MAKE_TARGETS, f"{page}: {line!r}: no make target {args[0]!r}"
            extra = [a.split("=", 1)[1] for a in args[1:] if a.startswith("ARGS=")]
            if args[0] == "run" and extra:
                check_gpuflow(["run", *shlex.split(extra[0])], page, line)
        elif tool == "gpuflow":
            try:
                check_gpuflow(args, page, line)
            except UserError as e:
                raise AssertionError(f"{page}: {line!r} is refused: {e}") from None
        elif tool == "prefect" and args[:2] == ["deployment", "run"]:
            check_deployment(args[2:], line)
        else:
            raise AssertionError(f"{page}: {line!r}: a command this test does not know how to check")
        checked += 1
    assert checked, f"{page} has commands but none was checked"


def test_sweeps_on_one_page_that_optimize_other_metrics_name_other_studies():
    """A page's sweeps run one after another in one folder: a study resumes only for its own metric and direction,
    so a second objective under the first one's study name would be refused."""
    from gpuflow.flows.study import study_name

    for page in {p for p, _, _ in commands()}:
        objectives: dict[str, tuple] = {}
        for where, _, line in commands():
            argv = shlex.split(line, comments=True)
            if where != page or argv[:2] != ["gpuflow", "sweep"] or "--help" in argv:
                continue
            _, _, values = cli.parse(argv[1:])
            objective = (values.get("optimize"), values.get("direction"))
            study = study_name(values)
            assert objectives.setdefault(study, objective) == objective, \
                f"{page}: {line!r} optimizes {objective}, but study {study!r} was made for {objectives[study]}"
