"""A small report document rendered two ways: self-contained HTML and Markdown with PNGs beside it.

The HTML file carries its images as base64 ``data:`` URIs and its CSS inline, so it opens in a
browser with no network and can be mailed as one file. The Markdown file links ``plots/NAME.png``
written next to it (the same bytes), for reading on a code host. Every string is escaped for the
medium (:mod:`dwise_predict.text`): names from data never become HTML, a link or a broken table.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dwise_predict.files import atomic_write
from dwise_predict.text import html_text, markdown, markdown_line

PLOTS_DIR = "plots"
HTML_END = "</body></html>"
# where the sections :func:`add_sections` put into a written report begin (a comment in both media):
# the next call replaces everything from here, so adding the same sections again gives the same file
ADDED_MARK = "<!-- sections added to the written report -->"
# Cells that read as numbers (right-aligned): 0.123, -0.1 → 0.2, 12.5%, [0.1, 0.3], n/a.
_NUMERIC = re.compile(r"^(n/a|[-+\[\d.][\d.,%\s\]\[→–n/a+-]*)$")

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 70rem;
       padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; } h2 { font-size: 1.25rem; margin-top: 2rem;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; }
p.meta { color: #666; font-size: 0.9rem; margin: 0.1rem 0; }
table { border-collapse: collapse; margin: 0.6rem 0 1rem; font-size: 0.88rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.55rem; text-align: left; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
caption { caption-side: top; text-align: left; font-weight: 600; padding-bottom: 0.3rem; }
figure { display: inline-block; margin: 0.5rem 1rem 1rem 0; vertical-align: top; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85rem; color: #555; max-width: 40rem; }
"""


@dataclass
class Table:
    """A table of already formatted cells (strings)."""

    columns: list[str]
    rows: list[list[str]]
    caption: str = ""


@dataclass
class Figure:
    """A PNG image; ``name`` becomes ``plots/<name>.png`` beside the Markdown file."""

    name: str
    png: bytes
    caption: str = ""


@dataclass
class Section:
    title: str
    text: str = ""
    blocks: list[Table | Figure | str] = field(default_factory=list)  # str = a paragraph


@dataclass
class Document:
    title: str
    meta: list[str] = field(default_factory=list)  # provenance lines under the title
    sections: list[Section] = field(default_factory=list)

    def figures(self) -> list[Figure]:
        return [b for s in self.sections for b in s.blocks if isinstance(b, Figure)]


def fmt_pm(stat: dict) -> str:
    """A ``{"mean", "sd"}`` cell (:func:`dwise_predict.metrics.mean_sd`): "mean ± sd", "n/a" without a mean."""
    return "n/a" if stat["mean"] is None else f"{fmt(stat['mean'])} ± {fmt(stat['sd'])}"


def fmt_interval(interval, digits: int = 3) -> str:
    """A ``[lo, hi]`` interval cell, "" without one (None)."""
    return "" if interval is None else f"[{fmt(float(interval[0]), digits)}, {fmt(float(interval[1]), digits)}]"


def fmt(value, digits: int = 3) -> str:
    """A table cell: None → "n/a", floats to ``digits`` decimals, the rest as text."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _html_cells(row: list[str]) -> str:
    return "".join(
        f'<td class="num">{html_text(c)}</td>' if _NUMERIC.match(c) else f"<td>{html_text(c)}</td>" for c in row
    )


def to_html(doc: Document) -> str:
    """The whole document as one HTML string (images inline as data URIs)."""
    e = html_text
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(doc.title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{e(doc.title)}</h1>",
    ]
    parts += [f'<p class="meta">{e(line)}</p>' for line in doc.meta]
    for section in doc.sections:
        parts += _section_html(section)
    parts.append(HTML_END)
    return "\n".join(parts) + "\n"


def _section_html(section: Section) -> list[str]:
    """A section's HTML lines: its heading, text and blocks (figures inline as data URIs)."""
    e = html_text
    parts = [f"<h2>{e(section.title)}</h2>"]
    if section.text:
        parts.append(f"<p>{e(section.text)}</p>")
    for block in section.blocks:
        if isinstance(block, str):
            parts.append(f"<p>{e(block)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{e(c)}</th>" for c in block.columns)
            body = "".join(f"<tr>{_html_cells(row)}</tr>" for row in block.rows)
            caption = f"<caption>{e(block.caption)}</caption>" if block.caption else ""
            parts.append(f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            data = base64.b64encode(block.png).decode("ascii")
            parts.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{e(block.caption or block.name)}">'
                f"<figcaption>{e(block.caption)}</figcaption></figure>"
            )
    return parts


