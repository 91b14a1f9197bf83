"""The served allowlist as an attacker meets it (gpuflow/flows/allow.py, training/refs.py
`resolve_defined`) and what a script leaves behind as the run logs it (tasks/scriptout.py).

A served run's references may name only a class or function *defined* in the allowed code,
by one name or as Class.method; nothing is called while checking. Collected and output files
are logged only when their real paths stay in the folder being logged.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import mlflow
import pytest

from gpuflow.flows import allow
from gpuflow.flows.params import EvaluateParams, PipelineParams, ScriptParams
from gpuflow.flows.settings import Settings
from gpuflow.tasks import scriptout
from gpuflow.training.refs import resolve
from tests.test_user_code import api_url, gpuflow  # noqa: F401  (the session's Prefect server)

# An allowed package whose modules import what an attacker wants to reach.
PACKAGE = {
    "__init__.py": "from .nets import Net\n",
    "nets.py": """
        import functools, os, subprocess
        from os import system
        import torch
        from torch import nn

        run_shell = os.system                       # a builtin, bound to a name of this module
        shell_later = functools.partial(os.system)  # an object, not a function

        class Net(nn.Module):
            def __init__(self, width=4):
                super().__init__()
                self.fc = nn.Linear(width, 2)

            def forward(self, x):
                return self.fc(x)

            @classmethod
            def small(cls):
                return cls(2)

            helper = staticmethod(os.getcwd)        # a class attribute that is not this code's

        class Spawn(subprocess.Popen):              # this package's own class: the operator's code
            pass

        def make(width=4):
            return Net(width)

        net = Net()                                 # an instance
    """,
    "hooked.py": """
        from pathlib import Path
        def __getattr__(name):                      # a module hook must never run while checking
            Path("hook-ran").write_text(name)
            return print
    """,
}

ESCAPES = {  # reference: what the refusal says
    "pkgx.nets:nn.functional.torch.os.system": "not a path through other objects",
    "pkgx.nets:torch": "'torch' is a module",
    "pkgx.nets:os": "'os' is a module",
    "pkgx.nets:system": "'system' is a builtin_function_or_method",
    "pkgx.nets:run_shell": "'run_shell' is a builtin_function_or_method",
    "pkgx.nets:shell_later": "'shell_later' is a partial",
    "pkgx.nets:net": "'net' is a Net",
    "pkgx.nets:nn": "'nn' is a module",
    "pkgx.nets:Net.parameters": "defined in 'torch.nn.modules.module'",
    "pkgx.nets:Net.helper": "'helper' is a staticmethod",
    "pkgx.nets:make.__globals__": "not a path through other objects",
    "pkgx.nets:Net.__init__": "not a path through other objects",
    "pkgx.nets:make.small": "'make' is not a class",
    "pkgx.hooked:anything": "has no attribute 'anything'",
    "pkgx:nets": "'nets' is a module",
}


def package(root: Path) -> Path:
    for name, code in PACKAGE.items():
        (root / "pkgx").mkdir(parents=True, exist_ok=True)
        (root / "pkgx" / name).write_text(textwrap.dedent(code))
    return root


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A served run's context: serve's folder holds the allowed package `pkgx`."""
    monkeypatch.chdir(package(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(allow.deployment, "get_id", lambda: "a-deployment-id")
    yield Settings(allow_code="pkgx", allow_paths=str(tmp_path))
    for name in [m for m in sys.modules if m == "pkgx" or m.startswith("pkgx.")]:
        del sys.modules[name]


@pytest.mark.parametrize("field", ["model", "dataset", "objective"])
@pytest.mark.parametrize("ref", list(ESCAPES))
def test_a_served_reference_cannot_reach_past_the_allowed_codes_own_classes_and_functions(served, ref, field):
    with pytest.raises(allow.NotAllowed, match=ESCAPES[ref].replace("(", r"\(")) as refused:
        allow.check_allowed(PipelineParams(**{field: ref}), served)
    assert f"{field} {ref!r}" in str(refused.value) and "\n" not in str(refused.value)
    assert not Path("hook-ran").exists()  # nothing of the allowed module ran but its import


def test_the_evaluate_flow_checks_its_dataset_reference_the_same_way(served):
    with pytest.raises(allow.NotAllowed, match="not a path through other objects"):
        allow.check_allowed(EvaluateParams(dataset="pkgx.nets:nn.functional.torch.os.system"), served)


@pytest.mark.parametrize("ref", ["pkgx.nets:Net", "pkgx:Net", "pkgx.nets:make", "pkgx.nets:Net.small",
                                 "pkgx.nets:Spawn"])
def test_a_served_reference_to_the_allowed_codes_own_class_or_function_passes(served, ref):
    allow.check_allowed(PipelineParams(model=ref), served)


def test_a_served_file_reference_names_what_the_file_itself_defines_never_installed_code(served, tmp_path):
    own = tmp_path / "mine.py"
    own.write_text("from os import system\nimport torch\nclass Net(torch.nn.Linear):\n    pass\n")
    allow.check_allowed(PipelineParams(model=f"{own}:Net"), served)
    for attr, message in {"system": "builtin_function_or_method", "torch": "module"}.items():
        with pytest.raises(allow.NotAllowed, match=message):
            allow.check_allowed(PipelineParams(model=f"{own}:{attr}"), served)
    # A project's .venv lies in serve's folder; its libraries are not the project's code.
    import torch

    hub = Path(torch.__file__).resolve().parent / "hub.py"
    everywhere = Settings(allow_code="pkgx", allow_paths="/")
    with pytest.raises(allow.NotAllowed, match="is a file of installed Python code"):
        allow.check_allowed(PipelineParams(model=f"{hub}:load"), everywhere)
    # A link in the allowed folder to a file outside is judged where it leads.
    outside = tmp_path.parent / f"{tmp_path.name}-outside.py"
    outside.write_text(own.read_text())
    (tmp_path / "link.py").symlink_to(outside)
    with pytest.raises(allow.NotAllowed, match="is outside the folders"):
        allow.check_allowed(PipelineParams(model=f"{tmp_path / 'link.py'}:Net"), served)


def test_a_local_run_still_names_installed_code_by_any_path():
    """Local runs are the user's own shell: a library's factory keeps working."""
    factory = resolve("torchvision.models:resnet18", None, "model")
    assert callable(factory) and factory.__name__ == "resnet18"
    assert callable(resolve("torch.nn:functional.relu", None))


# --- collect patterns and the files a script leaves ------------------------------------------


@pytest.mark.parametrize("pattern", ["**/../**/../**/../etc/passwd", "../../etc/passwd", "/etc/*", "~/x",
                                     "a/../../b", " "])
def test_collect_patterns_that_leave_the_working_folder_are_refused_before_launch(tmp_path, pattern):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    with pytest.raises(ValueError, match="must be a glob relative to the working folder that stays inside it"):
        ScriptParams(script=str(script), collect=[pattern])


def test_matched_files_are_judged_by_their_real_paths(tmp_path):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "model.pt").write_text("x")
    (work / "sub" / "other.pt").write_text("y")
    (work / "passwd.pt").symlink_to("/etc/passwd")
    (work / "linked").symlink_to("/etc")
    files, skipped = scriptout.collected_files(["*.pt", "**/*.pt", "linked/passwd", "linked/*"], work)
    assert files == sorted([(work / "model.pt").resolve(), (work / "sub" / "other.pt").resolve()])
    assert any("passwd.pt" in s and "outside" in s for s in skipped)
    assert not any(str(f).startswith("/etc") for f in files)


def test_links_in_a_logged_folder_are_never_followed(tmp_path):
    out = tmp_path / "outputs"
    (out / "deep").mkdir(parents=True)
    (out / "w.pt").write_text("w")
    (out / "deep" / "log.txt").write_text("l")
    (out / "passwd").symlink_to("/etc/passwd")
    (out / "etc").symlink_to("/etc")
    (out / "deep" / "inside").symlink_to(out / "w.pt")  # a link even to a file inside is not followed
    files, skipped = scriptout.plain_files(out)
    assert files == [out / "deep" / "log.txt", out / "w.pt"]
    assert len(skipped) == 3
    linked_root = tmp_path / "linked-outputs"
    linked_root.symlink_to("/etc")
    assert scriptout.plain_files(linked_root)[0] == []


LINKING_SCRIPT = """\
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
out = os.environ["GPUFLOW_OUTPUT_DIR"]
if dist.get_rank() == 0:
    os.symlink("/etc/passwd", os.path.join(out, "passwd"))
    os.symlink("/etc", os.path.join(out, "etc"))
    torch.save(torch.nn.Linear(2, 2).state_dict(), os.path.join(out, "w.pt"))
dist.destroy_process_group()
"""


def test_a_script_that_links_out_of_its_output_folder_logs_only_its_own_files(tmp_path, api_url):
    """A real script run: its links to /etc are skipped and named, and the run still FINISHED."""
    (tmp_path / "linker.py").write_text(LINKING_SCRIPT)
    out = gpuflow(["run", "--script", "linker.py", "--gpus", "cpu", "--cpu-processes", "2"], tmp_path, api_url)
    assert out.returncode == 0, out.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gpuflow").experiment_id])
    assert run.info.status == "FINISHED"
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "outputs")}
    assert logged == {"outputs/w.pt"}
    assert "passwd (a link)" in run.data.tags["gpuflow.skipped"] and "etc (a link)" in run.data.tags["gpuflow.skipped"]


