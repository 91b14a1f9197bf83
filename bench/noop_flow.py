"""The floor of any Prefect-orchestrated job: start Python, import Prefect, create and finish
one flow run with one task on the configured API, exit. bench/overhead.py times it beside
the pipeline, so the table shows how much of the pipeline's overhead is Prefect's alone."""

from prefect import flow, task


@task
def nothing() -> int:
    return 0


@flow(name="noop")
def noop() -> int:
    return nothing()


if __name__ == "__main__":
    noop()
