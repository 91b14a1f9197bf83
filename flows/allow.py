"""The served door, flow side: the operator's policy (training/policy.py), built once from
`gpuflow serve`'s options, and applied to every flow's parameters as the flow is entered
(flows/calls.py `entered`, before validation reads any file) and to every session's.

Only a run of a served deployment is checked: a local `gpuflow run` is the user's own shell.
`gpuflow serve` hands the policy to the runs it starts, and so to their children (the
evaluation child checks what it reads back from a checkpoint), through `POLICY_ENV`.
"""

from __future__ import annotations

import os

from prefect.runtime import deployment

from gpuflow.training.policy import POLICY_ENV, NotAllowed, Policy  # noqa: F401  (NotAllowed: the door's refusal)

from .settings import Settings


def operator_policy(settings: Settings) -> Policy:
    """The policy of `gpuflow serve`'s options; its own tracking store (MLFLOW_TRACKING_URI, else
    mlflow.db in serve's folder) is always allowed."""
    from gpuflow.tasks.tracking.store import default_tracking_uri
    from gpuflow.training.uris import absolute_uri

    return Policy(frozenset(settings.allowed_packages), tuple(settings.allowed_folders),
                  absolute_uri(default_tracking_uri()), tuple(settings.allowed_stores))


def hand_on(policy: Policy) -> None:
    """Serve's runs and their children apply this policy (set in the serve process's environment)."""
    os.environ[POLICY_ENV] = policy.to_env()


def current_policy(settings: Settings | None = None) -> Policy | None:
    """The policy of this flow run: the operator's in a served deployment's run, else None."""
    if not deployment.get_id():
        return None
    if settings is None and (handed := Policy.from_env()):
        return handed
    return operator_policy(settings or Settings())


def check_allowed(params, settings: Settings | None = None) -> None:
    """Refuse, in a deployment run, references, paths and stores outside the operator's policy
    (`params`: a flow's parameters, validated or as the caller sent them)."""
    if policy := current_policy(settings):
        policy.check_params(params)
