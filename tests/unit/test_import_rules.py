"""The architecture's import rules, checked on the source: every import statement, at any depth.

trnflow is one package of rooms, lowest first; a room imports only the rooms below it. The map
below is the contract; `docs/architecture.md` says what each room owns.
"""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"trnflow": ROOT / "trnflow", "trnflow.flows": ROOT / "flows", "trnflow.tasks": ROOT / "tasks",
           "trnflow.specs": ROOT / "jobspecs"}
BASE = ("trnflow", "trnflow.errors", "trnflow.events", "trnflow.records", "trnflow.fsutil", "trnflow.redact",
        "trnflow.safetar", "trnflow.aws", "trnflow.settings", "trnflow.results", "trnflow.measures", "trnflow.urls",
        "trnflow.processes", "trnflow.teams")

# room -> the rooms it may import (besides itself and the base modules)
BELOW = {
    "specs": set(),
    "storage": {"specs"},
    "neuron": {"specs"},
    "device": {"specs", "storage", "neuron"},
    "emulator": {"specs", "storage", "neuron", "device"},
    "lifecycle": {"specs", "storage", "neuron"},
    "workload": {"specs", "storage", "neuron", "device", "lifecycle"},
    "backends": {"specs", "storage", "neuron", "device", "lifecycle", "workload"},
    "reporting": {"specs", "storage", "lifecycle"},
    "tasks": {"specs", "storage", "neuron", "device", "lifecycle", "workload", "backends", "reporting"},
    "flows": {"specs", "storage", "neuron", "device", "lifecycle", "workload", "backends", "reporting", "tasks"},
    "cli": {"specs", "storage", "neuron", "device", "emulator", "lifecycle", "workload", "backends", "reporting",
            "tasks", "flows"},
    "testing": set(),  # anything: it is never imported by the product
}
# Known edges still to move (each one a note on the issue that tracks it).
PENDING: set[tuple[str, str]] = set()
"""Imports across the rules still to be removed, (module, room): none."""


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            if package == "trnflow" and path.relative_to(folder).parts[0] in ("flows", "tasks", "specs"):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _named_import(node: ast.AST) -> str | None:
    """The trnflow module an `importlib.import_module(...)` call names, when its name starts with a
    literal `trnflow.`: the literal itself, or of an f-string (`f"trnflow.workload.{phase}"`) the
    package its literal start names (`trnflow.workload`). Such a call is an import like any other,
    and held to the same rules; a name held in a variable (a plug-in's, the device registry's) is not
    known from the source."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    if not ((isinstance(func, ast.Attribute) and func.attr == "import_module")
            or (isinstance(func, ast.Name) and func.id == "import_module")):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        name = arg.value
    elif (isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant)
          and isinstance(arg.values[0].value, str)):
        start = arg.values[0].value
        name = start[:-1] if start.endswith(".") else start.rpartition(".")[0]
    else:
        return None
    return name if name.startswith("trnflow.") else None


@functools.cache  # every rule reads the same files: each is parsed once
def _imports(module: str, path: Path) -> frozenset[str]:
    """The modules `module` imports, resolved to full names (relative imports included), and those it
    imports by name through `importlib.import_module` (`_named_import`)."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (named := _named_import(node)) is not None:
            out.add(named)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES}
    return frozenset(out)


def room(module: str) -> str | None:
    if module in BASE:
        return "base"
    parts = module.split(".")
    if parts[0] != "trnflow":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in BELOW else None


def test_the_neuron_room_is_torch_free():
    """The neuron room's functions start nothing and load no torch: the launcher program that runs
    torchrun belongs to the backends (`trnflow.backends.launcher`)."""
    users = {module for module, path in MODULES.items() if room(module) == "neuron"
             and any(m.split(".")[0] in ("torch", "functorch") for m in _imports(module, path))}
    assert users == set()


def test_every_module_belongs_to_a_room():
    assert {m for m in MODULES if room(m) is None} == set()


def _edges() -> list[tuple[str, str, str, str]]:
    edges = []
    for module, path in MODULES.items():
        for target in _imports(module, path):
            if room(target) is not None:
                edges.append((module, room(module), target, room(target)))
    return edges


def _allowed(src: str, dst: str) -> bool:
    if src == "base":
        return dst == "base"
    return dst == src or dst == "base" or src == "testing" or dst in BELOW.get(src, set())


def test_each_room_imports_only_the_rooms_below_it():
    wrong = []
    for module, src, target, dst in _edges():
        if not _allowed(src, dst) and (module, dst) not in PENDING:
            wrong.append(f"{module} ({src}) imports {target} ({dst})")
    assert wrong == []


def test_a_module_imported_by_name_through_importlib_counts_as_an_import(tmp_path):
    """`importlib.import_module("trnflow.backends.launcher")` from the neuron room reaches up as much
    as an import statement would, and so does an f-string that starts with a room's name."""
    source = tmp_path / "probe.py"
    source.write_text(
        "import importlib\n"
        "from importlib import import_module\n"
        "def run(phase, name):\n"
        "    importlib.import_module('trnflow.backends.launcher').main([])\n"
        "    import_module(f'trnflow.workload.{phase}')\n"
        "    importlib.import_module(f'{name}.__main__')  # a name from a variable: not known\n"
        "    importlib.import_module('torch.multiprocessing.spawn')  # not trnflow's\n")
    found = _imports("trnflow.neuron.probe", source)
    assert found == {"importlib", "trnflow.backends.launcher", "trnflow.workload"}
    assert [_allowed("neuron", room(m)) for m in sorted(found - {"importlib"})] == [False, False]


