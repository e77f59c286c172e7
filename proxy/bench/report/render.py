"""The report's document rendered twice from one list of blocks: Markdown (``report.md``) and self-contained HTML
(``report.html``: the charts inlined), so both say the same."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from pathlib import Path

from proxy.bench.report.blocks import Block


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render_md(blocks: Sequence[Block]) -> str:
    lines: list[str] = []
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            lines += ["#" * int(b.kind[1]) + " " + b.text, ""]
        elif b.kind == "p":
            lines += [b.text, ""]
        elif b.kind == "ul":
            lines += [f"- {i}" for i in b.items] + [""]
        elif b.kind == "table":
            lines.append("| " + " | ".join(map(_md_cell, b.header)) + " |")
            lines.append("|" + "|".join("---" for _ in b.header) + "|")
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in b.rows]
            lines.append("")
        elif b.kind == "img":
            lines += [f"![{b.text}]({b.path})", ""]
    return "\n".join(lines)


def _inline(s: str) -> str:
    """HTML-escape, then the bits of Markdown we use: **bold**, *italic* and `code`."""
    e = html.escape(s)
    e = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", e)
    e = re.sub(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])", r"<em>\1</em>", e)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", e)


_CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;
text-align:left}th{background:#f3f3f3}code{background:#f3f3f3;padding:0 3px}img{max-width:100%}
h3 strong{padding:1px 6px;border-radius:3px;background:#eee}"""


def render_html(blocks: Sequence[Block], out: Path) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>enginemeter report</title>",
        f"<style>{_CSS}</style></head><body>",
    ]
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            slug = re.sub(r"[^a-z0-9]+", "-", b.text.lower()).strip("-")[:60]
            parts.append(f"<{b.kind} id='{html.escape(slug)}'>{_inline(b.text)}</{b.kind}>")
        elif b.kind == "p":
            parts.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif b.kind == "table":
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.header)
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in b.rows)
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif b.kind == "img":
            data = base64.b64encode((out / b.path).read_bytes()).decode()
            mime = "image/svg+xml" if b.path.endswith(".svg") else "image/png"
            parts.append(f"<img alt='{html.escape(b.text)}' src='data:{mime};base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)