def to_markdown(doc: Document) -> str:
    """The document as Markdown; figures link ``plots/<name>.png``."""
    lines = [f"# {markdown_line(doc.title)}", ""]
    lines += [f"{markdown_line(line)}  " for line in doc.meta]
    for section in doc.sections:
        lines += _section_markdown(section)
    return "\n".join(lines).rstrip() + "\n"


def _section_markdown(section: Section) -> list[str]:
    """A section's Markdown lines, from the blank line before its heading; figures link ``plots/<name>.png``."""
    lines = ["", f"## {markdown_line(section.title)}", ""]
    if section.text:
        lines += [markdown(section.text), ""]
    for block in section.blocks:
        if isinstance(block, str):
            lines += [markdown(block), ""]
        elif isinstance(block, Table):
            if block.caption:
                lines += [f"**{markdown_line(block.caption)}**", ""]
            lines.append("| " + " | ".join(markdown_line(c) for c in block.columns) + " |")
            lines.append("|" + "|".join(["---"] * len(block.columns)) + "|")
            lines += ["| " + " | ".join(markdown_line(c) for c in row) + " |" for row in block.rows]
            lines.append("")
        else:
            lines += [f"![{markdown_line(block.name)}]({PLOTS_DIR}/{block.name}.png)", ""]
            if block.caption:
                lines += [f"*{markdown_line(block.caption)}*", ""]
    return lines


def write_document(doc: Document, out_dir: str | os.PathLike, stem: str = "report") -> tuple[Path, Path]:
    """Write ``<stem>.html``, ``<stem>.md`` and ``plots/*.png`` into ``out_dir`` (each atomically).

    Returns
    -------
    (html_path, markdown_path)
    """
    out = Path(out_dir)
    _write_plots(doc.figures(), out)
    html_path, md_path = out / f"{stem}.html", out / f"{stem}.md"
    # a path of bytes that are not UTF-8 (Python holds them as lone surrogates) shows as its escape, \udcff
    atomic_write(html_path, lambda tmp: tmp.write_text(to_html(doc), encoding="utf-8", errors="backslashreplace"))
    atomic_write(md_path, lambda tmp: tmp.write_text(to_markdown(doc), encoding="utf-8", errors="backslashreplace"))
    return html_path, md_path


def add_sections(sections: list[Section], out_dir: str | os.PathLike, stem: str = "report") -> tuple[Path, Path]:
    """Put ``sections`` at the end of the ``<stem>.html`` and ``<stem>.md`` that :func:`write_document`
    wrote in ``out_dir`` (their figures into ``plots/``), replacing the sections an earlier call added:
    for a report whose own content cannot be rebuilt (its arrays are gone) but whose readers want more
    beside it. Each file is rewritten atomically.

    Returns
    -------
    (html_path, markdown_path)
    """
    out = Path(out_dir)
    html_path, md_path = out / f"{stem}.html", out / f"{stem}.md"
    html, md = html_path.read_text(encoding="utf-8"), md_path.read_text(encoding="utf-8")
    html_head = html.split(ADDED_MARK)[0] if ADDED_MARK in html else html[:html.rindex(HTML_END)]
    html_added = [line for section in sections for line in _section_html(section)]
    html = html_head + "\n".join([ADDED_MARK, *html_added, HTML_END]) + "\n"
    md_added = [line for section in sections for line in _section_markdown(section)]
    md = "\n".join([md.split(ADDED_MARK)[0].rstrip("\n"), "", ADDED_MARK, *md_added]).rstrip() + "\n"
    _write_plots(Document("", [], sections).figures(), out)
    atomic_write(html_path, lambda tmp: tmp.write_text(html, encoding="utf-8", errors="backslashreplace"))
    atomic_write(md_path, lambda tmp: tmp.write_text(md, encoding="utf-8", errors="backslashreplace"))
    return html_path, md_path


def _write_plots(figures: list[Figure], out: Path) -> None:
    """Each figure as ``out/plots/<name>.png`` (the Markdown's links), atomically."""
    (out / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
    for figure in figures:
        atomic_write(out / PLOTS_DIR / f"{figure.name}.png", lambda tmp, png=figure.png: tmp.write_bytes(png))
