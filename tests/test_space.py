"""A sweep's space file (flows/space.py read_space): bounded before anything is built from it, since
a served deployment's caller may name it. Real small files in tmp_path, no server, no Optuna."""

from pathlib import Path

import pytest
import yaml

from gpuflow.flows import space as space_module
from gpuflow.flows.space import SweepError, read_space

README_SPACE = """\
# sweep.yaml
lr: {type: float, low: 1.0e-4, high: 0.1, log: true}      # log-uniform
batch_size: {type: int, low: 32, high: 256, step: 32}     # integer range
optimizer: {type: choice, values: [adam, sgd]}            # choices
model_args.width: {type: int, low: 16, high: 128, log: true}   # a key your model takes
"""


def _write(tmp_path: Path, text: str) -> str:
    (tmp_path / "space.yaml").write_text(text)
    return str(tmp_path / "space.yaml")


def _refusal(path: str) -> str:
    """read_space's one-line refusal of path."""
    with pytest.raises(SweepError) as refused:
        read_space(path)
    message = str(refused.value)
    assert "\n" not in message and f"space={path}" in message, message
    return message


def _laughs(levels: int) -> str:
    """A billion-laughs space: a choice whose values are each ten of the one before (10^levels leaves)."""
    values = ["&l0 [" + ", ".join(["lol"] * 10) + "]"]
    values += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return f"optimizer: {{type: choice, values: [{', '.join(values)}]}}\n"


def test_the_readme_space_reads_as_written(tmp_path):
    space = read_space(_write(tmp_path, README_SPACE))
    assert list(space) == ["lr", "batch_size", "optimizer", "model_args.width"]
    assert (space["lr"].type, space["lr"].log, space["lr"].low, space["lr"].high) == ("float", True, 1.0e-4, 0.1)
    assert (space["batch_size"].type, space["batch_size"].step) == ("int", 32)
    assert space["optimizer"].values == ["adam", "sgd"]
    assert space["model_args.width"].log


def test_a_json_space_reads_too(tmp_path):
    space = read_space(_write(tmp_path, '{"optimizer": {"type": "choice", "values": ["adam", "sgd"]}}'))
    assert space["optimizer"].values == ["adam", "sgd"]


def test_one_anchor_and_its_alias_are_refused_naming_the_line_and_the_fix(tmp_path):
    says = _refusal(_write(tmp_path, "lr: {type: float, low: 0.001, high: 0.1}\n"
                                     "optimizer: &opts {type: choice, values: [adam, sgd]}\nscheduler: *opts\n"))
    assert "line 2 has the YAML anchor &opts" in says and "write the values out" in says, says


@pytest.mark.parametrize("line, says", [
    ("lr: {type: float, low: 1.0e-4, high: 0.1, log: true, step: 0.01}", "a log-scaled range takes no step"),
    ("n: {type: int, low: 2, high: 64, log: true, step: 2}", "a log-scaled range takes no step"),
    ("lr: {type: float, low: 0.1, high: 0.5, step: 0}", "step 0.0 must be above 0"),
    ("n: {type: int, low: 2, high: 64, step: -2}", "step -2.0 must be above 0"),
    ("n: {type: int, low: 2, high: 64, step: 2.5}", "step 2.5 must be above 0 and whole"),  # was cut to 2
])
def test_a_step_optuna_would_refuse_at_the_first_trial_is_refused_before_the_sweep(tmp_path, line, says):
    import optuna

    got = _refusal(_write(tmp_path, line + "\n"))
    assert says in got, got
    (name, d), = yaml.safe_load(line).items()
    if float(d["step"]).is_integer() or d["type"] == "float":  # what it spares: Optuna's error in a running sweep
        trial = optuna.create_study().ask()
        suggest = trial.suggest_int if d["type"] == "int" else trial.suggest_float
        with pytest.raises(ValueError):
            suggest(name, d["low"], d["high"], step=d["step"], log=d.get("log", False))


