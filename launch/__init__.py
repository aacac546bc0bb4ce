"""The `tether` command: parsing (``cli.py``), starting and watching every role's processes on this
machine or a Ray cluster, the checks before they start, and what is read from a run afterwards
(trackers, reports, sweeps)."""
