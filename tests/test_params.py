"""Each parameter declared once (gpuflow/flows/params.py): the flows' signatures, the Prefect
form and the CLI all derive from the declaration, including JSON-object and list fields."""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys

import pytest
from pydantic import BaseModel, Field

from gpuflow.flows import cli, options
from gpuflow.flows.infer import evaluate_model
from gpuflow.flows.params import EvaluateParams, PipelineParams, RetrainParams
from gpuflow.flows.retrain import retrain
from gpuflow.flows.train import train_pipeline
from tests.helpers import ROOT


@pytest.mark.parametrize("flow,model", [(train_pipeline, PipelineParams), (retrain, RetrainParams),
                                        (evaluate_model, EvaluateParams)])
def test_flow_parameters_and_prefect_form_come_from_the_declaration(flow, model):
    sig = inspect.signature(flow.fn).parameters
    fields = model.model_fields
    assert list(sig) == list(fields)
    form = flow.parameters.properties
    for name, f in fields.items():
        assert sig[name].default == f.default and sig[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert form[name]["default"] == f.default, name
        assert f.description and form[name]["description"] == f.description, name
    if model is PipelineParams:
        assert form["min_free_mb"]["minimum"] == 0 and form["strategy"]["enum"] == ["auto", "single", "dp", "ddp"]
        assert "device" not in form and "checkpoint_dir" not in form  # set from the plan, not the user


def test_the_flow_validates_its_parameters_with_the_declaration(prefect_api):
    with pytest.raises(Exception, match="gpus='1,1' names GPU 1 twice"):
        train_pipeline(gpus="1,1")


def test_every_run_option_is_a_declared_field_with_its_default_in_help():
    out = subprocess.run([sys.executable, "-m", "gpuflow.flows", "run", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    for name in PipelineParams.model_fields:
        assert "--" + name.replace("_", "-") in out, name
    assert "(default: 3)" in out and "--no-skip-busy" in out


class UserScript(BaseModel):
    """Fields of the kind the next flows add: a JSON object, a list, arguments after `--`."""

    model_args: dict = Field({}, description="keyword arguments of the model, as JSON")
    tags: list[str] = Field([], description="a JSON list")
    epochs: int = Field(1, ge=1)
    script_args: list[str] = Field([], description="arguments after --", json_schema_extra={"cli": options.REST})


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="t")
    sub = top.add_subparsers(dest="command", required=True)
    options.add_model(sub.add_parser("x", argument_default=argparse.SUPPRESS), UserScript)
    return top


def test_cli_generator_takes_json_objects_lists_and_arguments_after_double_dash():
    command, model, values = cli.parse(
        ["x", "--model-args", '{"width": 512}', "--tags", '["a", "b"]', "--epochs", "2", "--",
         "--lr", "0.01", "--epochs", "5"], _parser())
    assert command == "x" and model is UserScript
    assert values == {"model_args": {"width": 512}, "tags": ["a", "b"], "epochs": 2,
                      "script_args": ["--lr", "0.01", "--epochs", "5"]}
    assert cli.parse(["x"], _parser())[2] == {}  # defaults stay with the declaration


@pytest.mark.parametrize("argv,message", [
    (["x", "--model-args", "{width: 512}"], "--model-args takes JSON"),
    (["x", "--model-args", "[1]"], "--model-args takes a JSON dict"),
    (["x", "--tags", '{"a": 1}'], "--tags takes a JSON list")])
def test_cli_generator_names_the_flag_of_bad_json(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(argv, _parser())
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_arguments_after_double_dash_are_refused_where_no_field_takes_them(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["run", "--epochs", "1", "--", "--lr", "1"])
    assert "`gpuflow run` takes no arguments after --" in capsys.readouterr().err


def test_bad_values_are_one_line_naming_the_value():
    with pytest.raises(Exception) as e:
        PipelineParams(epochs=0, gpus="two")
    line = cli.one_line(e.value)
    assert "\n" not in line and "epochs=0: Input should be greater than or equal to 1" in line
    assert "gpus='two': gpus='two' is not understood" in line


@pytest.mark.parametrize("argv", [["ui"], ["run", "--epochs", "1"]])
def test_gpuflow_imports_without_collection_then_collects_during_the_command(argv):
    """`gpuflow` (flows/__main__.py) pauses the cyclic collector for its imports only: a job
    or a long-lived service (serve, ui) runs with it on, the imports' objects frozen."""
    state = "print('collector', gc.isenabled(), gc.get_freeze_count() > 10**5)"
    code = ("import gc, sys\n"
            "from gpuflow.flows import __main__ as gpuflow, cli\n"
            f"cli.run_service = lambda command, settings: {state} or 0\n"
            f"cli.load = lambda command, model: lambda values: {state} or {{}}\n"
            f"sys.argv = ['gpuflow', *{argv!r}]\n"
            "sys.exit(gpuflow.entry())\n")
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # set, so no temporary API starts
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "collector True True" in out.stdout + out.stderr, out.stdout[-2000:]  # a job's prints go to stderr


def test_a_flow_takes_the_values_its_caller_validated_once_and_validates_any_other(monkeypatch):
    """The CLI validates before any server starts and hands the result on (calls.validated_once);
    the flow it calls takes it as it is. Once: a flow called inside that one validates its own."""
    from gpuflow.flows import calls
    from gpuflow.flows.params import ScriptParams

    seen = []
    real = calls.validated
    monkeypatch.setattr(calls, "validated", lambda model, values: seen.append(model) or real(model, values))
    checked = PipelineParams(epochs=2)
    with calls.validated_once(checked):
        assert calls.entered(PipelineParams, {"epochs": 2}) is checked
        nested = calls.entered(PipelineParams, {"epochs": 2})
    assert nested is not checked and nested.epochs == 2 and seen == [PipelineParams]
    with calls.validated_once(checked), pytest.raises(calls.InvalidParameters, match="script"):
        calls.entered(ScriptParams, {})  # another model: its own values, validated
    assert seen == [PipelineParams, ScriptParams]


def test_a_prefect_flow_run_receives_the_callers_validated_parameters(prefect_api, monkeypatch):
    """Through Prefect's flow engine (the CLI's path): the flow's function gets the very object."""
    from prefect import flow

    from gpuflow.flows import calls

    @flow(validate_parameters=False)
    @calls.flat_parameters(EvaluateParams)
    def probe_flow(params: EvaluateParams) -> bool:
        return params is checked

    checked = EvaluateParams(version=2)
    with calls.validated_once(checked):
        assert probe_flow(version=2) is True
    assert probe_flow(version=2) is False  # no caller's values: validated by the flow itself


def _marked(model) -> list[str]:
    from gpuflow.training.config import Exists

    return [name for name, f in model.model_fields.items() if any(isinstance(m, Exists) for m in f.metadata)]


def test_validation_reads_no_file_and_the_entry_check_names_each_missing_one(tmp_path, monkeypatch):
    """Parameters are pure: a path that is not (yet) there validates, made absolute; the door (`admit`: the CLI's
    check before any server, a flow's entry) then refuses it in one line naming the value as typed."""
    from gpuflow.flows.calls import InvalidParameters, admit, validated
    from gpuflow.flows.params import InferParams, ScriptParams, SweepParams

    monkeypatch.chdir(tmp_path)
    assert _marked(PipelineParams) == ["resume"] and _marked(ScriptParams) == ["script"]
    assert _marked(SweepParams) == ["resume", "script", "space"] and _marked(InferParams) == ["inputs", "checkpoint"]
    cases = [(PipelineParams, {"resume": "gone.pt"}, "resume='gone.pt': checkpoint '{tmp}/gone.pt' does not exist"),
             (ScriptParams, {"script": "train.py"}, "script='train.py': no such file ({tmp}/train.py)"),
             (ScriptParams, {"script": "code"}, "script='code': {tmp}/code is a directory; give the path of your "
                                               "training script in it, e.g. {tmp}/code/train.py"),
             (SweepParams, {"space": "s.yaml"}, "space='s.yaml': no such file ({tmp}/s.yaml); check the path"),
             (InferParams, {"inputs": "x" * 5000}, "inputs='" + "x" * 75)]
    (tmp_path / "code").mkdir()
    for model, values, says in cases:
        params = model(**values)  # no file is read
        field, = values
        assert getattr(params, field) == str(tmp_path.resolve() / values[field])
        checked = validated(model, values)  # pure: no file read
        with pytest.raises(InvalidParameters) as e:
            admit(checked, values)
        assert str(e.value).startswith(says.format(tmp=tmp_path.resolve())) and "\n" not in str(e.value)
    (tmp_path / "gone.pt").write_bytes(b"")
    assert admit(validated(PipelineParams, {"resume": "gone.pt"})).resume == str(tmp_path.resolve() / "gone.pt")
    assert admit(validated(PipelineParams, {"resume": "never"})).resume == "never"