def test_a_merge_key_is_refused_at_its_anchor(tmp_path):
    says = _refusal(_write(tmp_path, "lr: &lr {type: float, low: 0.001, high: 0.1}\n"
                                     "weight_decay: {<<: *lr, high: 0.01}\n"))
    assert "line 1 has the YAML anchor &lr" in says and "write the values out" in says, says


def test_a_billion_laughs_is_refused_before_it_expands(tmp_path):
    # 10^4 leaves here; nothing is built before the first anchor is refused, so 9 levels (10^9) read the same
    says = _refusal(_write(tmp_path, _laughs(levels=4)))
    assert "line 1 has the YAML anchor &l0" in says and "no anchors or aliases" in says, says


def test_a_million_choices_are_refused_by_the_files_size(tmp_path):
    path = _write(tmp_path, "optimizer: {type: choice, values: [" + ",".join(["0"] * 1_000_000) + "]}\n")
    says = _refusal(path)
    size = Path(path).stat().st_size
    assert f"is {size:,} bytes, over the {space_module.MAX_SPACE_BYTES:,}" in says, says


def test_a_parameter_with_too_many_choices_is_refused_naming_it_the_count_and_the_limit(tmp_path):
    says = _refusal(_write(tmp_path, "optimizer: {type: choice, values: [" + ",".join(["0"] * 100_000) + "]}\n"))
    assert f"optimizer has 100,000 choices, over the {space_module.MAX_CHOICES:,}" in says, says


def test_too_many_parameters_are_refused_naming_the_count_and_the_limit(tmp_path):
    says = _refusal(_write(tmp_path, "".join(f"p{i}: {{type: float, low: 0.1, high: 1}}\n" for i in range(1000))))
    assert f"names 1,000 parameters, over the {space_module.MAX_PARAMETERS}" in says, says


def test_a_file_over_the_size_bound_is_refused_with_its_size_even_when_it_is_a_valid_space(tmp_path):
    path = _write(tmp_path, README_SPACE + "#" * (2 << 20) + "\n")
    says = _refusal(path)
    assert f"is {Path(path).stat().st_size:,} bytes" in says and "check that this is the space file" in says, says


@pytest.mark.parametrize("text, says", [
    ("lr: " + "[" * 100_000, "not YAML"),  # deeper than the parser nests
    ("lr: {type: float, low: 1" + "0" * 5000 + ", high: 2}", "not YAML"),  # more digits than Python reads
])
def test_a_file_no_parser_can_read_is_refused_in_one_line(tmp_path, text, says):
    assert says in _refusal(_write(tmp_path, text))


@pytest.mark.parametrize("direction", ["minimize", "maximize"])
def test_the_sweeps_pruning_decides_as_optunas_should_prune_on_the_same_study(direction):
    """flows/study.py Pruning asks the study's own pruner (median) about the values as reported, against a
    copy of the completed trials: at every step, for trials better and worse than the median, it says what
    `trial.should_prune()` says."""
    import optuna

    from gpuflow.flows.study import Pruning

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction=direction,
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    for k in range(3):  # completed trials, one curve each
        done = study.ask()
        for step in range(1, 11):
            done.report(k + 1.0 / step, step)
        study.tell(done, k)
    pruning, decided = Pruning(study), []
    for offset in (-1.0, 1.05, 1.2, 5.0):  # below, around and above the completed curves
        trial, values = study.ask(), {}
        for step in range(1, 11):
            value = offset + (0.3 if step % 3 == 0 else 1.0) / step  # not monotone: the best so far counts
            trial.report(value, step)
            values[step] = value
            decided.append((pruning.says(trial.number, values), trial.should_prune()))
        pruning.completed_here(study.tell(trial, offset))  # completed here: counted from the next trial on
    assert len(pruning.completed().trials) == 7  # without reading the study again (PRUNE_REFRESH_S is 30 s)
    assert [ours for ours, _ in decided] == [theirs for _, theirs in decided]
    assert {ours for ours, _ in decided} == {True, False}  # both answers came up
