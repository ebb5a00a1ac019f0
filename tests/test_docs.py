"""README.md, docs/*.md and the results index stay short, linked and complete (no model needed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), INDEX]


def _indexed_files() -> set[str]:
    """The files the index names: the backticked names in the first cell of its table rows, each relative
    to the folder its ``## `folder/` `` heading names (no folder: the top level)."""
    named: set[str] = set()
    folder = ""
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            heading = re.search(r"`([^`]+/)`", line)
            folder = heading.group(1) if heading else ""
        elif line.startswith("| ") and not line.startswith(("| file ", "| ---")):
            first_cell = line.split("|")[1]
            named.update(folder + name for name in re.findall(r"`([^`]+)`", first_cell))
    return named


def test_results_index_names_every_results_file():
    on_disk = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != INDEX}
    named = _indexed_files()
    assert not on_disk - named, f"results files the index does not name: {sorted(on_disk - named)}"
    assert not named - on_disk, f"the index names files that do not exist: {sorted(named - on_disk)}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_results_doc_names_existing_files():
    # docs/results.md names the results file of every figure, relative to benchmarks/results/.
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    names = re.findall(r"`([\w./*-]+(?:/|\.md|\.json|\.jsonl|\.png|\.safetensors))`", text)
    missing = [
        n for n in names if not list(RESULTS.glob(n.rstrip("/"))) and not list(ROOT.glob(n.rstrip("/")))
    ]
    assert names and not missing, missing


def test_readme_is_short_with_the_quickstart_first():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; details belong in docs/"
    quickstart = [i for i, line in enumerate(lines) if line.startswith("python -m pytest")]
    assert quickstart and quickstart[0] < 60, "the quickstart's two commands must come within 60 lines"
