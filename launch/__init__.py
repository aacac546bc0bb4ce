"""The launch role: the `tether` CLI, `tether run` (every role as its own process) and the demo."""
