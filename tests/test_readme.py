"""The README stays a front page (issue 47): short table cells, every figure in a table row with its
source link, and every relative link of the README and docs/ landing on a file (and heading) that
exists."""

import os
import re

from conftest import REPO

README = os.path.join(REPO, "README.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _table_rows(text):
    return [line for line in text.splitlines() if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line)]


def _cells(row):
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_no_readme_table_cell_is_over_300_characters():
    long = [(len(cell), cell[:80]) for row in _table_rows(open(README).read()) for cell in _cells(row)
            if len(cell) > 300]
    assert long == []


def _tables(text):
    """``(the paragraph that introduces the table, its rows)`` for each table of ``text``."""
    found, paragraph, intro, rows, intro_open = [], [], [], [], False
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            intro = intro or paragraph
            rows.append(line)
            continue
        if rows:
            found.append((" ".join(intro), rows))
            intro, rows = [], []
        if line.strip():
            paragraph = (paragraph if intro_open else []) + [line]
            intro_open = True
        else:
            intro_open = False
    return found


def test_every_readme_table_row_with_a_measured_figure_links_its_source():
    """A table row that shows a measured number (x, %, s, e-notation, KL) carries a link to the page
    where it was measured, or its table's introducing paragraph does."""
    figure = re.compile(r"\d(\.\d+)?(x|%| s\b)|\d\.\d+e[-+]\d+|KL")
    missing = [row[:100] for intro, rows in _tables(open(README).read()) for row in rows
               if figure.search(row) and not LINK.search(row) and not LINK.search(intro)]
    assert missing == []


def _anchors(path):
    """GitHub's anchors of a Markdown file's headings."""
    found = set()
    for line in open(path):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            found.add(title)
    return found


def _broken_links(path):
    broken = []
    text = open(path).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are not links
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file))
        if not os.path.exists(resolved):
            broken.append(target)
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            broken.append(target)
    return broken


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [README] + [os.path.join(REPO, "docs", name) for name in sorted(os.listdir(os.path.join(REPO, "docs")))
                        if name.endswith(".md")]
    broken = {os.path.relpath(page, REPO): _broken_links(page) for page in pages}
    assert {page: links for page, links in broken.items() if links} == {}


def test_the_link_check_catches_a_missing_page_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# A heading\n")
    page.write_text("[ok](other.md#a-heading) [gone](missing.md) [no heading](other.md#nothing) "
                    "[web](https://example.org/x)\n")
    assert _broken_links(str(page)) == ["missing.md", "other.md#nothing"]
