"""``MLflowLogger``: the run in MLflow, a local folder needing no server.

Through ``mlflow`` (``pip install "gpukit[mlflow]"``: the ``mlflow-skinny`` package is
enough). ``MLflowLogger(folder)`` keeps the runs in MLflow's file store in that folder (view
them with ``mlflow ui --backend-store-uri FOLDER``); MLflow 3 keeps that store only on request,
so for a folder gpukit sets ``MLFLOW_ALLOW_FILE_STORE=true`` unless it is set already.
``tracking_uri=`` names any other store or server as MLflow spells it (``sqlite:///mlflow.db``,
``http://host:5000``). The run is made at the first record, so the logger can travel to the
processes ``rt.launch`` starts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from gpukit import _env
from gpukit.errors import ConfigError
from gpukit.loggers.base import BaseLogger, plain_params, require

# MLflow refuses longer parameter values.
_MAX_PARAM = 6000


class MLflowLogger(BaseLogger):
    """Metrics and parameters of one MLflow run in ``experiment`` (made when missing), in the
    file store ``folder`` or at ``tracking_uri``."""

    name = "mlflow"

    def __init__(
        self,
        folder: str | os.PathLike[str] | None = None,
        *,
        tracking_uri: str | None = None,
        experiment: str = "gpukit",
        run_name: str | None = None,
    ) -> None:
        require("mlflow", "mlflow", "MLflowLogger")
        if (folder is None) == (tracking_uri is None):
            raise ConfigError(
                "MLflowLogger needs one place for its runs: a folder (MLflowLogger('mlruns')) "
                "or a tracking_uri (MLflowLogger(tracking_uri='http://host:5000'))"
            )
        self.folder = Path(folder) if folder is not None else None
        self.tracking_uri = tracking_uri or Path(str(folder)).resolve().as_uri()
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str | None = None
        self._client: Any = None

    def _open(self) -> Any:
        if self._client is None:
            if self.folder is not None:
                _env.allow_mlflow_file_store()
                self.folder.mkdir(parents=True, exist_ok=True)
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=self.tracking_uri)
            found = client.get_experiment_by_name(self.experiment)
            experiment = found.experiment_id if found else client.create_experiment(self.experiment)
            self.run_id = client.create_run(experiment, run_name=self.run_name).info.run_id
            self._client = client
        return self._client

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """``params`` as the run's parameters (as text; MLflow keeps a parameter's first
        value)."""
        from mlflow.entities import Param

        client = self._open()
        items = [Param(k, str(v)[:_MAX_PARAM]) for k, v in plain_params(params).items()]
        client.log_batch(self.run_id, params=items)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """``metrics`` at ``step``, in one batch."""
        from mlflow.entities import Metric

        client = self._open()
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        client.log_batch(self.run_id, metrics=items)

    def finalize(self, status: str) -> None:
        """End the run: FINISHED on success, FAILED otherwise."""
        if self._client is not None:
            state = "FINISHED" if status == "success" else "FAILED"
            self._client.set_terminated(self.run_id, state)
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    def __repr__(self) -> str:
        return f"MLflowLogger(tracking_uri={self.tracking_uri!r})"
