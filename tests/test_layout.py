"""The package layout: imports run downward, every rule is published from its registry, links resolve."""

import ast
import importlib
import pathlib
import re

import pytest

import fxgrad
from fxgrad.core.rule import RULES

ROOT = pathlib.Path(fxgrad.__file__).parent

# Each layer may import the layers listed for it (and itself); _compat is importable from all.
ALLOWED = {
    "core": {"core"},
    "passes": {"core", "passes"},
    "runtime": {"core", "runtime"},
    "rules": {"core", "runtime", "rules"},
    "frontend": {"core", "passes", "runtime", "rules", "frontend"},
    "integrations": {"core", "passes", "runtime", "rules", "frontend", "integrations"},
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "fxgrad" and parts[1] in ALLOWED else None


def _imports(path: pathlib.Path):
    """Modules ``path`` imports at run time (imports for type checkers only are left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "fxgrad":  # from fxgrad import _compat, passes
            yield from (f"fxgrad.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_imports_run_downward():
    upward = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for module in _imports(path):
                target = _layer(module)
                public_api = module.startswith("fxgrad.") and target is None and not module.startswith("fxgrad._")
                if public_api or (target is not None and target not in allowed):
                    upward.append(f"{path.relative_to(ROOT.parent)} imports {module}")
    assert not upward, "\n".join(upward)


def test_private_torch_apis_stay_in_compat():
    private = [
        f"{path.relative_to(ROOT.parent)} imports {module}"
        for path in sorted(ROOT.rglob("*.py"))
        if path.name != "_compat.py"
        for module in _imports(path)
        if module.startswith("torch._")
    ]
    assert not private, "\n".join(private)


def test_every_rule_is_public_and_documented():
    assert set(RULES) <= set(fxgrad.__all__)
    assert all(getattr(fxgrad, name) is cls for name, cls in RULES.items())
    readme = (ROOT.parent / "README.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)\(", readme, flags=re.M))
    composites = {"chain", "by_type", "by_name"}
    assert listed - composites == set(RULES), "the README's rule table and fxgrad's rules differ"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve():
    """Every relative link in the Markdown files names a file that exists and, with ``#``, a
    heading in it: pages move (docs/performance.md's log went to bench/results/history.md)."""
    repo = ROOT.parent
    pages = [p for p in repo.rglob("*.md") if not {".venv", "build", ".git"} & set(p.relative_to(repo).parts)]
    anchors = {p.resolve(): {_anchor(h) for h in re.findall(r"^#+ (.*)$", p.read_text(), flags=re.M)} for p in pages}
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            path = (page.parent / target if target else page).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(repo)}: {target} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in anchors.get(path, set()):
                broken.append(f"{page.relative_to(repo)}: {target}#{anchor} names no heading")
    assert not broken, "\n".join(broken)


def _resolves(name: str) -> bool:
    """Whether the dotted ``fxgrad....`` name is a module or an attribute reached from one."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                found = getattr(found, part)
        except AttributeError:
            return False
        return True
    return False


def test_names_in_docstrings_and_docs_resolve():
    """Every ``fxgrad.x.y`` a docstring or page names between backticks exists: modules move
    (fxgrad.step became fxgrad.frontend.step_scope)."""
    repo = ROOT.parent
    files = [*ROOT.rglob("*.py"), *(repo / "docs").glob("*.md"), repo / "README.md"]
    named = {(f, m) for f in files for m in re.findall(r"`~?(fxgrad(?:\.\w+)+)", f.read_text())}
    broken = sorted(f"{f.relative_to(repo)}: {name}" for f, name in named if not _resolves(name))
    assert not broken, "\n".join(broken)


def test_a_rule_name_is_taken_once_and_a_redefinition_replaces_itself():
    """Outside the package too (a notebook cell run twice redefines the same class)."""
    from fxgrad.core.rule import ScaleLeaf, rule

    def define(name: str = "doubled", qualname: str = "Doubled"):
        cls = type(
            qualname, (ScaleLeaf,), {"name": name, "factors": lambda self, stats, layers, ctx: [2.0] * len(stats)}
        )
        return rule(cls)

    try:
        first = define()
        second = define()
        assert RULES["doubled"] is second is not first
        with pytest.raises(TypeError, match=r"rule name 'doubled' is taken by .*Doubled"):
            define(qualname="Other")
        with pytest.raises(TypeError, match=r"rule name 'clip_by_norm' is taken"):
            define(name="clip_by_norm")
    finally:
        RULES.pop("doubled", None)
