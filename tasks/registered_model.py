"""The registered model, as MLflow loads it: a pyfunc "model from code".

MLflow copies this file into the model and runs it on load: it rebuilds gpuflow's model class
from the names recorded with the model and loads the logged checkpoint's weights with
weights_only=True, so nothing is unpickled. What to build comes from the checkpoint itself. `mlflow.pyfunc.load_model(uri).predict(x)` takes
a float32 array (N, C, H, W) and returns the class scores (N, classes);
`.unwrap_python_model().model` is the plain `nn.Module`.
"""

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel


class CheckpointModel(PythonModel):
    def load_context(self, context):
        from gpuflow.training.checkpoint import load_file, load_model_state
        from gpuflow.training.models import build_model

        ck = load_file(context.artifacts["checkpoint"])
        self.model = build_model(ck["config"]["model"], int(ck["num_classes"]), tuple(ck["input_shape"]))
        load_model_state(self.model, ck["model"])
        self.model.eval()

    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.model(torch.as_tensor(np.asarray(model_input, dtype=np.float32))).numpy()


mlflow.models.set_model(CheckpointModel())
