"""What the README, docs/, BENCHMARKS.md, the launchers' and bench's READMEs and the code's docstrings
and comments name exists: every repository path (``pretrain/...``, ``data_prep/...``, ``launchers/...``,
``configs/...``, ``bench/...``, ``tests/...``, ``docs/...``), every ``python -m X`` module and every
dotted name (``pretrain.<module>.<name>``). Files moved often; a reader who follows a stale path finds nothing."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP = ("pretrain", "data_prep", "launchers", "configs", "bench", "benchmarks", "tests", "docs")
PATH = re.compile(r"(?<![\w./~$-])((?:%s)/[\w./-]*\w/?)" % "|".join(TOP))
DOTTED = re.compile(r"(?<![\w./-])((?:pretrain|data_prep|bench)(?:\.[A-Za-z_]\w*)+)")
MODULE = re.compile(r"python3? -m ([\w.]+)")
# Paths a text names on purpose although they do not exist: what a test or an example writes.
NOT_IN_THE_REPO = ("configs/nope.yaml", "configs/no_such.yaml")
PATTERN_GOES_ON = ("*", "{", "<", "[", "-{")  # tests/launchers/test_slurm_*.py, configs/modernbert-{tiny,base}.yaml


def documents() -> list[Path]:
    return [
        REPO / "README.md",
        REPO / "CONTRIBUTING.md",
        REPO / "BENCHMARKS.md",
        *sorted((REPO / "benchmarks").glob("*.md")),
        *sorted((REPO / "docs").glob("*.md")),
        REPO / "launchers" / "README.md",
        REPO / "bench" / "README.md",
    ]


def python_files() -> list[Path]:
    return sorted(
        p for top in ("pretrain", "data_prep", "bench", "tests", "launchers") for p in (REPO / top).rglob("*.py")
    )


def docstrings_and_comments(path: Path) -> str:
    """What a reader reads as prose in a module: its docstrings and its comments, not its strings."""
    source = path.read_text()
    texts = [
        ast.get_docstring(node) or ""
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    texts += [
        tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT
    ]
    return "\n".join(texts)


def shell_comments(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#"))


def prose() -> list[tuple[Path, str]]:
    texts = [(p, p.read_text()) for p in documents()]
    texts += [(p, docstrings_and_comments(p)) for p in python_files()]
    scripts = [p for p in (REPO / "launchers").rglob("*") if p.suffix in (".sh", ".sbatch")]
    texts += [(p, shell_comments(p)) for p in sorted(scripts + list((REPO / "bench").glob("*.sh")))]
    return texts


def test_every_repository_path_named_exists():
    missing = []
    for doc, text in prose():
        for match in PATH.finditer(text):
            path = match.group(1).rstrip(".")
            if path in NOT_IN_THE_REPO or text[match.end() : match.end() + 2].startswith(PATTERN_GOES_ON):
                continue
            if not (REPO / path).exists():
                missing.append(f"{doc.relative_to(REPO)}: {path}")
    assert not missing, "paths named that do not exist:\n" + "\n".join(sorted(set(missing)))


CITED_BY_TITLE = re.compile(r'BENCHMARKS(?:\.md)?,?\s*(?:#\s*)?"([^"]+)"')


def test_a_measurement_is_cited_by_its_file_not_its_title():
    """A title in quotes (``BENCHMARKS.md, "Masking"``) leaves the reader to search the page, and goes
    stale when the entry is renamed; its file's path (a link in Markdown) is checked above."""
    by_title = [
        f"{doc.relative_to(REPO)}: {' '.join(m.group(1).split())}"
        for doc, text in prose()
        if doc.name != "test_docs.py"
        for m in CITED_BY_TITLE.finditer(text)
    ]
    assert not by_title, "measurements cited by title, not by their benchmarks/ file:\n" + "\n".join(by_title)


