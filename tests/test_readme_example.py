"""The README's Python example is run as written (issue 42 item 7): load, attach, run_with_cache,
show. Cost: induction-2l, one forward pass, about 2 s."""

import re
from pathlib import Path

from tl_dynamics import odds_ratio, viz

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_python_example_runs_as_written():
    text = README.read_text(encoding="utf-8")
    quick = text[text.index("## Quick start") : text.index("## What each analysis answers")]
    blocks = re.findall(r"```python\n(.*?)```", quick, re.S)
    assert len(blocks) == 1 and len(blocks[0].strip().splitlines()) <= 12, blocks
    for step in ("load_model(", ".attach(", "run_with_cache(", ".show()"):
        assert step in blocks[0], step
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)  # noqa: S102 (the README, as written)
    result = scope["result"]
    assert isinstance(result, odds_ratio.OddsRatioResult) and result.stats.n_prompts == 1
    assert result.stats.layers == (1,) and isinstance(result.show(), viz.Group)
    table = text[text.index("## What each analysis answers") :]
    for name in (
        "atlas",
        "circuits",
        "odds_ratio",
        "contextual_mlp",
        "regression",
        "trajectories",
        "particles",
    ):
        assert f"| `{name}` |" in table, name
