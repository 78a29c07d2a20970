"""mkdocs hook (mkdocs.yml): the home page (docs/index.md) is the README, whose links are
relative to the repository root; on the site they are relative to docs/."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    readme = Path(config.config_file_path).parent / "README.md"
    return readme.read_text(encoding="utf-8").replace("](docs/", "](")
