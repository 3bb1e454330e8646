"""The docs hold together: every relative link in README.md, CHANGELOG.md and docs/*.md points to a file
(and its #anchor to a heading of that file), the README stays a short page, and every
`experiments/NAME.yaml` and source path (`wiiide/...`, `harness/...`) the docs name exists."""

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
# a file or folder of the tree named in code: `wiiide/ps/shard.py`, `harness/links/`
TREE_PATH = re.compile(r"`((?:wiiide|harness|tests|docker)/[A-Za-z0-9_./-]*)`")


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
    missing = sorted({m for m in TREE_PATH.findall(path.read_text(encoding="utf-8")) if not (ROOT / m).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_checks_find_what_they_look_for(tmp_path: Path):
    """The link and anchor checks see a broken link and a missing heading (so the tests above can fail)."""
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading, here\n\n[ok](#a-code-heading-here) [bad](#nowhere) "
                    "[gone](missing.md) `[in code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n",
                    encoding="utf-8")
    assert relative_links(page) == ["#a-code-heading-here", "#nowhere", "missing.md"]
    assert anchors(page) == {"a-code-heading-here"}
