"""A failure inside a rank names its cause in one line (training/contract.py): the user's own
exception and file:line are the console's last line and the run's `error` tag; a failure
before any progress is not run again by a restart; ranks' lines reach the console whole; a
script's collectives time out with the run's --dist-timeout-s."""

from __future__ import annotations

import logging
import re
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import pytest

from gpuflow.training.contract import epoch_line
from tests.test_user_code import api_url, gpuflow  # noqa: F401  (the session's Prefect server)

MODEL_AND_DATA = """
    import torch
    from pathlib import Path
    from torch import nn
    from torch.utils.data import Dataset

    class Net(nn.Module):
        def __init__(self, num_classes=3):
            super().__init__()
            self.fc = nn.Linear(4, num_classes)
        def forward(self, x):
            return self.fc(x)

    class Samples(Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            if i == 30:
                with open(Path(__file__).with_name("raised.txt"), "a") as f:
                    f.write("raised\\n")
                raise ValueError(f"sample {i} is corrupt")
            return torch.full((4,), float(i)), i % 3

    def datasets(root):
        return Samples(), torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.arange(8) % 3)
"""


def write(folder: Path, name: str, code: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(textwrap.dedent(code))
    return folder


def runs(folder: Path) -> list:
    c = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    return c.search_runs([c.get_experiment_by_name("gpuflow").experiment_id])


def test_an_exception_in_a_users_dataset_is_the_last_line_and_the_tag_and_is_not_run_again(tmp_path, api_url):
    folder = write(tmp_path, "proj.py", MODEL_AND_DATA)
    out = gpuflow(["run", "--model", "proj.py:Net", "--dataset", "proj.py:datasets", "--epochs", "2", "--gpus", "cpu",
                   "--cpu-processes", "2", "--max-restarts", "1"], folder, api_url)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    line = 1 + next(n for n, text in enumerate(MODEL_AND_DATA.splitlines()) if "raise ValueError" in text)
    assert re.fullmatch(rf"gpuflow run: training failed: ValueError: sample 30 is corrupt "
                        rf"\(at {re.escape(str(folder / 'proj.py'))}, line {line}; rank [01]\)", last), last
    (run,) = runs(folder)
    assert run.info.status == "FAILED" and last.removeprefix("gpuflow run: ") in run.data.tags["error"]
    # it raised before the first checkpoint: the restart reported it without running it again
    assert (folder / "raised.txt").read_text().count("raised") == 1
    assert "not run again" in out.stderr


def test_a_syntax_error_in_a_script_names_its_file_and_line(tmp_path, api_url):
    folder = write(tmp_path, "bad.py", "import torch\n\ndef broken(:\n    pass\n")
    out = gpuflow(["run", "--script", "bad.py", "--gpus", "cpu", "--cpu-processes", "2"], folder, api_url)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuflow run: bad.py failed: SyntaxError: ") and f"(at {folder / 'bad.py'}, line 3;" in last, last


def test_a_rank_killed_by_a_signal_names_the_rank_and_the_signal(tmp_path, api_url):
    """SIGKILL (the out-of-memory killer's) leaves no error file: the line names it from torchrun's summary."""
    folder = write(tmp_path, "oom.py", "import os, signal, time\nif os.environ['RANK'] == '1':\n"
                   "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(5)\n")
    out = gpuflow(["run", "--script", "oom.py", "--gpus", "cpu", "--cpu-processes", "2"], folder, api_url)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuflow run: oom.py failed: rank 1 was killed by SIGKILL; SIGKILL is also what the "
                           "kernel's out-of-memory killer sends"), last
    (run,) = runs(folder)
    assert run.info.status == "FAILED" and "rank 1 was killed by SIGKILL" in run.data.tags["error"]


def test_a_worker_killed_by_a_signal_is_named_from_its_exit_code():
    from gpuflow.tasks.failure import killed

    assert killed(128 + 9, ["no summary"]).startswith("the process was killed by SIGKILL")
    assert killed(128 + 15, []) == "the process was killed by SIGTERM"
    assert killed(1, ["Traceback", "ValueError: x"]) is None


def test_a_directory_given_as_the_script_is_named_as_one(tmp_path, api_url):
    (tmp_path / "scripts").mkdir()
    out = gpuflow(["run", "--script", "scripts"], tmp_path, api_url)
    assert out.returncode == 2 and "is a directory" in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]


