"""The floor of any Prefect-orchestrated job: start Python, import Prefect, create and finish
one flow run with one task on the configured API, exit. bench/overhead.py times it beside
the pipeline, so the table shows how much of the pipeline's overhead is Prefect's alone.

    python -m bench.noop_flow                          Prefect alone
    python -m bench.noop_flow --mlflow sqlite:///x.db  and one empty MLflow run, opened and
                                                       ended by gpuflow's own tracked_run, as
                                                       every gpuflow flow does (bench/script.py)
"""

import gc

gc.disable()  # start and end as `gpuflow` does (flows/__main__.py): imports without collection

import argparse  # noqa: E402

from prefect import flow, task  # noqa: E402


@task
def nothing() -> int:
    return 0


@flow(name="noop")
def noop(tracking_uri: str | None = None, runs_dir: str = "runs") -> int:
    if not tracking_uri:
        return nothing()
    from gpuflow.tasks.tracking.tracked import tracked_run

    with tracked_run(tracking_uri, "floor", "floor", {}, None, runs_dir):
        return nothing()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mlflow", metavar="URI", help="also open and end one MLflow run in this store")
    p.add_argument("--runs-dir", default="runs")
    a = p.parse_args()
    if a.mlflow:
        import gpuflow.tasks.tracking.tracked  # noqa: F401  (MLflow: gpuflow's flow modules import it up front)
    gc.freeze()
    gc.enable()
    noop(a.mlflow, a.runs_dir)
    gc.freeze()  # no final collection at exit
