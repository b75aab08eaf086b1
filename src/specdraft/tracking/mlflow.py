"""MLflow: a run in ``OUT/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///OUT/mlflow.db``), or in the tracking
server ``MLFLOW_TRACKING_URI`` names; the experiment is ``MLFLOW_EXPERIMENT_NAME``, else ``specdraft``."""

from __future__ import annotations

import os
import re
import time
import warnings

from specdraft.tracking.base import TRACKERS, TrackedRun, Tracker, hyperparameters

DATABASE = "mlflow.db"
ARTIFACTS = "mlartifacts"
EXPERIMENT = "specdraft"


def metric_name(name: str) -> str:
    """``name`` as MLflow accepts it: alphanumerics, ``_ - . : /`` and spaces, no ``.``/``..`` path part (an eval
    drafter's label may be a path such as ``./lr=3e-4/final``)."""
    parts = [re.sub(r"[^\w.\- :]", "_", part) for part in name.split("/")]
    return "/".join("_" if part in ("", ".", "..") else part for part in parts)


def _forget_store(uri: str) -> None:
    """Drop what MLflow keeps per tracking URI for the life of the process (the store, and its SQLAlchemy engine with
    open connections): the database at ``uri`` may be a new file since (an eval rerun replaces its directory whole),
    and the old connections would write into the deleted one ("attempt to write a readonly database"). MLflow has no
    public call for this; both caches are private, hence the guards."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service import utils

    engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(uri, None)
    if engine is not None:
        engine.dispose()
    cached = getattr(utils._tracking_store_registry, "_get_store_with_resolved_uri", None)
    cache_clear = getattr(cached, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


@TRACKERS.register("mlflow")
class MlflowTracker(Tracker):
    """One MLflow run per run directory. The local default is a SQLite store (MLflow 3 refuses its file store
    unless told otherwise); the run id is kept in ``OUT/trackers.json`` and a resumed run logs on into it. MLflow keeps
    every point: what an attempt that died after its last checkpoint logged past it stays beside the resumed run's."""

    package = "mlflow"
    files = (DATABASE, ARTIFACTS)

    def __init__(self, run: TrackedRun) -> None:
        super().__init__(run)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        local = "MLFLOW_TRACKING_URI" not in os.environ
        uri = f"sqlite:///{(run.directory / DATABASE).resolve()}" if local else os.environ["MLFLOW_TRACKING_URI"]
        with warnings.catch_warnings():
            # SQLAlchemy 2.1 deprecates the ``noload`` strategy MLflow's SQL store module configures as it is imported
            warnings.filterwarnings("ignore", message=r"The ``noload`` loader strategy is deprecated")
            if local:
                _forget_store(uri)
            self.client = MlflowClient(tracking_uri=uri)
            recalled = run.recall("mlflow")
            run_id = recalled.get("run_id") if recalled.get("tracking_uri") == uri and self._exists(recalled.get("run_id")) else None
            if run_id is None:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
                experiment = self.client.get_experiment_by_name(name)
                experiment_id = (
                    experiment.experiment_id
                    if experiment
                    else self.client.create_experiment(
                        name, artifact_location=(run.directory / ARTIFACTS).resolve().as_uri() if local else None
                    )
                )
                run_id = self.client.create_run(experiment_id, run_name=run.name, tags={"specdraft.job": run.job}).info.run_id
                run.remember("mlflow", {"run_id": run_id, "tracking_uri": uri})
            else:
                self.client.update_run(run_id, status="RUNNING")
        self.run_id: str = run_id
        # parameters are immutable in MLflow: a resumed run adds the ones it lacks (its other values are the first attempt's)
        known = self.client.get_run(self.run_id).data.params
        params = [Param(key, str(value)[:MAX_PARAM_VAL_LENGTH]) for key, value in hyperparameters(run.config).items() if key not in known]
        self.client.log_batch(self.run_id, params=params)

    def _exists(self, run_id: str | None) -> bool:
        from mlflow.exceptions import MlflowException

        if not run_id:
            return False
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(metric_name(k), v, now, step) for k, v in metrics.items()])

    def close(self, *, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
