"""The docs hold together: every relative link in README.md, CHANGELOG.md and docs/*.md points to a file
(and its #anchor to a heading of that file), the README stays a short page, and every
`experiments/NAME.yaml` and source path (`wiiide/...`, `harness/...`, `studies/...`) the docs name exists.
No product file narrates the work ("session 12", "issue 44"), and every dotted module path
(`wiiide.wire.auth`, `harness.analysis.round_model.X`) the code, specs and docs name is a module of the
tree, or a name in one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300

# [text](target) outside code: the target up to the first space or ')'; images too (![alt](target))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
SPEC_PATH = re.compile(r"\bexperiments/[A-Za-z0-9_.-]+\.ya?ml\b")
PLACEHOLDER = re.compile(r"/[A-Z]+(?:/|$)")  # studies/NAME/: a pattern, not a path
# "session 12", "Sessions 18 and 20", "issue #44", "issue no. 3": which round of work ran what
NARRATION = re.compile(r"\b(?:sessions?|issues?)\s+(?:#|no\.?\s*)?\d+", re.IGNORECASE)
# a dotted module path: wiiide.wire.auth, harness.analysis.round_model.simulate (not io.wiiide.x, not a URL)
MODULE_PATH = re.compile(r"(?<![\w./-])((?:wiiide|harness)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# the files a user reads as the product: the two packages, the specs, the studies, the docs, the shell
PRODUCT_TREES = ("wiiide", "harness", "experiments", "studies", "docs", "docker")
PRODUCT_FILES = ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", "compose.yaml")
PRODUCT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".j2", ".sh", ".json", ""}
# a file or folder of the tree named in code: `wiiide/server/ps/shard.py`, `harness/links/`
TREE_PATH = re.compile(r"`((?:wiiide|harness|tests|docker|studies)/[A-Za-z0-9_./-]*)`")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks, inline code removed."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(INLINE_CODE.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence or not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def relative_links(path: Path) -> list[str]:
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            targets.append(target)
    return targets


def test_the_docs_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"README.md", "getting-started.md", "sweeps.md", "reports.md", "knobs.md", "results.md"} <= names


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading(path: Path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_readme_is_a_short_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def test_readme_keeps_make_test_as_the_test_command():
    assert "make test" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_spec_exists(path: Path):
    missing = sorted({m for m in SPEC_PATH.findall(path.read_text(encoding="utf-8"))
                      if not (ROOT / m).is_file()})
    assert not missing, f"{path.relative_to(ROOT)} names specs that do not exist: {missing}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_source_path_exists(path: Path):
    missing = sorted({m for m in TREE_PATH.findall(path.read_text(encoding="utf-8"))
                      if not PLACEHOLDER.search(m) and not (ROOT / m).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_checks_find_what_they_look_for(tmp_path: Path):
    """The link and anchor checks see a broken link and a missing heading (so the tests above can fail)."""
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading, here\n\n[ok](#a-code-heading-here) [bad](#nowhere) "
                    "[gone](missing.md) `[in code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n",
                    encoding="utf-8")
    assert relative_links(page) == ["#a-code-heading-here", "#nowhere", "missing.md"]
    assert anchors(page) == {"a-code-heading-here"}


def product_files() -> list[Path]:
    """Every text file of the product (`PRODUCT_TREES`, `PRODUCT_FILES`), no caches."""
    files = [ROOT / name for name in PRODUCT_FILES if (ROOT / name).is_file()]
    for tree in PRODUCT_TREES:
        files += [p for p in sorted((ROOT / tree).rglob("*"))
                  if p.is_file() and p.suffix in PRODUCT_SUFFIXES and "__pycache__" not in p.parts]
    return files


def narration_in(text: str) -> list[str]:
    """The lines of `text` that say which session or issue did something, as ``LINE: text``."""
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if NARRATION.search(line)]


def test_the_product_files_include_both_packages():
    names = {str(p.relative_to(ROOT)) for p in product_files()}
    assert {"wiiide/config.py", "harness/cli.py", "experiments/quick.yaml", "docs/knobs.md",
            "README.md", "docker/Dockerfile"} <= names


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_product_file_narrates_the_work(path: Path):
    """A docstring says what the code does; a figure names its command, report, machine and commit;
    history goes to CHANGELOG.md or a study's NOTE.md, by date and commit, not by session or issue."""
    found = narration_in(path.read_text(encoding="utf-8", errors="replace"))
    assert not found, (f"{path.relative_to(ROOT)} says which session or issue did what (name the date, "
                       "commit, report or docs page instead):\n" + "\n".join(found))


def defines(source: str, name: str) -> bool:
    """`source` (a module's text) defines or imports `name`: a def, class, assignment or import."""
    n = re.escape(name)
    return any(re.search(pattern, source, re.MULTILINE) for pattern in (
        rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b",       # def name / class name
        rf"^\s*{n}\s*(?::[^=\n]*)?=",                      # name = ..., name: T = ...
        rf"^\s*(?:\w+\s*,\s*)+{n}\s*(?:,[^=\n]*)?=",        # a, name = ...
        rf"^(?:from\s+\S+\s+)?import\s+[^(\n]*\b{n}\b",       # from x import name / import name
        rf"^from\s+\S+\s+import\s*\([^)]*\b{n}\b",          # from x import (..., name, ...)
        rf"^\s*self\.{n}\b",                               # an instance attribute
    ))


def module_path_exists(dotted: str) -> bool:
    """True when `dotted` is a module or package of the tree, or such a module followed by a name it
    defines or imports (a function, class, constant or re-export: `wiiide.config.RunConfig`)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            return i == len(parts) or defines(source.read_text(encoding="utf-8"), parts[i])
    return False


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_module_path_exists(path: Path):
    """Modules that moved (wiiide.protocol to wiiide.wire.*, harness.present.round_model to
    harness.analysis.*) leave no reference to their old place."""
    text = path.read_text(encoding="utf-8", errors="replace")
    missing = sorted({m.rstrip(".") for m in MODULE_PATH.findall(text) if not module_path_exists(m.rstrip("."))})
    assert not missing, f"{path.relative_to(ROOT)} names modules that do not exist: {missing}"


def test_the_narration_and_module_checks_find_what_they_look_for():
    """The checks above see narration and a moved module (so they can fail), and pass the plain words."""
    assert len(narration_in("measured in session 16\nSessions 18 and 20\nsee issue #44\nIssue no. 3\n")) == 4
    assert not narration_in("wiiide.server.ps.session\nthe session layer\nno session tickets\nan issue of 3 frames")
    assert MODULE_PATH.findall("`wiiide.protocol`, io.wiiide.harness.x, https://wiiide.invalid/s") == ["wiiide.protocol"]
    assert not module_path_exists("wiiide.protocol") and not module_path_exists("harness.present.round_model")
    assert module_path_exists("wiiide.wire.auth") and module_path_exists("harness.analysis.round_model")
    assert module_path_exists("wiiide.config.RunConfig") and not module_path_exists("wiiide.config.NoSuchName")