def test_logging_a_finished_scripts_files_never_raises(tmp_path):
    """What cannot be logged is skipped and named: the run of a script that finished stays FINISHED."""
    files, skipped = scriptout.collected_files(["/etc/*", "model.pt"], tmp_path)  # absolute: glob refuses it
    assert files == [] and len(skipped) == 1 and "/etc/*" in skipped[0]

    class Refusing:  # a store that fails on every file
        def log_artifact(self, *args):
            raise OSError("disk full")

    run = type("Run", (), {"client": Refusing(), "run_id": "r"})()
    (tmp_path / "w.pt").write_text("x")
    lost: list[str] = []
    scriptout._log_file(run, tmp_path / "w.pt", "outputs", lost)
    assert lost == [f"{tmp_path / 'w.pt'} (OSError: disk full)"]


def test_a_served_sweep_reads_its_space_and_keeps_its_study_only_inside_the_allowed_folders(served, tmp_path,
                                                                                             monkeypatch):
    from gpuflow.flows.calls import entered
    from gpuflow.flows.params import SweepParams

    monkeypatch.setenv("GPUFLOW_ALLOW_CODE", "pkgx")
    monkeypatch.setenv("GPUFLOW_ALLOW_PATHS", str(tmp_path))
    inside = tmp_path / "space.yaml"
    inside.write_text("lr: {type: float, low: 0.001, high: 0.1}\n")
    outside = tmp_path.parent / f"{tmp_path.name}-secret.yaml"
    outside.write_text("password: hunter2\n")  # a YAML file the caller must not get echoed back
    (tmp_path / "link.yaml").symlink_to(outside)
    try:
        for space in (outside, tmp_path / "link.yaml"):
            with pytest.raises(allow.NotAllowed, match="is outside the folders") as refused:
                entered(SweepParams, {"space": str(space)})  # every flow's parameters pass the door here
            assert "hunter2" not in str(refused.value)
        for storage in ("postgresql+psycopg://attacker@10.0.0.1/db", f"sqlite:///{tmp_path.parent / 'x.db'}"):
            with pytest.raises(allow.NotAllowed, match="storage="):
                entered(SweepParams, {"space": str(inside), "storage": storage})
        with pytest.raises(allow.NotAllowed, match="not a path through other objects"):  # nothing imported past it
            entered(SweepParams, {"space": str(inside), "objective": "pkgx.nets:nn.functional.torch.os.system"})
        entered(SweepParams, {"space": str(inside), "model": "pkgx.nets:Net",
                              "storage": f"sqlite:///{tmp_path / 'optuna.db'}"})
    finally:
        outside.unlink()
    assert not (tmp_path.parent / "x.db").exists()


