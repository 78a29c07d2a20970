"""A model loader for ``ray_stats`` that stops a Ray worker at named points until the test kills
it (issue 43's fault tests). Imported on the workers (the test puts this folder on their
``PYTHONPATH``); every point is claimed once across all workers and restarts, through files in
``folder``:

- ``loading``: the first worker to load writes its pid to ``loading.pid`` and waits there;
- ``mid``: the first forward pass over a batch whose text holds ``mid`` does the same
  (``mid.pid``);
- ``hold``: a forward pass over a batch whose text holds ``hold`` writes ``hold.pid`` and waits
  until ``go`` exists (the test kills it after the checkpoint appears, then creates ``go``).

Every process that loads writes ``loaded-PID``, so the test can see which processes a run used.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class KillPoints:
    def __init__(self, name: str, folder: str, points: tuple[str, ...]):
        self.name, self.folder, self.points = name, folder, points

    def __call__(self) -> Any:
        from tl_dynamics import models

        (Path(self.folder) / f"loaded-{os.getpid()}").touch()
        self._claim("loading")
        model = models.resolve(self.name).model
        model.register_forward_pre_hook(self._forward, with_kwargs=True)
        return model

    def _claim(self, point: str) -> bool:
        """Write this pid to ``POINT.pid`` if no process did before; True if this one did."""
        if point not in self.points:
            return False
        try:
            fd = os.open(Path(self.folder) / f"{point}.pid", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        if point != "hold":
            while True:  # the test's SIGKILL ends this process here
                time.sleep(0.05)
        return True

    def _forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("input")
        if not hasattr(tokens, "shape") or tokens.ndim != 2 or tokens.shape[0] < 2:
            return  # the self-check's one-row probe, not a batch of the corpus
        text = " ".join(module.tokenizer.decode(row) for row in tokens)
        if "mid" in text:
            self._claim("mid")
        if "hold" in text and "hold" in self.points:
            self._claim("hold")
            while not (Path(self.folder) / "go").exists():
                time.sleep(0.05)
