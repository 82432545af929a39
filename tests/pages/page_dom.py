"""Read a warmcap page back: its elements, the numbers it shows against the JSON they came from,
and any reference to the network (a page must open from disk, offline)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

_VOID = {"meta", "br", "img", "input", "link", "hr", "col", "source", "wbr", "area", "base"}


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    parent: Element | None
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def ancestor(self, tag: str) -> Element | None:
        node = self.parent
        while node is not None and node.tag != tag:
            node = node.parent
        return node


class Page(HTMLParser):
    """Every element of a page, with its attributes and its text (its descendants' included)."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self._open: list[Element] = []
        self.feed(html)
        self.close()
        assert not self._open, f"unclosed elements: {[e.tag for e in self._open]}"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs}, self._open[-1] if self._open else None)
        self.elements.append(el)
        if tag not in _VOID:
            self._open.append(el)

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        assert self._open and self._open[-1].tag == tag, (
            f"</{tag}> closes {self._open[-1].tag if self._open else 'nothing'}"
        )
        self._open.pop()

    def handle_data(self, data: str) -> None:
        for el in self._open:
            el.parts.append(data)

    def with_class(self, cls: str) -> list[Element]:
        return [e for e in self.elements if cls in e.classes]

    def by_id(self, ident: str) -> Element:
        found = [e for e in self.elements if e.attrs.get("id") == ident]
        assert len(found) == 1, f"{len(found)} elements with id {ident!r}"
        return found[0]


def resolve(roots: dict[str, Any], path: str) -> Any:
    """The value at ``path`` (``graphs/0/memory_bytes``, maybe ``plan:``-prefixed) in ``roots``."""
    root, _, rest = path.rpartition(":")
    value = roots[root]
    for part in rest.split("/"):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def shown_equals(text: str, value: Any) -> bool:
    """Whether ``text`` shows ``value`` to the precision it is printed with (``0.123 s``,
    ``0.12 ms``, ``1.50 MiB`` for bytes, ``1.2e-05``, a plain integer or string)."""
    if isinstance(value, str):
        return text == value
    m = re.fullmatch(r"(-?\d+(?:\.(\d+))?(?:e([-+]\d+))?)(?: (s|ms|MiB))?", text.strip())
    if m is None:
        return False
    shown = float(m.group(1))
    decimals = len(m.group(2) or "")
    exponent = int(m.group(3) or 0)
    if m.group(4) == "MiB":
        value = value / 2**20
    elif m.group(4) == "ms":
        value = value * 1e3
    if isinstance(value, int) and m.group(4) is None:
        return shown == value
    return abs(shown - value) <= 0.5 * 10.0 ** (exponent - decimals) * (1 + 1e-9)


def check_numbers(page: Page, roots: dict[str, Any]) -> int:
    """Assert every ``data-json`` number equals its JSON value; return how many were checked."""
    tagged = [e for e in page.elements if "data-json" in e.attrs]
    for e in tagged:
        value = resolve(roots, e.attrs["data-json"])
        assert shown_equals(e.text, value), (
            f"{e.attrs['data-json']}: page shows {e.text!r}, JSON has {value!r}"
        )
    return len(tagged)


_NETWORK = re.compile(r"(https?:|//[a-z0-9]|@import|url\(\s*['\"]?(?!#)|\bsrc\s*=)", re.IGNORECASE)


def network_references(html: str) -> list[str]:
    """Every piece of the page that could reach the network (a URL, an import, an external src)."""
    return [m.group(0) for m in _NETWORK.finditer(html)]
