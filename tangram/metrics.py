"""The scheduler's figures for Prometheus and for trainers' per-step logs: ``tangram.metrics``.

:class:`Collector` is a prometheus-client custom collector (the ``metrics`` extra:
``pip install 'tangram[metrics]'``; prometheus-client is imported only when one is
built); :class:`StepMetrics` hands the change since its last call to a tracker as one
flat dict, and needs nothing beyond tangram. ``import tangram`` imports neither. See
docs/metrics.md.
"""

from __future__ import annotations

from ._core._exports import publish as _publish
from ._frameworks._metrics import Collector as Collector
from ._frameworks._metrics import StepMetrics as StepMetrics

__all__ = ["Collector", "StepMetrics"]

_publish("tangram.metrics", globals())
