"""The champion/challenger rule of retrain and sweep: `champion` moves to a new version only when it is strictly
better on the same held-out data and device; a script's model becomes champion only where there is none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from gpuflow.tasks.tracking.registry import champion_version, evaluate_versions, promote
from gpuflow.tasks.tracking.results import OUTCOME_TAG
from gpuflow.training.errors import UserError
from gpuflow.training.judged import better, mode_of

from .session import on_one_device

if TYPE_CHECKING:
    from .params import RetrainParams


def compared(metric: str, evaluation: dict, optimized: str | None = None) -> tuple[str, str]:
    """(the metric compared, "min" or "max"), `auto` being what a sweep `optimized` (val_loss: loss) where the
    evaluation reports it, else the evaluation's monitor; UserError if it reports none."""
    if metric == "auto":
        held_out = optimized.removeprefix("val_") if optimized and optimized.startswith("val_") else None
        metric = held_out if held_out in evaluation else evaluation["monitor"]
    mode = mode_of(metric, evaluation["monitor"], evaluation.get("mode", "min"))
    if metric not in evaluation:
        found = ", ".join(k for k, v in evaluation.items() if isinstance(v, float))
        raise UserError(f"metric={metric!r}: the evaluation reports no such metric (it has {found}); "
                        "use auto, loss, or one of those")
    return metric, mode


def outcome(promoted: bool, challenger: dict, champion: dict | None, metric: str, champion_v: str | None,
            mode: str) -> str:
    """The challenger version's outcome tag: the decision and the two scores it compared."""
    if champion is None:
        return f"promoted: {metric} {challenger[metric]:.4f}, no champion before"
    better, worse = (">", "<=") if mode == "max" else ("<", ">=")
    return (f"{'promoted' if promoted else 'rejected'}: {metric} {challenger[metric]:.4f} "
            f"{better if promoted else worse} champion v{champion_v} {champion[metric]:.4f}")


def compare_with_champion(params: RetrainParams, client, challenger_v: str, run_id: str, flow: str,
                          optimized: str | None = None) -> dict:
    """Evaluate the challenger version and the champion on the same data and device, move the
    alias to the challenger only if it is better (by what a sweep `optimized`, see compared); tag the run
    `<flow>.*` with the decision."""
    name = params.registered_model
    champion_v = champion_version(client, name)
    # The evaluations use a device as training does; held-out data: the challenger's validation split
    with on_one_device(params.eval_gpus) as (plan, fds):
        versions = [challenger_v, *([champion_v] if champion_v and champion_v != challenger_v else [])]
        reports = evaluate_versions(client, name, versions, plan, dataset=params.dataset, hold_fds=fds)
    challenger, champion = reports[0], (reports[1] if len(reports) > 1 else None)
    metric, mode = compared(params.metric, challenger, optimized)
    promoted = better(challenger[metric], champion and champion[metric], mode)
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
    get_run_logger().info("%s: %s", flow, decision)
    return {"promoted": promoted, **decision}


def offer_unevaluated(client, name: str, version: str) -> bool:
    """Promote a version gpuflow cannot evaluate (a script's model) only where there is no champion; whether it was."""
    champion = champion_version(client, name)
    if champion is None:
        promote(client, name, version)
    client.set_model_version_tag(name, version, OUTCOME_TAG,
                                 "promoted: no champion before" if champion is None else
                                 f"not compared: champion v{champion} kept (a script's model has no gpuflow "
                                 "evaluation; compare them and move the alias yourself)")
    return champion is None