def test_a_served_sweeps_trial_passes_the_door_with_the_values_its_space_gave_it(served, tmp_path, monkeypatch):
    """The space's values make new parameters: each trial's pass the door before its job starts."""
    from types import SimpleNamespace

    from gpuflow.flows import trial
    from gpuflow.flows.calls import entered
    from gpuflow.flows.params import SweepParams

    monkeypatch.setenv("GPUFLOW_ALLOW_CODE", "pkgx")
    monkeypatch.setenv("GPUFLOW_ALLOW_PATHS", str(tmp_path))
    space = tmp_path / "space.yaml"
    space.write_text("model: {type: choice, values: ['pkgx.nets:Net', 'pkgy.nets:Net']}\n")
    params = entered(SweepParams, {"space": str(space), "optimize": "val_loss"})  # the sweep's own values pass
    launched = []
    monkeypatch.setattr(trial, "run_job", lambda launcher, where: launched.append(launcher.params.model) or
                        {"stopped": True})
    for choice in ("pkgy.nets:Net", "pkgx.nets:Net"):
        t = trial.Trial(trial=SimpleNamespace(number=0), slot=trial.Slot("cpu0", "cpu", 1), values={"model": choice})
        try:
            trial.run_trial(t, params, "parent", "val_loss", "study")
        except allow.NotAllowed as e:
            assert choice == "pkgy.nets:Net" and "package 'pkgy' is not allowed" in str(e)
    assert launched == ["pkgx.nets:Net"]
