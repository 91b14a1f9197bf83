"""Scheduled retraining: train a challenger, compare it with the champion, promote if better.

Both models are evaluated by the same child process code, on the same held-out split, on a
device picked by the same assignment. The `champion` alias moves only when the challenger
is strictly better (the first run promotes); a failed step moves nothing.
"""

from __future__ import annotations

from typing import Literal

import mlflow
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from tasks.registry import champion_version, evaluate_version, promote
from tasks.mlrun import default_tracking_uri, prepare_store

from .infer import assign_one_device
from .train import train_pipeline


def is_better(challenger: dict, champion: dict | None, metric: str) -> bool:
    if champion is None:
        return True
    if metric == "loss":
        return challenger["loss"] < champion["loss"]
    return challenger["accuracy"] > champion["accuracy"]


@flow(name="retrain", flow_run_name="retrain-{model}-{dataset}")
def retrain(model: str = "mlp", dataset: str = "digits", epochs: int = 3, batch_size: int = 64,
            lr: float = 1e-3, seed: int = 42, gpus: str = "auto", strategy: str = "auto",
            eval_gpus: str = "auto", metric: Literal["accuracy", "loss"] = "accuracy",
            registered_model: str = "gpuflow-model", experiment: str = "gpuflow",
            tracking_uri: str | None = None, runs_dir: str = "runs") -> dict:
    """Train a challenger with the pipeline and move `champion` to it only if it is better."""
    log = get_run_logger()
    trained = train_pipeline(model=model, dataset=dataset, epochs=epochs, batch_size=batch_size,
                             lr=lr, seed=seed, gpus=gpus, strategy=strategy,
                             registered_model=registered_model, experiment=experiment,
                             tracking_uri=tracking_uri, runs_dir=runs_dir)
    prepare_store(tracking_uri or default_tracking_uri())
    challenger_v = str(trained["model_version"])
    champion_v = champion_version(registered_model)
    plan = assign_one_device(eval_gpus)
    # Held-out data: the challenger's validation split, for both models.
    challenger = evaluate_version(registered_model, challenger_v, plan, dataset=dataset)
    champion = (evaluate_version(registered_model, champion_v, plan, dataset=dataset)
                if champion_v and champion_v != challenger_v else None)
    promoted = is_better(challenger, champion, metric)
    if promoted:
        promote(registered_model, challenger_v)
    decision = {
        "retrain.decision": "promoted" if promoted else "kept champion",
        "retrain.metric": metric,
        "retrain.challenger_version": challenger_v,
        "retrain.challenger_score": f"{challenger[metric]:.6f}",
        "retrain.champion_version": champion_v or "none",
        "retrain.champion_score": f"{champion[metric]:.6f}" if champion else "none",
    }
    client = mlflow.MlflowClient()
    for k, v in decision.items():
        client.set_tag(trained["run_id"], k, v)
    create_markdown_artifact(key="retrain-decision", markdown=(
        f"# Retrain: {decision['retrain.decision']}\n\n| | version | {metric} |\n|---|---|---|\n"
        f"| challenger | {challenger_v} | {decision['retrain.challenger_score']} |\n"
        f"| champion before | {decision['retrain.champion_version']} | {decision['retrain.champion_score']} |\n"))
    log.info("retrain: %s", decision)
    return {"run_id": trained["run_id"], "promoted": promoted, **decision}