CHATTY = MODEL_AND_DATA.replace("if i == 30:", "if False:") + """
    import os, sys
    rank = os.environ.get("RANK", "0")
    for i in range(1500):  # on import, in every rank at once
        print(f"rank {rank} line {i} " + "x" * 60)
        print(f"rank {rank} err {i}", file=sys.stderr)
"""


def test_every_line_of_every_rank_reaches_the_console_whole(tmp_path, api_url):
    folder = write(tmp_path, "chatty.py", CHATTY)
    out = gpuflow(["run", "--model", "chatty.py:Net", "--dataset", "chatty.py:datasets", "--epochs", "1",
                   "--gpus", "cpu", "--cpu-processes", "2"], folder, api_url)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(folder)
    log = (folder / "runs" / run.info.run_id / "logs" / "worker.log").read_text().splitlines()
    mine = [line for line in log if " line " in line or " err " in line]
    good = re.compile(r"rank ([01]) (line \d+ x{60}|err \d+)")
    bad = [line for line in mine if not good.fullmatch(line)]
    assert not bad and len(mine) == 2 * 2 * 1500, (len(mine), bad[:5])


HANGING = """
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins it
    else:
        time.sleep(300)
"""


def test_a_script_stuck_in_a_collective_fails_after_the_runs_dist_timeout(tmp_path, api_url):
    folder = write(tmp_path, "hang.py", HANGING)
    out = gpuflow(["run", "--script", "hang.py", "--gpus", "cpu", "--cpu-processes", "2", "--max-restarts", "0",
                   "--dist-timeout-s", "10"], folder, api_url)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuflow run: hang.py failed: ") and "collective timeout (10 s, --dist-timeout-s)" in last, last
    assert f"(at {folder / 'hang.py'}, line 5; rank 0)" in last
    (run,) = runs(folder)
    assert run.info.status == "FAILED"


def test_a_prefect_retry_of_the_launch_is_spent_only_where_it_can_help():
    from prefect.states import Failed

    from gpuflow.flows.prepared import retry_unless_it_repeats
    from gpuflow.tasks.launch import TrainingFailed
    from gpuflow.training.errors import UserError

    def retried(exc: BaseException) -> bool:
        return retry_unless_it_repeats(None, None, Failed(data=exc))

    assert retried(TrainingFailed("training failed: exited with code -9"))  # killed outright: may pass next time
    assert not retried(TrainingFailed("training failed: ValueError: ...", deterministic=True))
    assert not retried(UserError("bad value"))


RAISES_IN_THE_RANKS = """
    import os
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, num_classes=3):
            super().__init__()
            self.fc = nn.Linear(4, num_classes)
        def forward(self, x):
            if "RANK" in os.environ:  # in the ranks only: the flow's preflight passes
                raise RuntimeError("this layer needs CUDA")
            return self.fc(x)

    def datasets(root):
        data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.arange(32) % 3)
        return data, data
"""


def test_a_model_failing_only_in_the_ranks_shows_its_cause_without_tracebacks(tmp_path, api_url):
    """Each traceback (each rank's, torchrun's) is one console line naming the file that holds it whole."""
    folder = write(tmp_path, "late.py", RAISES_IN_THE_RANKS)
    out = gpuflow(["run", "--model", "late.py:Net", "--dataset", "late.py:datasets", "--epochs", "1", "--gpus", "cpu",
                   "--cpu-processes", "2", "--max-restarts", "0"], folder, api_url)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("gpuflow run: training failed: RuntimeError: this layer needs CUDA (at "), lines[-1]
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr, out.stderr
    assert "failed (exitcode: " not in out.stderr, out.stderr  # torchrun's account of it: the log file's
    assert len(lines) <= 40, out.stderr
    (run,) = runs(folder)
    log = folder / "runs" / run.info.run_id / "logs" / "worker.log"
    assert f"RuntimeError: this layer needs CUDA (traceback in {log})" in out.stderr, out.stderr
    assert log.read_text().count("Traceback (most recent call last):") == 3  # both ranks' and torchrun's
    assert "ChildFailedError" in log.read_text() and "failed (exitcode: " in log.read_text()


