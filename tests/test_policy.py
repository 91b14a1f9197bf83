"""The served door as an attacker meets it through stores and what comes back from them
(training/policy.py, flows/allow.py): tracking URIs, study storages parsed as SQLite opens them,
a checkpoint's config, and a package's __main__. The end-to-end attacks through a real
`gpuflow serve` are in tests/test_served.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpuflow.flows import allow
from gpuflow.flows.calls import admit, entered, validated
from gpuflow.flows.params import EvaluateParams, PipelineParams, SweepParams
from gpuflow.flows.settings import Settings
from gpuflow.training.errors import UserError
from gpuflow.training.policy import POLICY_FILE_ENV, NotAllowed, Policy, sqlite_file


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A served run's context: serve's folder is tmp_path/serve, its store mlflow.db there."""
    home = tmp_path / "serve"
    (home / "pkgy").mkdir(parents=True)
    (home / "pkgy" / "__init__.py").write_text("")
    (home / "pkgy" / "nets.py").write_text("import torch\nclass Net(torch.nn.Linear):\n    pass\n")
    (home / "pkgy" / "__main__.py").write_text(f"open({str(tmp_path / 'main-ran')!r}, 'w').write('ran')\n"
                                               "from .nets import Net\n")
    monkeypatch.chdir(home)
    monkeypatch.syspath_prepend(str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv(POLICY_FILE_ENV, raising=False)
    monkeypatch.setattr(allow.deployment, "get_id", lambda: "a-deployment-id")
    yield Settings(allow_code="pkgy", allow_paths=str(home))
    for name in [m for m in sys.modules if m == "pkgy" or m.startswith("pkgy.")]:
        del sys.modules[name]


OUTSIDE_STORES = ["sqlite:////tmp/elsewhere/x.db", "http://127.0.0.1:1", "https://attacker.example/mlflow",
                  "postgresql://attacker@10.0.0.1/mlflow", "sqlite:///../outside.db",
                  "sqlite:///file:/tmp/elsewhere/x.db?uri=true"]


@pytest.mark.parametrize("uri", OUTSIDE_STORES)
def test_a_served_run_cannot_point_its_tracking_store_elsewhere(served, uri):
    with pytest.raises(allow.NotAllowed, match="tracking_uri=.*records to the operator's tracking store"):
        allow.check_allowed({"tracking_uri": uri}, served)
    assert not Path("/tmp/elsewhere").exists()


def test_a_served_run_keeps_the_operators_store_or_one_it_allowed_by_name(served):
    allow.check_allowed({"tracking_uri": f"sqlite:///{Path.cwd() / 'mlflow.db'}"}, served)
    allow.check_allowed({"tracking_uri": "sqlite:///mlflow.db"}, served)  # the same file, relative
    allow.check_allowed({"tracking_uri": None}, served)  # unset: the operator's
    named = Settings(allow_code="pkgy", allow_paths=str(Path.cwd()), allow_stores="http://10.0.0.5:5000")
    allow.check_allowed({"tracking_uri": "http://10.0.0.5:5000/"}, named)
    with pytest.raises(allow.NotAllowed):
        allow.check_allowed({"tracking_uri": "http://10.0.0.5:5001"}, named)


@pytest.mark.parametrize("storage, why", [
    ("sqlite:///file:/tmp/elsewhere/optuna.db?uri=true", "is outside the folders"),  # SQLite opens it as a URI
    ("sqlite:///file:%2Ftmp%2Felsewhere%2Foptuna.db?uri=true", "is outside the folders"),
    ("sqlite:///sub/../../outside.db", "is outside the folders"),
    ("sqlite:///mlflow.db", "is the tracking store's own file"),
    ("sqlite:///file:mlflow.db?uri=true&mode=rwc", "is the tracking store's own file"),
    ("postgresql+psycopg://attacker@10.0.0.1/db", "keeps its study in a SQLite file"),
    ("sqlite://", "keeps its study in a SQLite file"),
])
def test_a_served_study_storage_is_judged_by_the_file_sqlite_would_open(served, storage, why):
    with pytest.raises(UserError, match=why):
        allow.check_allowed({"storage": storage}, served)


def test_sqlite_urls_resolve_to_the_file_sqlite_opens(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sqlite_file("sqlite:///file:/a/b.db?uri=true&mode=ro") == Path("/a/b.db")
    assert sqlite_file("sqlite:///file:a%20b.db?uri=true") == tmp_path / "a b.db"
    assert sqlite_file("sqlite:////x/../y.db") == Path("/y.db")
    assert sqlite_file("sqlite:///:memory:") is None and sqlite_file("postgresql://h/db") is None
    assert sqlite_file("sqlite:///file:m?mode=memory&uri=true") is None


def test_a_local_sweep_never_keeps_its_study_in_the_tracking_stores_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "s.yaml"
    space.write_text("lr: {type: float, low: 0.001, high: 0.1}\n")
    with pytest.raises(UserError, match="tracking store's own file"):  # what the file is: checked at the door
        admit(validated(SweepParams, dict(space=str(space), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                          storage=f"sqlite:///file:{tmp_path / 'mlflow.db'}?uri=true")))
    admit(validated(SweepParams, dict(space=str(space), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                      storage=f"sqlite:///{tmp_path / 'optuna.db'}")))


def test_a_served_sweep_is_refused_at_the_door_before_its_space_file_is_read(served, tmp_path):
    secret = tmp_path / "secret.yaml"
    secret.write_text("password: hunter2\n")
    with pytest.raises(allow.NotAllowed, match="space=.*is outside the folders") as refused:
        entered(SweepParams, {"space": str(secret)})
    assert "hunter2" not in str(refused.value)


def test_a_reference_to_a_packages_main_is_refused_before_it_is_imported(served, tmp_path):
    with pytest.raises(allow.NotAllowed, match="__main__, which runs when imported"):
        allow.check_allowed(PipelineParams(model="pkgy.__main__:Net"), served)
    assert not (tmp_path / "main-ran").exists()
    allow.check_allowed(PipelineParams(model="pkgy.nets:Net"), served)


BAD_CONFIGS = {  # what a checkpoint's config says: what the refusal says
    "model os:system": ({"model": "os:system", "model_args": {"command": "id"}}, "package 'os' is not allowed"),
    "objective": ({"objective": "subprocess:getoutput"}, "package 'subprocess' is not allowed"),
    "dataset": ({"dataset": "pkgy.nets:torch"}, "'torch' is a module"),
    "code_root": ({"model": "pkgy.nets:Net", "code_root": "/tmp"}, "code_root='/tmp' is outside"),
    "data_root": ({"data_root": "/etc"}, "data_root='/etc' is outside"),
    "imagefolder": ({"dataset": "imagefolder:/etc"}, "is outside"),
    "script spec": ({"reference": "builtins:exec"}, "package 'builtins' is not allowed"),
    "not a dict": ("os:system", "holds no config"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_what_a_checkpoint_names_passes_the_same_door_as_a_parameter(served, case):
    config, message = BAD_CONFIGS[case]
    policy = allow.current_policy(served)
    with pytest.raises(allow.NotAllowed, match=message):
        policy.check_config(config, "checkpoint epoch-0001.pt")
    policy.check_config({"model": "pkgy.nets:Net", "code_root": str(Path.cwd()), "data_root": "data",
                         "dataset": "digits"}, "checkpoint epoch-0001.pt")


def test_the_evaluation_child_refuses_a_checkpoint_naming_code_outside_the_policy(served, tmp_path):
    """The child itself applies the policy it was handed, before the config's model is built."""
    marker = tmp_path / "pwned"
    ck = Path.cwd() / "evil.pt"
    torch.save({"model": {}, "config": {"model": "os:system", "model_args": {"command": f"touch {marker}"},
                                        "dataset": "digits"}, "num_classes": 10}, ck)
    policy = allow.current_policy(served)
    env = {**__import__("os").environ, POLICY_FILE_ENV: str(policy.write_private())}
    result = tmp_path / "result.json"
    out = subprocess.run([sys.executable, "-m", "gpuflow.training.evaluate", "--checkpoint", str(ck), "--result",
                          str(result), "--device", "cpu"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "package 'os' is not allowed" in result.read_text()
    assert not marker.exists()


def test_the_policy_travels_to_children_whole(monkeypatch):
    p = Policy(frozenset({"a", "b"}), (Path("/x"), Path("/y")), "sqlite:////x/mlflow.db", ("http://h:5000",))
    path = p.write_private()
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        monkeypatch.setenv(POLICY_FILE_ENV, str(path))
        assert Policy.from_env() == p
    finally:
        path.unlink()


def test_a_policy_in_the_environment_itself_is_never_taken(monkeypatch):
    """A caller who could set a run's environment widens nothing with the policy's JSON (the old GPUFLOW_POLICY)."""
    monkeypatch.delenv(POLICY_FILE_ENV, raising=False)
    monkeypatch.setenv("GPUFLOW_POLICY", Policy(frozenset(), (Path("/"),)).to_json())
    assert Policy.from_env() is None


def test_a_policy_file_another_account_may_change_or_a_link_is_refused(tmp_path, monkeypatch):
    p = Policy(frozenset(), (tmp_path,))
    path = p.write_private()
    try:
        path.chmod(0o666)
        monkeypatch.setenv(POLICY_FILE_ENV, str(path))
        with pytest.raises(NotAllowed, match="not a file of this account that only it may change"):
            Policy.from_env()
        path.chmod(0o600)
        (tmp_path / "link.json").symlink_to(path)
        monkeypatch.setenv(POLICY_FILE_ENV, str(tmp_path / "link.json"))
        with pytest.raises(NotAllowed, match="GPUFLOW_POLICY_FILE="):
            Policy.from_env()
        os.chown(path, 65534, 65534)  # another account's (we run as root in CI; skipped otherwise)
        monkeypatch.setenv(POLICY_FILE_ENV, str(path))
        with pytest.raises(NotAllowed, match="owner uid 65534"):
            Policy.from_env()
    except PermissionError:
        pytest.skip("giving a file to another account needs root")
    finally:
        path.unlink()


def test_a_local_run_passes_the_door_untouched(tmp_path, monkeypatch):
    monkeypatch.setattr(allow.deployment, "get_id", lambda: None)
    allow.check_allowed({"tracking_uri": "http://anywhere:5000", "storage": "postgresql://h/db",
                         "model": "torchvision.models:resnet18"})
    allow.check_allowed(EvaluateParams(tracking_uri="sqlite:////tmp/anywhere.db"))


# --- found by a review of the door as an attacker -------------------------------------------------


def test_a_served_script_is_never_installed_code_even_inside_the_allowed_folder(served):
    import torch.distributed.run as torchrun

    everywhere = Settings(allow_code="pkgy", allow_paths="/")
    with pytest.raises(allow.NotAllowed, match="script=.*is a file of installed Python code"):
        allow.check_allowed({"script": torchrun.__file__}, everywhere)


@pytest.mark.parametrize("uri", ["sqlite:///{home}/../../tmp/elsewhere/evil.db?uri=true",
                                 "sqlite:///file:{home}/x.db?uri=true", "sqlite:///{home}/x.db?mode=ro",
                                 "sqlite:///file:mlflow.db", "sqlite:///{home}/mlflow.db?uri=true&x=1"])
def test_a_served_tracking_store_in_the_folders_is_a_plain_sqlite_path(served, uri):
    with pytest.raises(allow.NotAllowed, match="records to the operator's tracking store"):
        allow.check_allowed({"tracking_uri": uri.format(home=Path.cwd())}, served)
    allow.check_allowed({"tracking_uri": f"sqlite:///{Path.cwd() / 'other.db'}"}, served)


def test_sqlite_paths_are_judged_as_the_kernel_opens_them(tmp_path, monkeypatch):
    (tmp_path / "runs" / "2024" / "x").mkdir(parents=True)
    (tmp_path / "latest").symlink_to(tmp_path / "runs" / "2024" / "x")
    monkeypatch.chdir(tmp_path)
    # SQLAlchemy opens abspath(name): '..' collapses before the link is followed
    assert sqlite_file(f"sqlite:///{tmp_path}/latest/../evil.db") == tmp_path / "evil.db"
    # a file: URI goes to the kernel as it is: the link first, then '..'
    assert sqlite_file(f"sqlite:///file:{tmp_path}/latest/../evil.db?uri=true") == tmp_path / "runs" / "2024" / "evil.db"
    assert sqlite_file("sqlite:///~/x.db") == tmp_path / "~" / "x.db"  # SQLite expands no '~'


@pytest.mark.parametrize("values", [{"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "attacker:29500"},
                                    {"rdzv_endpoint": "0.0.0.0:29500"}])
def test_a_served_run_joins_no_rendezvous_its_caller_names(served, values):
    with pytest.raises(allow.NotAllowed, match="joins no rendezvous its caller names"):
        allow.check_allowed(values, served)


@pytest.mark.parametrize("values, says", [({"model": 5}, "expected text"), ({"collect": 5}, "expected text"),
                                          ({"runs_dir": ""}, "is outside"), ({"space": "auto"}, "space=.auto. is outside")])
def test_odd_values_get_a_refusal_not_a_traceback(served, tmp_path, values, says):
    narrow = Settings(allow_code="pkgy", allow_paths=str(tmp_path / "data"))  # serve's own folder not among them
    (tmp_path / "data").mkdir()
    with pytest.raises(allow.NotAllowed, match=says):
        allow.check_allowed(values, narrow)


def test_a_node_job_names_no_path_and_no_foreign_run():
    from pydantic import ValidationError

    from gpuflow.flows.nodes import NodeJob

    NodeJob(id="3f2b-77", index=1, name="gpu-box.lab", run_id="0" * 32)
    for bad in ({"name": "/../../../../tmp/t"}, {"id": "../x"}, {"run_id": "x' or '1'='1"}, {"index": -1}):
        with pytest.raises(ValidationError):
            NodeJob(**{"id": "j", "index": 0, "name": "a", "run_id": "0" * 32, **bad})


def test_a_crash_hook_never_opens_a_store_the_caller_named(served, monkeypatch):
    from gpuflow.tasks.tracking.orphans import hooked_store

    policy = allow.current_policy(served)
    monkeypatch.setenv(POLICY_FILE_ENV, str(policy.write_private()))
    assert hooked_store("http://attacker.example:5000") == policy.home_store
    assert hooked_store(None) == policy.home_store
    assert hooked_store(policy.home_store) == policy.home_store


def test_a_file_reference_imports_the_file_the_door_checked(served, tmp_path, monkeypatch):
    """'~' means the home folder to the door, so the import reads that file too, never ./~/ in the working folder."""
    home = Path.cwd() / "home"
    home.mkdir()
    (home / "nets_home.py").write_text("def make():\n    pass\n")
    (Path.cwd() / "~").mkdir()
    (Path.cwd() / "~" / "nets_home.py").write_text(f"open({str(tmp_path / 'unchecked-ran')!r}, 'w')\n"
                                                  "def make():\n    pass\n")
    monkeypatch.setenv("HOME", str(home))
    policy = allow.current_policy(served)
    allow.check_allowed({"dataset": "~/nets_home.py:make"}, served)
    policy.check_config({"model": "~/nets_home.py:make"}, "checkpoint epoch-0001.pt")
    assert not (tmp_path / "unchecked-ran").exists()


@pytest.mark.parametrize("url", ["sqlite:///plain.db", "sqlite:///sub/../up.db", "sqlite:///file:literal.db",
                                 "sqlite:///file:uri.db?uri=true", "sqlite:///file:ro.db?uri=true&mode=rwc",
                                 "sqlite:///named.db?uri=true&x=1", "sqlite:///file:a%20b.db?uri=true",
                                 "sqlite:///kept.db?uri=true&timeout=5"])
def test_sqlite_file_names_the_file_sqlite_creates_for_the_url(tmp_path, monkeypatch, url):
    """Judged against SQLAlchemy and SQLite themselves: the file that appears is the one named."""
    import sqlalchemy

    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    engine = sqlalchemy.create_engine(url)
    with engine.connect() as c:
        c.exec_driver_sql("create table t (x int)")
    engine.dispose()
    created = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert created == [sqlite_file(url)]


def test_a_run_id_read_back_from_a_study_is_used_only_if_it_is_that_sweeps_run(tmp_path):
    """Whoever can write a study can write its attributes: the best trial's run must be that trial's, in this store."""
    import mlflow
    import optuna

    from gpuflow.flows.space import SweepError
    from gpuflow.flows.study import summarize, sweep_run
    from gpuflow.tasks.tracking import tracked

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("e")
    mine = client.create_run(exp, tags={"sweep.study": "s", "sweep.trial": "0"}).info.run_id
    other = client.create_run(exp, tags={"sweep.study": "someone-else", "sweep.trial": "0"}).info.run_id
    parent_id = client.create_run(exp, tags={"sweep.study": "s"}).info.run_id
    gone = client.create_run(exp, tags={"sweep.study": "s", "sweep.trial": "0"}).info.run_id
    client.delete_run(gone)
    assert sweep_run(client, mine, "s", 0) and sweep_run(client, parent_id, "s")
    for run_id, trial in ((mine, 1), (mine, None), (other, 0), (gone, 0), ("0" * 32, 0), ("../../etc", 0),
                          ({"a": 1}, 0), (None, None), (parent_id, 0)):
        assert not sweep_run(client, run_id, "s", trial), (run_id, trial)
    study = optuna.create_study(study_name="s", direction="maximize")
    trial = study.ask()
    trial.set_user_attr("mlflow_run_id", other)  # a forged attribute
    study.tell(trial, 0.5)
    parent = tracked.TrackedRun(client, client.create_run(exp).info.run_id, exp, tmp_path)
    with pytest.raises(SweepError, match=f"best trial 0 names MLflow run '{other}', which is not that trial's run"):
        summarize(study, parent, "val_accuracy")
    good = optuna.create_study(study_name="s", direction="maximize")
    t = good.ask()
    t.set_user_attr("mlflow_run_id", mine)
    good.tell(t, 0.5)
    assert summarize(good, parent, "val_accuracy")["best_run_id"] == mine
