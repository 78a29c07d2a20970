"""``Result``: the notebook face every result class shares (one base, one place).

A bare ``result`` at the end of a notebook cell renders ``_repr_html_``: a short summary table
(each field: a number, a shape, a count) and then the result's own view (``show()``, else its
``to_dataframe()`` as a table). ``repr`` stays short (at most ``MAX_LINES`` lines): arrays and
tensors are summarised by shape and dtype, never printed. A class that writes its own
``__repr__`` keeps it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tl_dynamics.errors import TLDynamicsError

MAX_LINES = 20
_WIDTH = 70


def _scalar(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, (bool, int, float, str))
        or (hasattr(value, "item") and getattr(value, "ndim", None) == 0)
    )


def _clip(text: str, width: int = _WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def brief(value: Any) -> str:
    """One short line saying what ``value`` is (a shape and dtype for arrays and tensors).

    Example:
        >>> import numpy as np
        >>> brief(np.zeros((2, 3))), brief([1, 2]), brief({"a": 1, "b": 2}), brief(0.123456)
        ('ndarray[2, 3] float64', '[1, 2]', "dict of 2: 'a', 'b'", '0.1235')
    """
    if isinstance(value, float):
        return f"{value:.4g}"
    if hasattr(value, "shape") and hasattr(value, "dtype") and not _scalar(value):
        if hasattr(value, "columns"):  # a DataFrame
            return f"DataFrame {value.shape[0]} rows x {value.shape[1]} columns"
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{type(value).__name__}{list(value.shape)} {dtype}"
    if _scalar(value):
        return _clip(repr(value.item() if hasattr(value, "item") else value))
    if isinstance(value, dict):
        keys = ", ".join(repr(k) for k in list(value)[:4]) + (", ..." if len(value) > 4 else "")
        return _clip(f"dict of {len(value)}: {keys}")
    if isinstance(value, (list, tuple)):
        text = repr(value)
        if len(text) <= _WIDTH and "\n" not in text:
            return text
        return _clip(f"{type(value).__name__} of {len(value)}: {brief(value[0])}, ...")
    text = repr(value)
    return text if len(text) <= _WIDTH and "\n" not in text else type(value).__name__


def fields(result: Any) -> list[tuple[str, str]]:
    """``(name, brief(value))`` of a result's fields (a dataclass's, else its public
    attributes)."""
    if dataclasses.is_dataclass(result):
        names = [f.name for f in dataclasses.fields(result)]
    else:
        names = [k for k in vars(result) if not k.startswith("_")]
    return [(name, brief(getattr(result, name, None))) for name in names]


class Result:
    """The notebook face every result class lists among its bases.

    ``_repr_html_`` is a summary table (each field: a number, a shape, a count) and then
    ``show()`` (else ``to_dataframe()`` as a table); ``repr`` is at most ``MAX_LINES`` lines.

    Example:
        >>> import dataclasses, numpy as np
        >>> from tl_dynamics import viz
        >>> @dataclasses.dataclass(frozen=True)
        ... class Scores(viz.Result):
        ...     model: str
        ...     values: np.ndarray
        >>> Scores("code-2l", np.zeros((2, 4)))
        Scores(model='code-2l', values=ndarray[2, 4] float64)
        >>> "<table" in Scores("code-2l", np.zeros((2, 4)))._repr_html_()
        True
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__repr__" not in cls.__dict__:  # set before @dataclass, which keeps one it finds
            cls.__repr__ = Result.__repr__

    def __repr__(self) -> str:
        name, rows = type(self).__name__, fields(self)
        one = f"{name}({', '.join(f'{k}={v}' for k, v in rows)})"
        if len(one) <= 100:
            return one
        shown = rows[: MAX_LINES - 3] if len(rows) > MAX_LINES - 2 else rows
        lines = [f"{name}("] + [f"    {k}={v}," for k, v in shown]
        if len(shown) < len(rows):
            lines.append(f"    ... {len(rows) - len(shown)} more fields")
        return "\n".join([*lines, ")"])

    def _repr_html_(self) -> str:
        import pandas as pd

        from tl_dynamics.viz._group import group
        from tl_dynamics.viz._own_views import table, text

        rows = fields(self)
        summary = table(
            pd.DataFrame({"field": [k for k, _ in rows], "value": [v for _, v in rows]}),
            caption=_clip(repr(self), 200) if type(self).__repr__ is not Result.__repr__ else "",
            max_rows=MAX_LINES,
        )
        views = [summary]
        try:
            if callable(getattr(self, "show", None)):
                views.append(self.show())  # type: ignore[attr-defined]
            elif callable(getattr(self, "to_dataframe", None)):
                frame = self.to_dataframe()  # type: ignore[attr-defined]
                views.append(table(frame, caption="to_dataframe()"))
        except TLDynamicsError as exc:  # nothing to draw: the summary says what there is
            views.append(text(f"show() draws nothing here: {exc}"))
        return group(*views, caption=type(self).__name__)._repr_html_()
