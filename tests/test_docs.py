"""The README and docs/ stay a map a newcomer can follow: every link lands, every command exists.

A relative link must name a file of the repository and, after ``#``, a heading of that file (GitHub's
anchor rule); a ``python X.py`` or ``python -m X`` command must name a script or module that exists,
so a renamed file cannot leave a page pointing at nothing. The README is held to its size, and
nothing in it or in docs/ points outside the repository, since a clone has nothing beside it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
SCRIPT = re.compile(r"\bpython3?\s+(?:-[A-Za-z]\s+)*([\w./-]+\.py)\b")
MODULE = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
# Modules of optional extras that the default environment does not install (the `[vllm]` extra).
OPTIONAL_EXTRAS = {"vllm"}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    found = set()
    for m in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def prose(page: Path) -> str:
    """The page without code: links inside code blocks or spans are examples, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", page.read_text()))


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.relative_to(root)}: link to missing file {target!r}")
        elif not dest.is_relative_to(root):
            problems.append(f"{page.relative_to(root)}: link leaves the repository {target!r}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{page.relative_to(root)}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


def _module_exists(name: str, root: Path) -> bool:
    top = name.split(".")[0]
    local = root / top
    if local.is_dir() or (root / f"{top}.py").exists():
        base = root / Path(*name.split("."))
        return base.with_suffix(".py").exists() or (base / "__init__.py").exists()
    return top in OPTIONAL_EXTRAS or importlib.util.find_spec(top) is not None


def missing_commands(page: Path, root: Path = ROOT) -> list[str]:
    text = page.read_text()
    problems = [
        f"{page.relative_to(root)}: `python {script}`: no such file"
        for script in SCRIPT.findall(text)
        if not (root / script).exists() and not script.startswith(("DIR", "PATH", "/"))
    ]
    problems += [
        f"{page.relative_to(root)}: `python -m {module}`: no such module"
        for module in MODULE.findall(text)
        if not _module_exists(module, root)
    ]
    return problems


def test_the_pages_are_found():
    names = {p.name for p in pages()}
    assert {"README.md", "architecture.md", "extending.md", "env.md", "benchmarks.md"} <= names, names


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_command_names_a_file_or_module_that_exists(page: Path):
    assert missing_commands(page) == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_nothing_points_outside_the_repository(page: Path):
    assert "../shared" not in page.read_text()


def test_the_readme_is_a_map():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, len(lines)
    assert len(text.split()) <= 2500, len(text.split())
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 300]
    assert not long, f"README lines over 300 characters: {long}"


def test_the_checks_catch_a_broken_page(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tool.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "docs" / "other.md").write_text(
        "# Other page\n\n## A `code` heading, twice\n\n## A `code` heading, twice\n"
    )
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n[ok](other.md#a-code-heading-twice-1) [self](#page) [web](https://example.org/x)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) `[in code](missing.md)`\n"
        "```\n[in a block](also_missing.md)\n```\n"
        "python tool.py; python nothere.py; python -m pkg; python -m pkg.absent; python -m json.tool\n"
    )
    assert broken_links(page, tmp_path) == [
        "docs/page.md: link to missing file 'missing.md'",
        "docs/page.md: no heading #nowhere in docs/other.md",
    ]
    assert missing_commands(page, tmp_path) == [
        "docs/page.md: `python nothere.py`: no such file",
        "docs/page.md: `python -m pkg.absent`: no such module",
    ]


def test_slugs_follow_githubs_rule():
    assert slug("The learned policy: does it beat the best fixed budget?") == (
        "the-learned-policy-does-it-beat-the-best-fixed-budget"
    )
    assert slug("`evaluate.py` and [Ray](https://ray.io)") == "evaluatepy-and-ray"
