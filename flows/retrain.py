"""Scheduled retraining: train a challenger, compare it with the champion (flows/champion.py), promote if better;
a failed step moves nothing.
"""

from __future__ import annotations

from gpuflow.tasks.tracking import store

from .champion import compare_with_champion
from .calls import validated_once
from .checked import checked_flow
from .params import PipelineParams, RetrainParams
from .train import train_pipeline


@checked_flow(RetrainParams, name="retrain", flow_run_name="retrain-{model}-{dataset}")
def retrain(params: RetrainParams) -> dict:
    """Train a challenger with the pipeline and move `champion` to it only if it is better."""
    uri = params.tracking_uri
    try:
        with validated_once(PipelineParams.model_construct(**params.pipeline())):  # checked as RetrainParams
            trained = train_pipeline(**params.pipeline())
        decision = compare_with_champion(params, store.prepare_store(uri), str(trained["model_version"]),
                                         trained["run_id"], "retrain")
        return {"run_id": trained["run_id"], **decision}
    finally:
        store.checkpoint_wal(uri)  # the promotion and the outcome tag are written after the run ends
