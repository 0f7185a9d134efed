"""The shape of the package: one folder per subsystem, the library free of the command
line, no import cycles, short files, no two modules a newcomer could confuse.

Read from the source with ``ast`` (every import, also those inside functions), and from
a fresh interpreter for what ``import jaxdist`` loads.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxdist"
# Top-level modules with no subsystem of their own (the rest is folders).
LEAVES = {"__init__", "errors", "flops", "losses", "units"}
MAX_LINES = 300
SECTIONS = {"train", "dist", "model", "data", "optim"}  # the trainer's config sections


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, top_level_only: bool = False) -> set[str]:
    """The jaxdist modules ``path`` imports (``from a import b`` with b a module -> a.b)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jaxdist"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "jaxdist":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


# The commands built on the trainer's config: the trainer, the planner (which compiles
# the trainer's step for a cluster), the exporter (which reads a run's settings) and the
# generation command with its rebuilding of a run's or a folder's model (the library
# jaxdist.generate, its loop and sampling, is below them), and the evaluator (which builds
# a run's model from them). The library imports none of them.
COMMAND_LINE = ("jaxdist.train", "jaxdist.plan", "jaxdist.export", "jaxdist.evaluate",
                "jaxdist.generate.__main__", "jaxdist.generate.rebuild")  # fmt: skip


def in_train(name: str) -> bool:
    return any(name == c or name.startswith(c + ".") for c in COMMAND_LINE)


