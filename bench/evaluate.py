"""The champion/challenger comparison's evaluation: two versions in one evaluation child (what
retrain and a sweep now do) against one child per version (before), side by side.

    python -m bench.evaluate --repeats 5
    python -m bench.evaluate --repeats 6 --exit   # the child's exit: os._exit (now) vs the interpreter's teardown

Trains one checkpoint first (`gpuflow run`, 1 epoch, one CPU process, in a temporary folder),
then times `python -m gpuflow.training.evaluate` on CPU: twice with one checkpoint each, and
once with the checkpoint given twice. Both arms evaluate the same files on the same data.
With --exit, both arms evaluate the checkpoint twice in one child: the module as it is (it leaves with os._exit
once its report is written) against its `main()` left through `sys.exit`, the interpreter's teardown (before).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import PY, fmt, interleaved, run, summary


# the module as it was: imports frozen, then main() left through sys.exit and the interpreter's teardown
TEARDOWN = ("import gc, sys; sys.argv = ['evaluate', *sys.argv[1:]]; from gpuflow.training.evaluate import main; "
            "gc.freeze(); sys.exit(main())")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--exit", action="store_true", help="time the child's exit instead (see above)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        run([PY, "-m", "gpuflow.flows", "run", "--epochs", "1", "--gpus", "cpu", "--strategy", "single",
             "--tracking-uri", f"sqlite:///{base / 'mlflow.db'}", "--runs-dir", str(base / "runs")], cwd=base)
        (ck,) = base.glob("runs/*/checkpoints/epoch-0001.pt")

        def evaluate(*checkpoints: Path, child: tuple = ("-m", "gpuflow.training.evaluate")) -> float:
            return run([PY, *child, "--device", "cpu", "--result", str(base / "r.json"),
                        "--checkpoint", *map(str, checkpoints)], cwd=base)[0]

        if a.exit:
            values = interleaved(a.repeats, {"teardown": lambda: evaluate(ck, ck, child=("-c", TEARDOWN)),
                                             "os._exit": lambda: evaluate(ck, ck)})
            before, after = summary(values["teardown"]), summary(values["os._exit"])
            print(f"| the evaluation child's exit | wall s, median (min-max) |\n|---|---|\n"
                  f"| the interpreter's teardown (before) | {fmt(before, 2)} |\n| os._exit (now) | {fmt(after, 2)} |\n"
                  f"ratio (now / before): {after['median'] / before['median']:.2f}")
            return

        values = interleaved(a.repeats, {"one child per version": lambda: evaluate(ck) + evaluate(ck),
                                         "both in one child": lambda: evaluate(ck, ck)})
    before, after = summary(values["one child per version"]), summary(values["both in one child"])
    print(f"| two versions evaluated | wall s, median (min-max) |\n|---|---|\n"
          f"| one child per version | {fmt(before, 2)} |\n| both in one child | {fmt(after, 2)} |\n"
          f"ratio (one child / two): {after['median'] / before['median']:.2f}")


if __name__ == "__main__":
    main()
