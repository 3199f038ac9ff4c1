"""The README is a landing page and docs/ the manual: every relative link resolves (its
anchor too), every repository path and compile_rng module a page names exists, and the
README's commands are the ones CI runs. A scan of text: no torch, no compile."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:compile_rng|passes|examples|benchmarks|tests|docs|\.ci)/[\w./-]*)`")
MODULE = re.compile(r"`(compile_rng(?:\.\w+)+)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    fence, found = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            found.add(_slug(line.lstrip("#")))
    return found


def _prose(page: Path) -> str:
    """The page without its code blocks (commands and printed tables are not references)."""
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    return broken


@pytest.mark.torch_independent
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_paths_and_modules_exist(page):
    assert _broken_links(page) == []
    text = _prose(page)
    missing = [p for p in PATH.findall(text) if "*" not in p and not (ROOT / p.rstrip(".")).exists()]
    assert missing == []
    for name in MODULE.findall(text):
        parts = name.split(".")
        # the longest prefix that is a module or package; what follows must be defined in it
        for n in range(len(parts), 0, -1):
            base = ROOT / Path(*parts[:n]) if parts[1:2] != ["passes"] else ROOT / "passes" / Path(*parts[2:n])
            source = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.exists()), None)
            if source is not None:
                rest = parts[n:]
                assert not rest or re.search(rf"\b{rest[0]}\b", source.read_text()), (name, source)
                break
        else:
            pytest.fail(f"{page.name} names {name}, which is no compile_rng module")


@pytest.mark.torch_independent
def test_the_readme_is_a_landing_page_whose_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    commands = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1)
    assert [line.split("#")[0].strip() for line in commands.strip().splitlines()] == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^phase \"make test \(torch [\d.]+\)\" make test$", ci, flags=re.M)  # the README's test command
    # every page of the manual is reachable from the README's table of contents
    linked = {Path(t).name for t in LINK.findall(readme) if t.startswith("docs/")}
    assert {p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md"} <= linked


@pytest.mark.torch_independent
def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n[ok](a.md#title) [no](b.md) [no anchor](a.md#other)\n")
    assert _broken_links(tmp_path / "a.md") == ["b.md", "a.md#other"]
