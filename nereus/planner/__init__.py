"""Plan search: candidates, frontier, exact search, placement, what-if (the plan data types are in :mod:`nereus.spec.plan`)."""
