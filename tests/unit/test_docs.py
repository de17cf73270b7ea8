"""Every citation in the repository points at a file (and a heading) that exists.

Why: docs are users' documents and the code's docstrings send readers to them; a link to
a file that was renamed, split or never committed sends a reader nowhere. Checked here:

- every relative Markdown link ``[text](target)`` in README.md, CONTRIBUTING.md,
  CHANGELOG.md, docs/*.md and benchmarks/*.md resolves to an existing file, and its
  ``#anchor`` (or a bare ``(#anchor)``) to a heading of the target, slugged as GitHub does;
- every ``.md`` path those documents name in their text (``docs/SCREENED.md``,
  ``benchmarks/<record>.md``, a bare ``COMPILE.md``) exists;
- every ``docs/<name>.md`` or ``<NAME>.md`` a .py / .c / .h file of the package, the
  tests, the examples or csrc/ cites (docstrings and comments) exists;
- README, CONTRIBUTING and DESIGN give the layers in one order, in the same words;
- no file in docs/ is longer than 400 lines (dated runs belong in benchmarks/, one record
  per run).

Self-contained on purpose (standard library only, no sdc_guard import): it reads the tree.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "pyproject.toml").is_file() and ROOT != ROOT.parent:  # tests/ may nest
    ROOT = ROOT.parent

#: The users' documents whose links must resolve.
DOCUMENTS = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
    + list((ROOT / "docs").glob("*.md"))
    + list((ROOT / "benchmarks").glob("*.md"))
)
#: Where cited source files live.
SOURCE_DIRS = ("sdc_guard", "tests", "examples", "csrc")
SOURCE_SUFFIXES = {".py", ".c", ".h", ".cpp", ".cu"}
MAX_DOC_LINES = 400

_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+|mailto:\S+")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
# A path ending in .md as prose names it: optional folders, then a name.
_MD_PATH = re.compile(r"(?<![\w/.<>*-])((?:[\w.-]+/)*[\w-]+\.md)(?![\w/-])")
# What code cites: docs/<name>.md, benchmarks/<name>.md or an upper-case <NAME>.md.
_CODE_CITE = re.compile(r"(?<![\w/.-])((?:docs|benchmarks)/[\w.-]+\.md|[A-Z][A-Z0-9_]*\.md)(?![\w/-])")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file's headings define (duplicates get ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    for line in text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = _slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _prose(path: Path) -> str:
    """A document's text without its code blocks (commands and raw output) or URLs."""
    return _URL.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))


def _resolve(name: str, base: Path) -> Path | None:
    """A cited path: relative to the citing file's folder, the repository root, docs/ or
    benchmarks/ (a record is often named by its file name alone)."""
    for folder in (base, ROOT, ROOT / "docs", ROOT / "benchmarks"):
        candidate = (folder / name).resolve()
        if candidate.exists():
            return candidate
    return None


def broken_links(doc: Path) -> list[str]:
    """The relative links of one document that lead to no file or no heading."""
    bad = []
    for target in _LINK.findall(_prose(doc)):
        if _URL.match(target) or target.startswith("mailto:"):
            continue
        path_part, _, anchor = target.partition("#")
        dest = doc if not path_part else (doc.parent / path_part).resolve()
        if not dest.exists():
            bad.append(f"{target}: no file {path_part}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def missing_md_paths(doc: Path) -> list[str]:
    """The .md paths a document's prose names that do not exist."""
    return sorted({name for name in _MD_PATH.findall(_prose(doc)) if _resolve(name, doc.parent) is None})


def source_files() -> list[Path]:
    files = [ROOT / "setup.py"]
    for folder in SOURCE_DIRS:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in SOURCE_SUFFIXES]
    this = Path(__file__).resolve()  # its own examples of broken citations are made up
    return sorted(p for p in files if p.is_file() and ".venv" not in p.parts and p.resolve() != this)


def missing_code_citations(path: Path) -> list[str]:
    """The docs a source file cites that are not in the repository."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return sorted({name for name in _CODE_CITE.findall(text) if _resolve(name, path.parent) is None})


def test_the_documents_exist() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCUMENTS}
    assert {"README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/ALGORITHM.md"} <= names
    assert any(n.startswith("benchmarks/") for n in names)


def test_every_relative_link_resolves() -> None:
    bad = {p.relative_to(ROOT).as_posix(): broken_links(p) for p in DOCUMENTS}
    assert not {k: v for k, v in bad.items() if v}


def test_every_md_path_named_in_the_documents_exists() -> None:
    bad = {p.relative_to(ROOT).as_posix(): missing_md_paths(p) for p in DOCUMENTS}
    assert not {k: v for k, v in bad.items() if v}


def test_every_doc_cited_in_code_exists() -> None:
    files = source_files()
    assert len(files) > 50  # the scan reaches the package, the tests and csrc/
    bad = {p.relative_to(ROOT).as_posix(): missing_code_citations(p) for p in files}
    assert not {k: v for k, v in bad.items() if v}


def _layers_sentence(path: Path) -> str:
    text = " ".join(path.read_text(encoding="utf-8").split())
    m = re.search(r"The layers import downwards only: (.*?\))\.", text)
    assert m, f"{path.name} does not give the layers' order"
    return m.group(1)


def test_one_order_of_the_layers() -> None:
    """README, CONTRIBUTING and DESIGN give the layers in the same order, in the same words."""
    said = {p: _layers_sentence(ROOT / p) for p in ("README.md", "CONTRIBUTING.md", "docs/DESIGN.md")}
    assert len(set(said.values())) == 1, said
    assert said["CONTRIBUTING.md"].startswith("`core/` <- `kernels/` <- `backends/` <- `respond/` <- `runtime/`")


def test_no_doc_over_the_limit() -> None:
    long = {
        p.name: n
        for p in (ROOT / "docs").glob("*.md")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_DOC_LINES
    }
    assert not long, f"docs over {MAX_DOC_LINES} lines (split them, dated runs go to benchmarks/): {long}"


def test_the_checker_catches_what_it_is_for(tmp_path: Path) -> None:
    """A wrong checker (one that passes everything) fails here: broken cases are caught."""
    (tmp_path / "A.md").write_text("# Title `x`\n\n## Two words\n", encoding="utf-8")
    doc = tmp_path / "B.md"
    doc.write_text(
        "[ok](A.md) [ok](A.md#title-x) [ok](A.md#two-words) [ok](#own) [web](https://x.org/a.md)\n"
        "[gone](GONE.md) [bad anchor](A.md#three) [bad own](#nowhere)\n\n## Own\n"
        "See NOWHERE_ELSE.md and A.md.\n```\nNOT_CHECKED_IN_CODE_BLOCK.md\n```\n",
        encoding="utf-8",
    )
    assert broken_links(doc) == [
        "GONE.md: no file GONE.md",
        "A.md#three: no heading #three in A.md",
        "#nowhere: no heading #nowhere in B.md",
    ]
    assert missing_md_paths(doc) == ["GONE.md", "NOWHERE_ELSE.md"]  # the link target too
    src = tmp_path / "m.py"
    src.write_text('"""See docs/ALGORITHM.md and GONE_SPEC.md."""\n', encoding="utf-8")
    assert missing_code_citations(src) == ["GONE_SPEC.md"]
