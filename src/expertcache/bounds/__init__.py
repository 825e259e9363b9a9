"""Optimality bounds of lossless schedules: ``B_flat <= B* <= B_greedy`` (docs/design.md section 2).

* :mod:`.flat` -- ``B_flat``, classical MIN on streams flattened to single requests;
* :mod:`.exact` -- ``B*``, the exact optimum by dynamic programming over resident sets;
* :mod:`.report` -- the sandwich on a trace, per stream and in total (:func:`compute_bounds`);
* :mod:`.instances` / :mod:`.verify` -- random small instances and the greedy-vs-optimum check;
* :mod:`.streams` -- per-stream copy counts, the unit the bounds are stated in.
"""

from .exact import DEFAULT_MAX_STATES, MAX_ITEMS, ExactResult, InstanceTooLarge, exact_stream_totals, optimal_total
from .flat import ORDERS, flat_min_totals, flatten
from .instances import FAMILIES, Instance, make_instance
from .report import BoundsReport, StreamBound, compute_bounds, relative_gap
from .verify import InstanceCheck, VerifyReport, check_instance, verify_greedy

__all__ = [
    "DEFAULT_MAX_STATES", "FAMILIES", "MAX_ITEMS", "ORDERS", "BoundsReport", "ExactResult", "Instance",
    "InstanceCheck", "InstanceTooLarge", "StreamBound", "VerifyReport", "check_instance", "compute_bounds",
    "exact_stream_totals", "flat_min_totals", "flatten", "make_instance", "optimal_total", "relative_gap",
    "verify_greedy",
]
