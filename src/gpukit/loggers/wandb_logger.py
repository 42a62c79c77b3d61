"""``WandbLogger``: the run in Weights & Biases, offline unless there is an API key.

Through ``wandb`` (``pip install "gpukit[wandb]"``). Without ``WANDB_API_KEY`` the run is
written offline under ``folder/wandb/`` (no network, no login prompt; upload it later with
``wandb sync``); with the key it goes online; ``mode=`` or ``WANDB_MODE`` choose explicitly.
The run starts at the first record, so the logger can travel to the processes ``rt.launch``
starts. wandb's console capture is off: the training's output stays as it was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpukit import _env
from gpukit.loggers.base import BaseLogger, require


class WandbLogger(BaseLogger):
    """A W&B run in ``project`` (``name``: the run's, default wandb's), files under
    ``folder`` (default: the current folder); ``mode``: "offline", "online" or "disabled"
    (default: "offline" without an API key, else wandb's own choice). ``init`` passes further
    keywords to ``wandb.init``."""

    name = "wandb"

    def __init__(
        self,
        project: str = "gpukit",
        folder: str | os.PathLike[str] | None = None,
        *,
        mode: str | None = None,
        run_name: str | None = None,
        **init: Any,
    ) -> None:
        require("wandb", "wandb", "WandbLogger")
        self.project = project
        self.folder = Path(folder) if folder is not None else None
        if mode is None and not _env.wandb_mode() and not _env.wandb_api_key():
            mode = "offline"
        self.mode = mode
        self.run_name = run_name
        self.init = init
        self._run: Any = None

    def _open(self) -> Any:
        if self._run is None:
            import wandb

            if self.folder is not None:
                self.folder.mkdir(parents=True, exist_ok=True)
            settings = wandb.Settings(console="off", silent=True)
            self._run = wandb.init(
                project=self.project,
                dir=None if self.folder is None else str(self.folder),
                mode=self.mode,  # type: ignore[arg-type]  # checked by wandb
                name=self.run_name,
                settings=settings,
                reinit="create_new",
                **self.init,
            )
        return self._run

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """``params`` into the run's config."""
        self._open().config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """``metrics`` at ``step`` (wandb keeps steps increasing: a record at an earlier step
        than the last is dropped by wandb, with its warning)."""
        self._open().log(metrics, step=step)

    def finalize(self, status: str) -> None:
        """Finish the run: exit code 0 on success, 1 otherwise."""
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_run": None}

    def __repr__(self) -> str:
        return f"WandbLogger(project={self.project!r}, folder={str(self.folder)!r})"