def test_the_pending_exceptions_are_still_needed():
    """An exception that no longer happens is taken off the list, so the list only shrinks."""
    happening = {(module, dst) for module, _, _, dst in _edges()}
    assert PENDING - happening == set()


def test_the_workload_never_reaches_the_emulator_prefect_or_aws():
    for module, path in MODULES.items():
        if room(module) == "workload":
            bad = {m for m in _imports(module, path)
                   if m.split(".")[0] in ("prefect", "boto3", "botocore", "moto") or room(m) == "emulator"}
            assert bad == set(), module


def test_moto_is_imported_only_by_the_testing_room():
    users = {module for module, path in MODULES.items()
             if any(m.split(".")[0] == "moto" for m in _imports(module, path))}
    assert {u for u in users if room(u) != "testing"} == set()


def test_the_neuron_sdks_are_imported_only_by_their_devices():
    """torch-xla and torch-neuronx are each one device's business: nothing outside `trnflow.device`
    (and only the module of that device) imports them, so the workload runs unchanged on any."""
    users = {module: {m.split(".")[0] for m in _imports(module, path)} & {"torch_xla", "torch_neuronx"}
             for module, path in MODULES.items()}
    assert {m: sdks for m, sdks in users.items() if sdks} == {"trnflow.device.xla": {"torch_xla"},
                                                              "trnflow.device.neuron": {"torch_neuronx"}}


def test_prefect_stays_in_tasks_flows_and_the_cli():
    users = {module for module, path in MODULES.items()
             if any(m.split(".")[0] == "prefect" for m in _imports(module, path))}
    assert {room(u) for u in users} <= {"tasks", "flows", "cli", "testing"}, users


def test_there_are_no_import_cycles():
    graph = {m: {t for t in _imports(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # a package imports its own submodules to re-export them: that is not a cycle
    graph = {m: {t for t in ts if not (t.startswith(m + ".") and MODULES[m].name == "__init__.py")}
             for m, ts in graph.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_flows_and_tasks_never_read_the_backend_choice():
    for folder in (FOLDERS["trnflow.flows"], FOLDERS["trnflow.tasks"]):
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                reads_backend = (isinstance(node, ast.Attribute) and node.attr == "backend"
                                 and isinstance(node.value, ast.Attribute) and node.value.attr == "compute")
                assert not reads_backend, f"{path}:{node.lineno} reads spec.compute.backend"


def test_the_sagemaker_sdk_is_imported_only_where_jobs_are_sent_and_only_lazily():
    """`from sagemaker.train import ModelTrainer` takes about 3 s: only the submitting module may
    import it, and only inside a function."""
    users = {m for m, p in MODULES.items() if any(i.split(".")[0] == "sagemaker" for i in _imports(m, p))}
    assert users == {"trnflow.backends.sagemaker_trainer"}
    tree = ast.parse(MODULES["trnflow.backends.sagemaker_trainer"].read_text())
    top_level = {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert "sagemaker" not in top_level


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_every_room_says_what_it_owns(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    assert len(doc) > 80 and "TODO" not in doc, f"{package} needs a docstring saying what it owns and may import"


HEAVY = ("prefect", "torch", "functorch", "sagemaker", "matplotlib", "moto", "boto3", "botocore", "httpx", "mlflow",
         "transformers", "peft", "trnflow.flows", "trnflow.tasks", "trnflow.testing", "trnflow.workload",
         "trnflow.emulator.jit", "trnflow.emulator.compiler", "trnflow.device.base", "trnflow.device.registry",
         "trnflow.device.tensor_parallel",
         "trnflow.backends.local", "trnflow.backends.sagemaker", "trnflow.backends.batch", "trnflow.cli.server")
"""What may be imported inside a function: modules that are slow to import (or pull in one that is),
or optional. Everything else is imported at the top of the module."""


def _function_imports() -> list[tuple[str, int, str, bool]]:
    found = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        typing_only = [n for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
                       for n in node.body]  # never run: names for annotations only
        top = {id(node) for node in [*tree.body, *typing_only]}
        nested = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in top),
                        key=lambda n: n.lineno)
        said = False
        for i, node in enumerate(nested):
            # a reason on the import's line, or on the line above a run of imports, covers the run
            follows = i > 0 and node.lineno == nested[i - 1].end_lineno + 1
            said = (follows and said) or "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
            name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if name == "trnflow.cli":  # `from trnflow.cli import server` imports the module trnflow.cli.server
                name = ".".join([name, node.names[0].name])
            found.append((module, node.lineno, name or "", said))
    return found


def test_imports_inside_functions_are_heavy_or_optional_and_say_why():
    wrong = [f"{module}:{line} imports {name}" + ("" if said else " without a reason")
             for module, line, name, said in _function_imports()
             if not (name.startswith(HEAVY) and said)]
    assert wrong == []