def test_a_chained_traceback_and_torchruns_summary_are_one_console_line_each():
    from gpuflow.tasks.child import Tracebacks

    output = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "a.py", line 3, in f',
              "[rank0]: epoch 1", "[rank1]: ValueError: inner", "[rank1]: ",
              "[rank1]: The above exception was the direct cause of the following exception:", "[rank1]: ",
              "[rank1]: Traceback (most recent call last):", '[rank1]:   File "a.py", line 5, in g',
              "[rank1]: RuntimeError: outer",
              "E1125 10:53:28.746000 4242 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) "
              "local_rank: 1 (pid: 4243) of binary: /usr/bin/python",
              "Traceback (most recent call last):", '  File "run.py", line 9, in main',
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 20,
              "gpuflow.training FAILED", "  rank      : 1 (local_rank: 1)", "=" * 20]
    shown = Tracebacks(Path("logs/worker.log"))
    assert [s for s in map(shown.console, output) if s is not None] == [
        "[rank0]: epoch 1", "[rank1]: ValueError: inner (traceback in logs/worker.log)",
        "[rank1]: RuntimeError: outer (traceback in logs/worker.log)"]  # torchrun's account: the file alone


def test_the_workers_epoch_lines_reach_the_console_every_two_seconds_and_the_log_file_every_one(tmp_path):
    """Short epochs: the first, one after a pause of PROGRESS_EVERY_S, and the last epoch's line on the console;
    the other lines (a warning among them) as they come; every line in the log file. A job of few epochs shows
    each."""
    from gpuflow.tasks.child import PROGRESS_ALL_UP_TO, PROGRESS_EVERY_S

    lines = [epoch_line(e, 30, f"train_loss {e}") for e in range(1, 31)]
    code = (f"import time\nlines = {lines!r}\nfor i, line in enumerate(lines):\n"
            f"    print(line, flush=True)\n    if i == 9: print('a warning of its own', flush=True); "
            f"time.sleep({PROGRESS_EVERY_S} + 0.2)\n")
    assert _console(code, tmp_path) == [lines[0], "a warning of its own", lines[10], lines[-1]]
    assert (tmp_path / "worker.log").read_text().splitlines() == [*lines[:10], "a warning of its own", *lines[10:]]
    few = [epoch_line(e, PROGRESS_ALL_UP_TO, "train_loss 1") for e in range(1, PROGRESS_ALL_UP_TO + 1)]
    assert _console(f"for line in {few!r}: print(line, flush=True)", tmp_path / "few") == few


def _console(code: str, folder: Path) -> list[str]:
    """What the console shows of a worker running `code` (its log file in `folder`)."""
    from gpuflow.tasks.child import run_child
    from gpuflow.training.contract import EPOCH_LINE

    seen: list[str] = []

    class Console(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger(f"gpuflow-test-progress-{folder.name}")
    log.setLevel(logging.INFO)
    log.addHandler(Console())
    folder.mkdir(exist_ok=True)
    code_, _ = run_child([sys.executable, "-c", code], None, folder, log, log_file=folder / "worker.log",
                         progress=EPOCH_LINE)
    assert code_ == 0
    return seen


def test_output_that_is_not_utf8_is_shown_escaped_and_the_child_still_ends(tmp_path):
    """A byte that is not UTF-8 once ended the pipe's reader, and the run waited forever for its end."""
    import threading

    from gpuflow.tasks.child import run_child

    code = ("import sys; sys.stdout.buffer.write(b'caf\\xe9\\n'); sys.stdout.flush(); "
            "[print('x' * 100) for _ in range(5000)]")  # past a pipe's 64 KiB: it blocks unless read
    stop, done = threading.Event(), {}

    def run():
        done["result"] = run_child([sys.executable, "-c", code], None, tmp_path, logging.getLogger("x"),
                                   log_file=tmp_path / "worker.log", stop=stop)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    stop.set()  # ends it either way
    t.join(60)
    assert done["result"][0] == 0
    assert (tmp_path / "worker.log").read_text().splitlines()[0] == "caf\\xe9"


def test_a_log_file_that_cannot_be_written_fails_before_the_child_starts(tmp_path):
    from gpuflow.tasks.child import run_child

    (tmp_path / "logs").write_text("a file where the folder goes")
    with pytest.raises(FileExistsError):
        run_child([sys.executable, "-c", f"open({str(tmp_path / 'started')!r}, 'w')"], None, tmp_path,
                  logging.getLogger("x"), log_file=tmp_path / "logs" / "worker.log")
    time.sleep(2)  # time enough for a child, had one started, to write its file
    assert not (tmp_path / "started").exists()