def test_the_package_is_folders_with_a_stated_job():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == LEAVES, f"top-level modules beyond the public face and leaves: {top - LEAVES}"
    folders = [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert len(folders) >= 9
    for folder in folders:
        init = folder / "__init__.py"
        assert init.exists(), f"{folder} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 15, f"{init}: no paragraph stating the folder's job"


def test_faces_re_export_their_names():
    """Each subsystem's ``__init__`` lists its face in ``__all__``, and every name there
    exists (the tree is imported in a fresh interpreter)."""
    faces = [m for m, p in MODULES.items() if p.name == "__init__.py" and m.count(".") == 1]
    code = "import importlib\n" + "".join(
        f"m = importlib.import_module({m!r}); [getattr(m, n) for n in m.__all__]\n" for m in faces
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in faces:
        assert "__all__" in MODULES[name].read_text(), f"{name} does not list its face"


def test_the_library_does_not_import_the_command_line():
    offenders = {
        name: sorted(i for i in imports_of(path) if in_train(i))
        for name, path in MODULES.items()
        if not in_train(name)
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"library modules importing jaxdist.train: {offenders}"


# The commands built on the trainer: they import it, it imports none of them.
ABOVE_THE_TRAINER = ("jaxdist.plan", "jaxdist.export", "jaxdist.evaluate", "jaxdist.generate")


def test_the_trainer_does_not_import_the_commands_built_on_it():
    def above(name: str) -> bool:
        return any(name == c or name.startswith(c + ".") for c in ABOVE_THE_TRAINER)

    offenders = {
        name: sorted(i for i in imports_of(path) if above(i))
        for name, path in MODULES.items()
        if name == "jaxdist.train" or name.startswith("jaxdist.train.")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"trainer modules importing a command built on it: {offenders}"
    # and the check reads the imports: the planner does import the trainer
    assert "jaxdist.train.compile_only" in imports_of(MODULES["jaxdist.plan.planner"])


def test_import_jaxdist_loads_neither_the_command_line_nor_health():
    """``import jaxdist`` and every public name of it (each loaded on first use)."""
    code = "import sys, jaxdist; [getattr(jaxdist, n) for n in jaxdist.__all__]\n"
    code += "print('\\n'.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = [m for m in proc.stdout.split() if m.startswith("jaxdist")]
    assert "jaxdist.parallel" in loaded  # the check sees jaxdist's own modules
    assert not [m for m in loaded if in_train(m) or m.split(".")[:2] == ["jaxdist", "health"]]


def test_the_launcher_starts_without_importing_jax():
    """``python -m jaxdist.launch`` starts a group's processes without JAX of its own (2 s
    of CPU a start, on a 2-core machine); ``import jaxdist`` alone does not load it either."""
    code = "import sys, jaxdist, jaxdist.launch.launcher; print('jax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["False"], proc.stdout


def test_subsystems_get_their_config_section_not_the_whole_config():
    """Outside the command line no code reads a section of a whole config
    (``config.train.x``, ``cfg.dist.y``): it is handed its values."""
    for name, path in MODULES.items():
        if in_train(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in SECTIONS
                and isinstance(node.value, ast.Name)
                and node.value.id in {"config", "cfg", "conf"}
            ):
                raise AssertionError(f"{path}:{node.lineno} reads {node.value.id}.{node.attr}")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                return path[path.index(other) :] + [other]
            if other not in state and (cycle := visit(other, [*path, other])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_no_import_cycles():
    graph = {m: imports_of(p, top_level_only=True) & set(MODULES) for m, p in MODULES.items()}
    assert sum(map(len, graph.values())) > 100  # the graph is read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    # and the search finds one where there is one
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_files_stay_short():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


# Pairs whose shared word is the point of the names, each with what tells them apart.
DISTINCT = {
    ("tokenizer", "tokens"): "a tokenizer (text -> ids), and the token files of ids",
    ("hf_gemma", "hf_llama"): "Hugging Face config.json translations, one per family, "
    "beside the maps (hf_llama: the Llama's keys; hf_gemma: what Gemma 2 adds to them)",
    ("hf_gemma", "hf_moe"): "Hugging Face config.json translations, one per family (hf_moe: "
    "what Mixtral and Qwen3-MoE add to the Llama's keys)",
    ("hf_llama", "hf_moe"): "the same: hf_llama reads every family, hf_moe the experts' keys",
    ("build_data", "build_model"): "the command line builds data and models from config",
    ("config", "config_checks"): "the config, and what each of its values may be",
    ("architecture", "architecture_checks"): "the config's model section, and which of its "
    "settings work together",
    ("step", "step_checks"): "the step, and the checks of its outputs on the host",
    ("run_directory", "run_health"): "the run's directory, and the run's health wiring",
    ("run_directory", "run_sinks"): "the run's directory, and the run's reporting wiring",
    ("run_health", "run_sinks"): "the trainer's health and reporting wiring",
    ("replica_check", "replica_groups"): "health's check that data-parallel replicas agree, "
    "and the planner's reader of XLA's replica groups",
    ("pipeline", "pipeline_1f1b"): "the pipeline's plan, GPipe and shared ticks; the 1F1B "
    "schedule built on them",
    ("pipeline", "pipeline_interleaved"): "the pipeline's plan, GPipe and shared ticks; the "
    "interleaved schedule built on them",
    ("pipeline_1f1b", "pipeline_interleaved"): "two pipeline schedules, named by schedule",
}


def _alike(a: str, b: str) -> bool:
    """First words alike: equal but for a plural (replica / replicas), or one long
    shared stem (coordination / coordinator, sharding / shard)."""
    a, b = a.split("_")[0].removesuffix("s"), b.split("_")[0].removesuffix("s")
    shared = len(next((p for p in _prefixes(a) if b.startswith(p)), ""))
    return a == b or (shared >= 4 and shared >= min(len(a), len(b)) - 3)


def _prefixes(word: str) -> list[str]:
    return [word[:n] for n in range(len(word), 0, -1)]


def confusable_pairs(names: set[str]) -> set[tuple[str, str]]:
    return {(a, b) for a, b in itertools.combinations(sorted(names), 2) if _alike(a, b)}


def test_no_two_modules_a_newcomer_could_confuse():
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            names.add(path.stem)
    folders = {p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    # A folder's own main module (checkpoint/checkpointer.py, train/trainer.py) is its face.
    own = {(f, m) for f in folders for m in names if (PACKAGE / f / f"{m}.py").exists()}
    pairs = confusable_pairs(names | folders)
    pairs = {p for p in pairs if p not in own and p[::-1] not in own}
    assert pairs <= set(DISTINCT), f"confusable module names: {sorted(pairs - set(DISTINCT))}"
    # the rule catches the names this package once had
    old = {"coordination", "coordinator", "health", "run_health", "replicas", "replica_check"}
    assert {("coordination", "coordinator"), ("replica_check", "replicas")} <= confusable_pairs(old)
