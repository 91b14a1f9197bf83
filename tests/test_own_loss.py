"""Models that compute their own loss when given labels (training/objective.py `pass_target_as`,
the built-in `model-loss`): a token classifier with dict batches, written here, trained by the
real worker, and the preflight's message when the labels were not passed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from gpuflow.training import TrainConfig
from gpuflow.training.errors import UserError
from gpuflow.training.preflight import check_user_code
from tests.helpers import result, run_worker

TOKENS = """
    import torch
    from torch import nn

    class TokenClassifier(nn.Module):
        '''A Hugging Face-shaped classifier: token ids and a mask in, {"loss", "logits"} out;
        the loss only when labels are given.'''

        def __init__(self, vocab=40, dim=8, num_labels=3):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.head = nn.Linear(dim, num_labels)

        def forward(self, input_ids, attention_mask, labels=None):
            mask = attention_mask.unsqueeze(-1).float()
            logits = self.head((self.emb(input_ids) * mask).sum(1) / mask.sum(1))
            loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
            return {"loss": loss, "logits": logits}

    def _samples(n, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, 40, (n, 6), generator=g)
        return [{"input_ids": ids[i], "attention_mask": torch.ones(6, dtype=torch.long),
                 "labels": int(ids[i, 0] % 3)} for i in range(n)]

    def datasets(root):
        return {"train": _samples(27, 0), "val": _samples(10, 1), "num_classes": 3}

    def read_loss(output, target):  # an objective that reads the model's own loss
        return output["loss"]

    class OwnLossWithAccuracy:
        pass_target_as = "labels"
        monitor, mode = "accuracy", "max"

        def loss(self, output, target):
            return output["loss"]

        def metrics(self, output, target):
            return {"accuracy": ((output["logits"].argmax(1) == target).sum(), len(target))}
"""


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "tokens.py").write_text(textwrap.dedent(TOKENS))
    return tmp_path


def config(project: Path, objective: str, **extra) -> dict:
    f = project / "tokens.py"
    return dict(model=f"{f}:TokenClassifier", dataset=f"{f}:datasets", objective=objective,
                code_root=str(project), data_root=str(project), **extra)


def test_an_objective_reading_the_models_own_loss_without_labels_is_told_how_to_pass_them(project):
    with pytest.raises(UserError) as e:
        check_user_code(TrainConfig(**config(project, f"{project / 'tokens.py'}:read_loss")))
    message = str(e.value)
    assert "returned None" in message and "without the target" in message, message
    assert "--objective model-loss" in message and "pass_target_as = 'labels'" in message, message


@pytest.mark.parametrize("objective", ["model-loss", "{f}:OwnLossWithAccuracy"])
def test_an_objective_that_passes_the_labels_passes_preflight(project, objective):
    out = check_user_code(TrainConfig(**config(project, objective.format(f=project / "tokens.py"))))
    assert out["num_classes"] == 3


def test_model_loss_refuses_a_model_that_returns_no_loss(project, tmp_path):
    f = project / "tokens.py"
    f.write_text(f.read_text().replace('return {"loss": loss, "logits": logits}', 'return {"logits": logits}'))
    with pytest.raises(UserError, match="its output has no `loss`"):
        check_user_code(TrainConfig(**config(project, "model-loss")))


def test_ddp_trains_on_the_models_own_loss_counted_exactly(project, tmp_path):
    """27 samples, batch 8 over 2 ranks: a rank's last batch holds a padding sample, which the
    model's own (batch-mean) loss must not count. With a vanishing learning rate the weights
    stay put, so the run's train and validation losses must be the model's own loss, given
    the labels, over each set's samples once."""
    cfg = config(project, "model-loss", epochs=1, batch_size=8, optimizer="sgd", momentum=0.0, lr=1e-12)
    run_worker(tmp_path / "ddp", nproc=2, **cfg)
    res = result(tmp_path / "ddp")
    assert res["monitor"] == "loss"

    import importlib.util

    spec = importlib.util.spec_from_file_location("tokens_check", project / "tokens.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.TokenClassifier()
    model.load_state_dict(torch.load(res["weights"], weights_only=True), strict=True)
    sets = mod.datasets(None)

    def own_loss(samples):
        batch = torch.utils.data.default_collate(samples)
        with torch.no_grad():
            return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])["loss"].item()

    epoch = res["history"][-1]
    assert epoch["val_loss"] == pytest.approx(own_loss(sets["val"]), rel=1e-5)
    assert epoch["train_loss"] == pytest.approx(own_loss(sets["train"]), rel=1e-5)
