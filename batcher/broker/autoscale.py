"""The broker's side of the autoscaling signal (batcher.core.scaling): each model's
offered-request count sampled on the loop's timer, and the desire it gives, kept for
`stats` and read by the metrics' scrape thread."""

from __future__ import annotations

from collections.abc import Mapping

from batcher.core.scaling import ArrivalWindow, Desire, desire
from batcher.core.scheduler import ModelView


class Autoscale:
    """Per model: an ArrivalWindow over its offered requests and its last Desire."""

    def __init__(self, target_utilization: float, cell_workers: Mapping[str, int]) -> None:
        self.target_utilization = target_utilization
        self.cell_workers = dict(cell_workers)
        self._windows: dict[str, ArrivalWindow] = {}
        #: Replaced whole at each tick, so the metrics thread reads one consistent dict.
        self.desires: dict[str, Desire] = {}

    def tick(self, now: float, views: Mapping[str, ModelView]) -> None:
        """Sample every model's count of offered requests at `now`; compute its desire."""
        desires = {}
        for name, view in views.items():
            window = self._windows.get(name)
            if window is None:
                window = self._windows[name] = ArrivalWindow()
            window.observe(now, view.offered)
            desires[name] = desire(
                window.per_second(),
                view.cost,
                view.settings,
                self.target_utilization,
                self.cell_workers.get(name),
            )
        self.desires = desires

    def forget(self, model: str) -> None:
        """The model is gone (BrokerStats.forget): its window goes; its desire goes at the
        next tick, which samples the models there are."""
        self._windows.pop(model, None)

    def wire(self, model: str) -> dict[str, object]:
        """A model's signal as `stats` shows it (before the first tick: none yet)."""
        d = self.desires.get(model)
        entry: dict[str, object] = {"target_utilization": self.target_utilization}
        if d is None:
            entry.update(
                offered_per_s=0.0,
                scaling_batch_size=None,
                desired_workers=None,
                workers_needed=None,
                desired_cells=None,
            )
        else:
            entry.update(d.wire())
        entry["cell_workers"] = self.cell_workers.get(model)
        return entry