def module_exists(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def resolves(dotted: str) -> bool:
    """A module, or a module's attribute (a function, a class, a class's method)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if module_exists(".".join(parts[:i])):
            if i == len(parts):
                return True
            obj = importlib.import_module(".".join(parts[:i]))
            for name in parts[i:]:
                if not hasattr(obj, name):
                    return False
                obj = getattr(obj, name)
            return True
    return False


def test_every_module_and_dotted_name_exists():
    missing = []
    for doc, text in prose():
        for match in MODULE.finditer(text):
            name = match.group(1).rstrip(".")
            runnable = module_exists(name) and (
                REPO.joinpath(*name.split(".")).with_suffix(".py").exists()
                or (REPO.joinpath(*name.split(".")) / "__main__.py").exists()
            )
            if name.split(".")[0] in ("pretrain", "data_prep", "bench") and not runnable:
                missing.append(f"{doc.relative_to(REPO)}: python -m {name}")
        for match in DOTTED.finditer(text):
            name = match.group(1).rstrip(".")
            if name.endswith(("_py", ".py", ".yaml", ".sh")):
                continue
            if not resolves(name):
                missing.append(f"{doc.relative_to(REPO)}: {name}")
    assert not missing, "modules or names that do not exist:\n" + "\n".join(sorted(set(missing)))


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            found.add(anchor(line.lstrip("#")))
    return found


def test_every_link_between_the_documents_leads_somewhere():
    broken = []
    for doc in documents():
        for match in LINK.finditer(doc.read_text()):
            target = match.group(1)
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


FROM_IMPORT = re.compile(
    r"from ((?:pretrain|data_prep|bench)(?:\.\w+)*) import (\w+(?: as \w+)?(?:, *\w+(?: as \w+)?)*)"
)


def test_every_import_in_the_scripts_and_documents_resolves():
    """``python -c "from data_prep... import ..."`` in a launcher, a heredoc in ``demo.sh``, a command
    in the docs: what a module move would break without any Python test noticing."""
    scripts = [p for p in (REPO / "launchers").rglob("*") if p.suffix in (".sh", ".sbatch")]
    texts = [*documents(), *scripts, *(REPO / "bench").glob("*.sh"), *(REPO / "configs").rglob("*.yaml")]
    missing = []
    for path in texts:
        for match in FROM_IMPORT.finditer(path.read_text()):
            module, names = match.group(1), [n.split(" as ")[0].strip() for n in match.group(2).split(",")]
            if not all(resolves(f"{module}.{name}") for name in names):
                missing.append(f"{path.relative_to(REPO)}: {match.group(0)}")
    assert not missing, "imports that do not resolve:\n" + "\n".join(missing)


def layout_rows() -> list[tuple[list[str], str]]:
    """docs/layout.md's table: for each row, the paths of its first cell and the whole row."""
    rows = []
    for line in (REPO / "docs" / "layout.md").read_text().splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            rows.append((re.findall(r"`([^`]+)`", cells[1]), line))
    return rows


def test_every_module_is_in_the_layout():
    """The map has no holes: every module of ``pretrain`` and ``data_prep`` is named in docs/layout.md's
    row for its folder (``pretrain/runtime/`` names ``engine.py``), or a row names its path."""
    rows = layout_rows()
    missing = []
    for path in sorted([*(REPO / "pretrain").rglob("*.py"), *(REPO / "data_prep").rglob("*.py")]):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(REPO)
        folder = f"{rel.parent}/"
        named = any(
            str(rel) in firsts
            or (folder in firsts and f"`{path.name}`" in row)
            or (any(f.endswith(".py") and str(Path(f).parent) + "/" == folder for f in firsts) and path.name in row)
            for firsts, row in rows
        )
        if not named:
            missing.append(str(rel))
    assert not missing, f"modules docs/layout.md does not name in their folder's row: {missing}"


def headline_rows(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("| [")]


def test_the_readmes_figures_are_benchmarks_headline_rows():
    """README's table quotes BENCHMARKS.md's headline, its first rows, word for word; each row links to
    its measurement's file, which names the same date."""
    quoted, headline = headline_rows(REPO / "README.md"), headline_rows(REPO / "BENCHMARKS.md")
    assert quoted and quoted == headline[: len(quoted)], "README's figures are not BENCHMARKS.md's first rows"
    for row in headline:
        target = LINK.search(row).group(1)
        date = row.split(" | ")[5]
        assert target.startswith("benchmarks/") and (REPO / target).is_file(), row
        assert date in (REPO / target).read_text() or date in target, (date, target)
