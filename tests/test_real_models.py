"""Registered models of real code (issue #25): a model class from an installed package, a
token classifier with named int64 inputs and a dict output, code that imports a third-party
package. What is checked is what a user of the registered model meets: where it loads, what
its signature and requirements say, and what `predict` and `gpuflow infer` take and return.

The token classifier is written here (transformers is not installed): token ids and a mask
in, a ModelOutput-like mapping with `logits` out, and an `import yaml` standing for a
third-party dependency. One real `gpuflow run` registers it; the tests read that version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from gpuflow.training.errors import UserError
from gpuflow.training.evaluate import load_inputs
from tests.test_user_code import fresh_python, gpuflow, run_json, stored

TOKENS = """
    import torch
    import yaml  # a third-party import: the registered model must require PyYAML
    from torch import nn

    SIZES = yaml.safe_load("vocab: 40\\ndim: 8")


    class Output(dict):
        '''Like transformers' ModelOutput: a mapping whose entries are also attributes.'''
        __getattr__ = dict.__getitem__


    class TokenClassifier(nn.Module):
        def __init__(self, num_classes=3):
            super().__init__()
            self.emb = nn.Embedding(SIZES["vocab"], SIZES["dim"])
            self.head = nn.Linear(SIZES["dim"], num_classes)

        def forward(self, input_ids, attention_mask):
            mask = attention_mask.unsqueeze(-1).float()
            return Output(logits=self.head((self.emb(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)))


    def _samples(n, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, 40, (n, 6), generator=g)
        return [{"input_ids": ids[i], "attention_mask": torch.ones(6, dtype=torch.long),
                 "labels": int(ids[i, 0] % 3)} for i in range(n)]


    def datasets(root):
        return {"train": _samples(32, 0), "val": _samples(8, 1), "num_classes": 3}
"""


def token_batch(n: int = 5) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 40, (n, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(n, 6, dtype=torch.long)
    mask[:, 4:] = 0  # padded tail
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def api_url(prefect_api):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture(scope="module")
def tokens(api_url, tmp_path_factory):
    """The token classifier trained one epoch by `gpuflow run` from its project folder and
    registered as `tokens` v1; (base folder, project, store, run report)."""
    base = tmp_path_factory.mktemp("tokens")
    proj = base / "proj"
    (proj / "tokproj").mkdir(parents=True)
    (proj / "tokproj" / "__init__.py").write_text("")
    (proj / "tokproj" / "model.py").write_text(textwrap.dedent(TOKENS))
    (proj / "requirements.txt").write_text("tokenizers>=0.19  # declared by the project, not installed here\n")
    store = base / "store"
    report = run_json(["run", "--model", "tokproj.model:TokenClassifier", "--dataset", "tokproj.model:datasets",
                       "--epochs", "1", "--batch-size", "8", "--cpu-processes", "1", "--registered-model", "tokens",
                       *stored(store)], proj, api_url)
    assert report["status"] == "FINISHED", report
    return base, proj, store, report


@pytest.fixture
def store_of(tokens):
    """The token run's store as this test's tracking URI (another test may have set its own)."""
    mlflow.set_tracking_uri(f"sqlite:///{tokens[2] / 'mlflow.db'}")
    return tokens


def test_a_dict_output_is_in_the_signature_and_named_int64_inputs_keep_their_dtype(store_of):
    signature = mlflow.models.get_model_info("models:/tokens/1").signature
    assert {s.name: (s.type, s.shape) for s in signature.inputs.inputs} == {  # token ids: any length
        "input_ids": (np.dtype("int64"), (-1, -1)), "attention_mask": (np.dtype("int64"), (-1, -1))}
    assert [(s.name, s.type, s.shape) for s in signature.outputs.inputs] == [("logits", np.dtype("float32"), (-1, 3))]


def test_the_requirements_hold_the_codes_third_party_imports_and_the_projects_declared_ones(store_of):
    from importlib.metadata import version

    reqs = Path(mlflow.pyfunc.get_model_dependencies("models:/tokens/1")).read_text().splitlines()
    assert f"PyYAML=={version('PyYAML')}" in reqs, reqs  # found in the shipped code's imports
    assert "tokenizers>=0.19" in reqs, reqs  # the project's requirements.txt, as written
    assert {r.split("==")[0] for r in reqs} >= {"torch", "torchvision", "mlflow", "numpy"}


def test_predict_takes_named_int64_inputs_and_returns_a_dict_in_a_process_without_gpuflow(store_of):
    base, _, store, _ = store_of
    batch = {k: v.numpy() for k, v in token_batch().items()}
    np.savez(base / "batch.npz", **batch)
    out = fresh_python(f"""
        import mlflow, numpy as np
        mlflow.set_tracking_uri({f"sqlite:///{store / 'mlflow.db'}"!r})
        model = mlflow.pyfunc.load_model("models:/tokens/1")
        batch = dict(np.load({str(base / "batch.npz")!r}))
        out = model.predict(batch)
        assert sorted(out) == ["logits"] and out["logits"].dtype == np.float32, out
        assert out["logits"].shape == (5, 3), out["logits"].shape
        assert model.predict(model.input_example)["logits"].shape == (2, 3)
        longer = {{k: np.concatenate([v, v[:, :3]], axis=1) for k, v in batch.items()}}  # another length
        assert model.predict(longer)["logits"].shape == (5, 3)
        np.save({str(base / "logits.npy")!r}, out["logits"])
        print("predicted")
    """, cwd=base)
    assert out.returncode == 0 and "predicted" in out.stdout, out.stderr[-3000:]
    model = mlflow.pyfunc.load_model("models:/tokens/1").unwrap_python_model().model
    with torch.no_grad():  # the same module called directly: the same logits
        expected = model(**token_batch())["logits"].numpy()
    np.testing.assert_allclose(np.load(base / "logits.npy"), expected, rtol=1e-5, atol=1e-6)


def test_gpuflow_infer_takes_a_file_of_named_int64_inputs(store_of, api_url):
    base, proj, store, _ = store_of
    torch.save({"inputs": token_batch()}, base / "tokens.pt")
    out = run_json(["infer", "--registered-model", "tokens", "--version", "1", "--inputs", str(base / "tokens.pt"),
                    "--tracking-uri", f"sqlite:///{store / 'mlflow.db'}", "--gpus", "cpu"], proj, api_url)
    model = mlflow.pyfunc.load_model("models:/tokens/1")
    logits = model.predict({k: v.numpy() for k, v in token_batch().items()})["logits"]
    assert out["samples"] == 5 and out["predictions"] == logits.argmax(1).tolist(), out
    assert np.allclose(np.array(out["probabilities"]).sum(1), 1.0)


# --- a model class from an installed package: no code of its own ----------------------------


MLP_KWARGS = {"in_channels": 4, "hidden_channels": [8, 3]}


@pytest.fixture(scope="module")
def torchvision_mlp(tmp_path_factory):
    """torchvision.ops:MLP registered as `mlp` v1 the way the flow registers (results.register_model)."""
    import torchvision

    from gpuflow.tasks.tracking import results, tracked

    base = tmp_path_factory.mktemp("installed")
    uri = f"sqlite:///{base / 'mlflow.db'}"
    torch.save(torchvision.ops.MLP(**MLP_KWARGS).state_dict(), base / "weights.pt")
    np.save(base / "example.npy", np.ones((2, 4), dtype=np.float32))
    result = {"model_spec": {"reference": "torchvision.ops:MLP", "kwargs": MLP_KWARGS},
              "weights": str(base / "weights.pt"), "input_example": str(base / "example.npy"),
              "output_spec": [{"name": None, "dtype": "float32", "shape": [3]}]}
    with tracked.tracked_run(uri, "installed", "mlp", {}, None, base / "runs", system_metrics=False) as run:
        assert results.register_model(run, result, "mlp", str(base), "torchvision's MLP") == "1"
    return base, uri


def test_a_model_from_an_installed_package_loads_in_a_process_that_imported_that_package(torchvision_mlp):
    base, uri = torchvision_mlp
    out = fresh_python(f"""
        import torchvision  # imported before the model loads: its own code is this very package
        import mlflow
        mlflow.set_tracking_uri({uri!r})
        model = mlflow.pyfunc.load_model("models:/mlp/1")
        assert type(model.unwrap_python_model().model) is torchvision.ops.MLP
        print(model.predict(model.input_example).shape)
    """, cwd=base)
    assert out.returncode == 0 and "(2, 3)" in out.stdout, out.stderr[-3000:]
    mlflow.set_tracking_uri(uri)
    info = mlflow.models.get_model_info("models:/mlp/1")
    assert info.flavors["python_function"].get("code") is None  # nothing shipped: the package is a requirement
    lines = Path(mlflow.pyfunc.get_model_dependencies("models:/mlp/1")).read_text().splitlines()
    assert any(ln.startswith("torchvision==") for ln in lines), lines


def test_only_code_the_model_ships_is_checked_against_what_the_process_imported(tmp_path):
    """The loader's import: an installed package (nothing under code/) loads whatever was
    imported; a shipped package of the same name as an imported, different one is refused."""
    import torchvision

    assert "tests" in sys.modules  # this process imported the repository's `tests` package

    from gpuflow.tasks.tracking.registered_model import _import

    code = tmp_path / "code"
    code.mkdir()
    assert _import("torchvision.ops:MLP", code) is torchvision.ops.MLP
    (code / "tests").mkdir()
    (code / "tests" / "__init__.py").write_text("class Net: pass\n")
    with pytest.raises(ImportError, match=r"already imported another 'tests' from"):
        _import("tests:Net", code)


# --- requirements found without importing the code ------------------------------------------


def test_requirements_are_the_codes_imports_and_the_projects_declared_dependencies(tmp_path, tmp_path_factory):
    from importlib.metadata import version

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(textwrap.dedent("""
        import os, json                      # standard library: not listed
        import yaml                          # PyYAML, pinned to the installed version
        from torch import nn                 # already required by the loader
        from . import nets                   # the package itself
        import pkg.nets
        try:
            import not_installed_xyz         # provided by no installed distribution: not listed
        except ImportError:
            pass
    """))
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "pkg"\ndependencies = ["rich>=13"]\n')
    (tmp_path / "requirements.txt").write_text("tokenizers>=0.19  # a comment\n-r dev.txt\nnumpy<3\n./vendored\n")
    builtin = tmp_path_factory.mktemp("flow-tmp") / "gpuflow_builtin_models.py"  # shipped from outside the project
    builtin.write_text("import torch\n")
    code = f"""
        import json, sys
        from gpuflow.tasks.tracking.requirements import model_requirements
        reqs = model_requirements("pkg.nets:Net", [{str(tmp_path / "pkg")!r}], {str(tmp_path)!r})
        print(json.dumps([reqs, "torch" in sys.modules,
                          model_requirements("gpuflow_builtin_models:MLP", [{str(builtin)!r}], {str(tmp_path)!r})]))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    reqs, imported_torch, builtin = json.loads(out.stdout)
    pin = (lambda d: f"{d}=={version(d).split('+')[0]}")
    assert reqs == [pin("torch"), pin("torchvision"), pin("mlflow"), "numpy<3", pin("PyYAML"), "rich>=13",
                    "tokenizers>=0.19"]
    assert not imported_torch  # the flow stays torch-free
    assert builtin == [pin(d) for d in ("torch", "torchvision", "mlflow", "numpy")]  # not the folder's project


# --- inputs files --------------------------------------------------------------------------


def test_inputs_files_keep_dtypes_and_names_in_pt_npy_and_npz(tmp_path):
    batch = token_batch(3)
    torch.save({"inputs": batch}, tmp_path / "named.pt")
    np.savez(tmp_path / "named.npz", **{k: v.numpy() for k, v in batch.items()})
    np.save(tmp_path / "one.npy", np.zeros((3, 4), dtype=np.int32))
    for f in ("named.pt", "named.npz"):
        x = load_inputs(str(tmp_path / f))
        assert {k: v.dtype for k, v in x.items()} == {"input_ids": torch.int64, "attention_mask": torch.int64}
        assert torch.equal(x["input_ids"], batch["input_ids"])
    assert load_inputs(str(tmp_path / "one.npy")).dtype == torch.int32
    torch.save({"inputs": {"input_ids": torch.zeros(3, 6), "attention_mask": torch.zeros(2, 6)}}, tmp_path / "bad.pt")
    with pytest.raises(UserError, match=r"different sample counts \{'input_ids': 3, 'attention_mask': 2\}"):
        load_inputs(str(tmp_path / "bad.pt"))
