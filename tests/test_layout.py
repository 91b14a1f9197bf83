"""The layout holds what ARCHITECTURE.md says: no import cycle among flows/, tasks/ and training/,
training/ never imports Prefect or MLflow, and a built-in run keeps torch out of the flow process (a
dataset prepared the first time needs it once: tests/test_datacache.py)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("flows", "tasks", "training")


def module_name(f: Path) -> str:
    return "gpuflow." + ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(f): f for p in PACKAGES for f in sorted((ROOT / p).rglob("*.py"))}


def runtime_imports(node: ast.AST):
    """Every import statement under `node`, at any depth, except those under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
            yield from (i for n in child.orelse for i in runtime_imports(n))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from runtime_imports(child)


def imported(name: str, f: Path) -> set[str]:
    """The gpuflow modules `name` imports, at module level or inside functions."""
    package = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in runtime_imports(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        subs = [f"{base}.{a.name}" for a in node.names]
        found |= set(subs) if all(s in MODULES for s in subs) else {base}
    return {m for m in found if m in MODULES and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_flows_tasks_and_training_import_each_other_without_a_cycle():
    graph = {name: imported(name, f) for name, f in MODULES.items()}
    assert graph["gpuflow.flows.launchers"] >= {"gpuflow.flows.session"}  # the graph is read, not empty
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_training_never_imports_prefect_or_mlflow():
    for name, f in MODULES.items():
        if name.startswith("gpuflow.training"):
            tops = set()
            for node in runtime_imports(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    tops |= {a.name.split(".")[0] for a in node.names}
                elif not node.level:
                    tops.add((node.module or "").split(".")[0])
            assert not tops & {"prefect", "mlflow"}, f"{f} imports {tops & {'prefect', 'mlflow'}}"


def test_the_reaper_in_front_of_every_child_loads_no_third_party_package_but_psutil():
    """It starts once per child a run starts (every worker, trial, evaluation and server): pydantic alone cost
    it 0.1 s of CPU each time."""
    code = ("import json, sys, gpuflow.training.reaper; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules if not m.startswith('_')}  # site's hooks\n"
            "                        - set(sys.stdlib_module_names))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["gpuflow", "psutil"], out.stdout


RUN_IN_THIS_PROCESS = """
import json, sys
from gpuflow.flows.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def test_a_built_in_run_keeps_torch_out_of_the_flow_process(tmp_path, prefect_api):
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value(), OMP_NUM_THREADS="1")
    args = ["run", "--epochs", "1", "--gpus", "cpu", "--strategy", "single", "--dataset", "synthetic",
            "--synthetic-size", "256",
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--runs-dir", str(tmp_path / "runs")]
    out = subprocess.run([sys.executable, "-c", RUN_IN_THIS_PROCESS, *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last == {"code": 0, "torch": False}, out.stderr[-3000:]


def test_each_package_map_names_every_module_it_holds():
    """training/__init__.py says which process runs each module, tasks/__init__.py what each step
    is: a module added without a place in the map fails here."""
    import re

    for package in ("training", "tasks"):
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        named = set(re.findall(r"[A-Za-z_]\w*", doc))
        for f in sorted((ROOT / package).glob("*")):
            stem = f.stem if f.suffix == ".py" else f.name
            if stem != "__init__" and (f.suffix == ".py" or (f / "__init__.py").is_file()):
                assert stem in named, f"{package}/__init__.py does not place {f.name}"
