"""Human-facing output: pictures (:mod:`.plots`). Needs the ``plot`` extra (matplotlib)."""
