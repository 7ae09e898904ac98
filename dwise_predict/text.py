"""Text from data (a category, a model, a workload, a source) escaped for the medium it lands in.

Names come from trace datasets, workload specs and manifests that anyone may write, and each medium
obeys some of their characters: a terminal runs escape sequences (a window title, a cleared screen)
and rich reads ``[bold]`` or ``[link=...]`` as markup (a stray ``[/x]`` is an error); Markdown, once
rendered, runs raw HTML (``<img onerror=...>``) and follows links; a spreadsheet runs a cell that
starts with ``=``, ``+``, ``-`` or ``@`` as a formula; matplotlib parses text between two ``$`` as
mathtext (an unbalanced ``$\\frac{$`` raises). Every sink passes data through the function of its
medium here:

- :func:`visible`: control and other unprintable characters as their escapes (``\\x1b``, ``\\n``,
  ``\\u2028``), so a line stays one line and the terminal obeys nothing;
- :func:`terminal`: :func:`visible` plus rich's markup escape, for any string rich renders (a table
  cell or title, a printed line);
- :func:`markdown` and :func:`markdown_line`: ``<`` and ``&`` as entities, a link's
  ``](`` broken, and (one line: a table cell, a heading) pipes escaped and line breaks flattened;
- :func:`json_for_markdown`: JSON inside Markdown, a backtick and HTML's characters as JSON escapes;
- :func:`html_text`: HTML's escape, control characters as :func:`visible` writes them (a browser
  drops them, but a terminal that shows the file runs them);
- :func:`csv_cell`: the OWASP convention against formula injection, for text cells only;
- :func:`plot_label`: :func:`visible` with ``$`` escaped, so matplotlib shows a name as written.

Ordinary names (letters, digits, ``_``, ``-``, spaces, non-ASCII letters) come out unchanged in
every medium. Standard library only (rich is imported when a terminal string is made), so any
module may import it.
"""

from __future__ import annotations

import html
import re

# what a spreadsheet reads as the start of a formula (OWASP's CSV injection list)
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
# a cell that is a number as written ("-0.25", "+3", "-1e-05", "-inf") is data, never a formula
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)
# "<" opens every tag and autolink, "&" an entity; ">" alone opens nothing (prose such as "r > 0.99" keeps it)
_MARKDOWN_HTML = str.maketrans({"&": "&amp;", "<": "&lt;"})
_JSON_IN_MARKDOWN = str.maketrans({c: f"\\u{ord(c):04x}" for c in "`<>&"})


def _escaped(char: str) -> str:
    return char if char.isprintable() else char.encode("unicode_escape").decode("ascii")


def visible(text: str, keep: str = "") -> str:
    """``text`` with every unprintable character (control characters, ESC, line and paragraph
    separators, format characters such as bidi overrides) written as its Python escape, the way
    ``repr`` shows it but without quotes or doubled backslashes; characters in ``keep`` stay."""
    if text.isprintable():  # the common case: nothing to do
        return text
    return "".join(c if c in keep else _escaped(c) for c in text)


def terminal(text: str) -> str:
    """``text`` for rich (a table cell or title, a printed line): nothing in it runs or styles."""
    from rich.markup import escape

    return escape(visible(text))


def markdown(text: str) -> str:
    """``text`` for Markdown prose: no raw HTML or autolink (``<`` and ``&`` as entities), no link
    (``](`` broken), no control characters; line breaks and tabs kept."""
    return visible(text, keep="\n\t").translate(_MARKDOWN_HTML).replace("](", "]\\(")


def markdown_line(text: str) -> str:
    """``text`` for one Markdown line (a table cell, a heading): :func:`markdown`, pipes escaped and
    line breaks flattened to spaces."""
    return markdown(text).replace("|", "\\|").replace("\n", " ")


def json_for_markdown(dumped: str) -> str:
    """JSON text inside Markdown (a fenced code block, a card's front matter, which a renderer that
    knows no front matter reads as prose): a backtick, which could close the fence, and ``<``, ``>``,
    ``&`` as their JSON escapes; the same JSON (and YAML) value."""
    return dumped.translate(_JSON_IN_MARKDOWN)


def html_text(text: str) -> str:
    """``text`` for HTML content or a quoted attribute: HTML's escape, and no control character but a
    line break or tab (HTML forbids them, and ``cat report.html`` would run them)."""
    return html.escape(visible(text, keep="\n\t"))


def csv_cell(value):
    """A CSV cell that a spreadsheet will not run and ``cat`` shows as written: a text cell's control
    characters but tab and line breaks (which the CSV writer quotes) written as escapes, and a text
    cell starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return gets a leading ``'``
    (OWASP's convention), unless it is a number as written; numbers and every other value pass unchanged."""
    if not isinstance(value, str):
        return value
    value = visible(value, keep="\t\r\n")
    if value.startswith(_FORMULA_START) and not _NUMBER.fullmatch(value):
        return "'" + value
    return value


def plot_label(text: str) -> str:
    """``text`` for a matplotlib label, title or tick: shown as written, never parsed as mathtext."""
    return visible(text).replace("$", r"\$")


def first_names(names, shown: int = 8) -> str:
    """``a, b, c and 7 more``: a list a one-line error can hold, whatever the input's length (a user's
    list of 10,000 names must not become a 69 KB line)."""
    names = [str(name) for name in names]
    more = f" and {len(names) - shown:,} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
