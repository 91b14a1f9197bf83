"""What a registered model carries of its project (issue #58): the modules its import loads from the project's
folder travel with it, a package as a package; code that cannot travel is refused at registration in one line;
a forward returning `(logits, loss)` predicts its logits.

The project is nanoGPT-shaped and written here: a factory module `gptfactory.py` importing its sibling `model.py`,
which imports the package `blocks`; the model returns `(logits, loss)`. One real `gpuflow run` of one epoch on the
default digits registers it; the tests load it in a fresh process, elsewhere, with the project moved away.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import mlflow
import pytest

from tests.test_user_code import fresh_python, gpuflow, stored

MODEL = """
    import torch
    from torch import nn

    from blocks.head import Head


    class GPT(nn.Module):
        '''Returns (logits, loss) as nanoGPT's GPT does: the loss is None without targets.'''

        def __init__(self, num_classes=10, features=784):
            super().__init__()
            self.head = Head(features, num_classes)

        def forward(self, x, targets=None):
            logits = self.head(x.flatten(1))
            return logits, (None if targets is None else nn.functional.cross_entropy(logits, targets))
"""

FACTORY = """
    import math

    from torch import nn

    from model import GPT


    def make(num_classes, input_shape):
        return GPT(num_classes, math.prod(input_shape))


    def logits_loss(output, target):
        return nn.functional.cross_entropy(output[0], target)
"""

HEAD = """
    from torch import nn


    class Head(nn.Linear):
        pass
"""


def nano_project(proj: Path) -> Path:
    (proj / "blocks").mkdir(parents=True)
    (proj / "blocks" / "__init__.py").write_text("")
    (proj / "blocks" / "head.py").write_text(textwrap.dedent(HEAD))
    (proj / "model.py").write_text(textwrap.dedent(MODEL))
    (proj / "gptfactory.py").write_text(textwrap.dedent(FACTORY))
    return proj


@pytest.fixture(scope="module")
def api_url(prefect_api):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture(scope="module")
def nano(api_url, tmp_path_factory):
    """`--model gptfactory:make` trained one epoch from its project folder, registered as `nano` v1;
    (base folder, project, store, the run's console output)."""
    base = tmp_path_factory.mktemp("nano")
    proj = nano_project(base / "proj")
    store = base / "store"
    out = gpuflow(["run", "--model", "gptfactory:make", "--objective", "gptfactory:logits_loss", "--epochs", "1",
                   "--batch-size", "64", "--cpu-processes", "1", "--registered-model", "nano", *stored(store)],
                  proj, api_url)
    assert out.returncode == 0, out.stderr[-3000:]
    return base, proj, store, out.stdout + out.stderr


def test_a_factorys_sibling_modules_travel_with_it_and_predict_its_first_tensor_elsewhere(nano):
    base, proj, store, _ = nano
    uri = f"sqlite:///{store / 'mlflow.db'}"
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    shutil.move(proj, base / "moved")  # the code comes from the model itself
    try:
        out = fresh_python(f"""
            import sys
            import mlflow, numpy as np
            mlflow.set_tracking_uri({uri!r})
            model = mlflow.pyfunc.load_model("models:/nano/1")
            logits = model.predict(model.input_example)
            assert isinstance(logits, np.ndarray) and logits.dtype == np.float32, type(logits)
            assert logits.shape == (2, 10), logits.shape
            net = model.unwrap_python_model().model
            assert type(net).__name__ == "GPT" and sys.modules["model"].__file__.endswith("code/model.py")
            import torch
            with torch.no_grad():  # the logits, the first of forward's (logits, None)
                expected = net(torch.as_tensor(model.input_example))[0].numpy()
            np.testing.assert_allclose(logits, expected)
            print("predicted", logits.shape)
        """, cwd=elsewhere)
    finally:
        shutil.move(base / "moved", proj)
    assert out.returncode == 0 and "predicted (2, 10)" in out.stdout, out.stderr[-3000:]
    mlflow.set_tracking_uri(uri)
    code = Path(mlflow.artifacts.download_artifacts("models:/nano/1", dst_path=str(base / "download"))) / "code"
    assert sorted(p.name for p in code.iterdir()) == ["blocks", "gptfactory.py", "model.py"]  # package-shaped
    assert (code / "blocks" / "head.py").is_file()


def test_the_run_says_once_what_predict_returns_for_a_tuple_output(nano):
    log = nano[3]
    assert log.count("predict returns its first tensor alone (element 0, shape (N, 10)") == 1, log[-3000:]
    assert "the model returns a tuple" in log
    mlflow.set_tracking_uri(f"sqlite:///{nano[2] / 'mlflow.db'}")
    signature = mlflow.models.get_model_info("models:/nano/1").signature  # what predict returns: the logits
    assert [(s.type.name, s.shape) for s in signature.outputs.inputs] == [("float32", (-1, 10))]


def test_a_file_references_siblings_travel_too(tmp_path):
    from gpuflow.tasks.tracking.modelcode import model_code

    proj = nano_project(tmp_path / "proj")
    (tmp_path / "scratch").mkdir()
    reference, paths = model_code({"reference": f"{proj / 'gptfactory.py'}:make"}, str(tmp_path),
                                  tmp_path / "scratch")
    assert reference == "gptfactory:make"
    assert sorted(paths) == sorted(str(proj / p) for p in ("gptfactory.py", "model.py", "blocks"))


def test_code_from_outside_the_models_folder_is_refused_at_registration_before_anything_is_logged(tmp_path):
    import numpy as np

    from gpuflow.tasks.tracking import results, tracked
    from gpuflow.tasks.tracking.modelcode import UnshippableCode

    proj = nano_project(tmp_path / "proj")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "helper_outside.py").write_text("WIDTH = 64\n")
    (proj / "model.py").write_text(f"import sys\nsys.path.insert(0, {str(tmp_path / 'elsewhere')!r})\n"
                                   "import helper_outside\n" + textwrap.dedent(MODEL))
    (tmp_path / "weights.pt").write_bytes(b"")  # never read: refused before
    np.save(tmp_path / "example.npy", np.ones((2, 1, 28, 28), dtype=np.float32))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    kwargs = {"num_classes": 10, "input_shape": [1, 28, 28]}
    result = {"model_spec": {"reference": "gptfactory:make", "kwargs": kwargs},
              "weights": str(tmp_path / "weights.pt"), "input_example": str(tmp_path / "example.npy")}
    with pytest.raises(UnshippableCode) as refused, \
            tracked.tracked_run(uri, "outside", "nano", {}, None, tmp_path / "runs", system_metrics=False) as run:
        results.register_model(run, result, "nano", str(proj), "refused")
    message = str(refused.value)
    assert "\n" not in message and "'helper_outside'" in message and str(tmp_path / "elsewhere") in message, message
    assert "move that module into the folder" in message
    client = mlflow.MlflowClient(uri)
    assert client.search_registered_models() == []
    assert client.search_logged_models([run.experiment_id]) == []  # no logged model left PENDING or FAILED


def test_gpuflow_infer_reports_a_tuple_outputs_first_tensor_as_predict_does():
    import torch

    from gpuflow.training.evaluate import _on_cpu

    logits = torch.randn(3, 10, dtype=torch.float64)
    assert torch.equal(_on_cpu((logits, None), "x.npy"), logits.float())  # nanoGPT's (logits, None) without targets
    assert torch.equal(_on_cpu([None, logits], "x.npy"), logits.float())
