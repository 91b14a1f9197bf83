"""The operator's policy (training/policy.py) for served deployments' runs, built from `gpuflow serve`'s
options and applied to each job's parameters at its door (flows/calls.py `admit`); a local run is not checked.
Serve hands it to its runs and their children as a private file named by `POLICY_FILE_ENV`.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

from prefect.runtime import deployment, flow_run

from gpuflow.training.policy import POLICY_FILE_ENV, NotAllowed, Policy  # noqa: F401  (NotAllowed: the door's refusal)

from .settings import Settings


def operator_policy(settings: Settings) -> Policy:
    """The policy of `gpuflow serve`'s options; serve's own tracking store is always allowed."""
    from gpuflow.tasks.tracking.store import default_tracking_uri
    from gpuflow.training.uris import absolute_uri

    return Policy(frozenset(settings.allowed_packages), tuple(settings.allowed_folders),
                  absolute_uri(default_tracking_uri()), tuple(settings.allowed_stores))


@contextmanager
def handed_on(policy: Policy):
    """Serve's (or a node's) runs and their children apply this policy while in the block: written to a 0600 file
    of this account, named in this process's environment (theirs is this one's: no caller sets it), removed after."""
    path = policy.write_private()
    os.environ[POLICY_FILE_ENV] = str(path)
    try:
        yield path
    finally:
        os.environ.pop(POLICY_FILE_ENV, None)
        path.unlink(missing_ok=True)


def deployment_id() -> str | None:
    """The deployment this flow run is a run of, else None; read once per flow run, as Prefect's
    `deployment.get_id` asks its API at every call."""
    run = flow_run.get_id()
    return _deployment_of(run) if run else deployment.get_id()


@functools.lru_cache(maxsize=64)
def _deployment_of(run: str) -> str | None:
    return deployment.get_id()  # read in that run's own context: its deployment never changes


def current_policy(settings: Settings | None = None) -> Policy | None:
    """The policy of this flow run: the operator's in a served deployment's run, else None."""
    if not deployment_id():
        return None
    if settings is None and (handed := Policy.from_env()):
        return handed
    return operator_policy(settings or Settings())


def check_allowed(params, settings: Settings | None = None) -> None:
    """In a deployment's run, refuse `params` (a flow's, validated or as sent) naming what the policy does not allow;
    job variables sent with the run are said to be ignored (serve's runner and gpuflow's node worker ignore them)."""
    if policy := current_policy(settings):
        if sent := flow_run.get_job_variables():
            from prefect import get_run_logger

            get_run_logger().warning("ignored the job variables sent with this run (%s): a served run's command, "
                                     "environment and folder are its operator's", ", ".join(sorted(sent)))
        policy.check_params(params)
