"""Scheduled retraining: train a challenger, compare it with the champion, promote if better.

Both models are evaluated by the same child process code, on the same held-out split, on a
device picked by the same assignment. The `champion` alias moves only when the challenger
is strictly better (the first run promotes); a failed step moves nothing.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from gpuflow.tasks.tracking import store
from gpuflow.tasks.devices.assign import one_device_plan
from gpuflow.tasks.devices.cards import card_locks
from gpuflow.tasks.devices.slot import device_slot
from gpuflow.tasks.devices.probe import probe_environment
from gpuflow.tasks.tracking.registry import champion_version, evaluate_version, promote
from gpuflow.tasks.tracking.results import OUTCOME_TAG
from gpuflow.training.errors import UserError

from .params import RetrainParams, flat_parameters
from .train import train_pipeline


def compared(metric: str, evaluation: dict) -> tuple[str, str]:
    """(the metric compared, "min" or "max"): `auto` is the objective's own (accuracy for
    classification); loss is lower-is-better, accuracy higher; others follow the objective."""
    if metric == "auto":
        metric, mode = evaluation["monitor"], evaluation["mode"]
    else:
        mode = {"loss": "min", "accuracy": "max"}.get(metric, evaluation.get("mode", "min"))
    if metric not in evaluation:
        found = ", ".join(k for k, v in evaluation.items() if isinstance(v, float))
        raise UserError(f"metric={metric!r}: the evaluation reports no such metric (it has {found}); "
                        "use auto, loss, or one of those")
    return metric, mode


def is_better(challenger: dict, champion: dict | None, metric: str, mode: str = "max") -> bool:
    if champion is None:
        return True
    if mode == "min":
        return challenger[metric] < champion[metric]
    return challenger[metric] > champion[metric]


def outcome(promoted: bool, challenger: dict, champion: dict | None, metric: str, champion_v: str | None,
            mode: str = "max") -> str:
    """The challenger version's outcome tag: the decision and the two scores it compared."""
    if champion is None:
        return f"promoted: {metric} {challenger[metric]:.4f}, no champion before"
    better, worse = (">", "<=") if mode == "max" else ("<", ">=")
    return (f"{'promoted' if promoted else 'rejected'}: {metric} {challenger[metric]:.4f} "
            f"{better if promoted else worse} champion v{champion_v} {champion[metric]:.4f}")


@flow(name="retrain", flow_run_name="retrain-{model}-{dataset}", validate_parameters=False)
@flat_parameters(RetrainParams)
def retrain(params: RetrainParams) -> dict:
    """Train a challenger with the pipeline and move `champion` to it only if it is better."""
    uri = params.tracking_uri
    try:
        return challenge(params, uri)
    finally:
        store.checkpoint_wal(uri)  # the promotion and the outcome tag are written after the run ends


def challenge(params: RetrainParams, uri: str) -> dict:
    """Train a challenger, evaluate it and the champion on the same data, promote the better."""
    trained = train_pipeline(**params.pipeline())
    decision = compare_with_champion(params, store.prepare_store(uri), str(trained["model_version"]),
                                     trained["run_id"], "retrain")
    return {"run_id": trained["run_id"], **decision}


def compare_with_champion(params: RetrainParams, client, challenger_v: str, run_id: str, flow: str) -> dict:
    """Evaluate the challenger version and the champion on the same data and device, move the
    alias to the challenger only if it is better; tag the run `<flow>.*` with the decision."""
    log = get_run_logger()
    name = params.registered_model
    champion_v = champion_version(client, name)
    # The evaluations use a device as training does: a slot of the host's limit, the card's lock.
    with device_slot():
        plan = one_device_plan(probe_environment(), params.eval_gpus)
        with card_locks(plan) as locks:
            # Held-out data: the challenger's validation split, for both models.
            challenger = evaluate_version(client, name, challenger_v, plan, dataset=params.dataset,
                                          hold_fds=locks.fds)
            champion = (evaluate_version(client, name, champion_v, plan, dataset=params.dataset, hold_fds=locks.fds)
                        if champion_v and champion_v != challenger_v else None)
    metric, mode = compared(params.metric, challenger)
    promoted = is_better(challenger, champion, metric, mode)
    if promoted:
        promote(client, name, challenger_v)
    decision = {
        f"{flow}.decision": "promoted" if promoted else "kept champion",
        f"{flow}.metric": metric,
        f"{flow}.challenger_version": challenger_v,
        f"{flow}.challenger_score": f"{challenger[metric]:.6f}",
        f"{flow}.champion_version": champion_v or "none",
        f"{flow}.champion_score": f"{champion[metric]:.6f}" if champion else "none",
    }
    for k, v in decision.items():
        client.set_tag(run_id, k, v)
    client.set_model_version_tag(name, challenger_v, OUTCOME_TAG, outcome(promoted, challenger, champion,
                                                                         metric, champion_v, mode))
    create_markdown_artifact(key=f"{flow}-decision", markdown=(
        f"# {flow.capitalize()}: {decision[f'{flow}.decision']}\n\n| | version | {metric} |\n|---|---|---|\n"
        f"| challenger | {challenger_v} | {decision[f'{flow}.challenger_score']} |\n"
        f"| champion before | {decision[f'{flow}.champion_version']} | {decision[f'{flow}.champion_score']} |\n"))
    log.info("%s: %s", flow, decision)
    return {"promoted": promoted, **decision}
