"""Several views shown together: ``group`` and the ``Group`` it makes (a result's ``.show()``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tl_dynamics.viz._component import WRITERS, Component, html_escape, standalone_html


def group(*components: Component | Group, caption: str = "", row: bool = False) -> Group:
    """Components (or groups) shown together.

    Args:
        *components: The views, in order.
        caption: Text above them.
        row: Lay them side by side, wrapping as needed (default: one under the other).

    Returns:
        A ``Group``.

    Example:
        >>> from tl_dynamics import viz
        >>> group(viz.text("a"), viz.text("b"), row=True)
        Group(Component(html, 8 chars), Component(html, 8 chars))
    """
    return Group(tuple(components), caption, row)


@dataclass(frozen=True, repr=False)
class Group:
    """Several components shown together (e.g. a result's ``.show()``); made by ``group``.

    Args:
        components: The views (components or groups), in order.
        caption: Text above them.
        row: Lay them side by side.

    Example:
        >>> from tl_dynamics import viz
        >>> len(viz.group(viz.text("a"), viz.heatmap([[1.0]])).components)
        2
    """

    components: tuple[Component | Group, ...]
    caption: str = ""
    row: bool = False

    def fragment(self, nonce: str) -> str:
        """HTML of the views for a page that has loaded the bundle and the runtime.

        Args:
            nonce: The page's script nonce.

        Returns:
            The caption and each view's ``Component.fragment``, in a row when ``row`` is set.

        Example:
            >>> from tl_dynamics import viz
            >>> viz.group(viz.text("a"), caption="c").fragment("n")
            '<p class="caption">c</p><div class="tld-html"><p>a</p></div>'
        """
        head = f'<p class="caption">{html_escape(self.caption)}</p>' if self.caption else ""
        if self.row:
            cells = "".join(
                f'<div class="tld-cell">{c.fragment(nonce)}</div>' for c in self.components
            )
            return f'{head}<div class="tld-row">{cells}</div>'
        return head + "".join(c.fragment(nonce) for c in self.components)

    def needs_bundle(self) -> bool:
        """Whether circuitsvis draws one of the views (a page then inlines its bundle).

        Returns:
            True when some component needs the bundle.

        Example:
            >>> from tl_dynamics import viz
            >>> viz.group(viz.text("a"), viz.heatmap([[1.0]])).needs_bundle()
            False
        """
        return any(c.needs_bundle() for c in self.components)

    def __repr__(self) -> str:
        return f"Group({', '.join(map(repr, self.components))})"

    def _repr_html_(self) -> str:
        return standalone_html(list(self.components), self.caption)

    def show(self) -> "Group":
        """The group itself, for a notebook cell to display.

        Returns:
            This group.

        Example:
            >>> from tl_dynamics import viz
            >>> g = viz.group(viz.text("a"))
            >>> g.show() is g
            True
        """
        return self

    def save(self, path: Any) -> Path:
        """Write the views together to a file (as ``Component.save``; ``.svg`` when every view has one).

        Args:
            path: The file to write: ``.html``, ``.svg`` or ``.png``.

        Returns:
            The path written.

        Example:
            >>> import tempfile, pathlib
            >>> from tl_dynamics import viz
            >>> out = pathlib.Path(tempfile.mkdtemp()) / "views.html"
            >>> viz.group(viz.text("a"), viz.text("b")).save(out).suffix
            '.html'
        """
        return WRITERS["save"](self, path)
