"""The demos `tether demo` runs, each built from nothing on disk: ``parity.py`` (the three
InstructGPT stages, then PPO through the whole pipeline) and ``agent.py`` (``--agent``: a policy
that learns to call a tool)."""
