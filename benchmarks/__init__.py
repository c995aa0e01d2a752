"""The benchmarks: scripts run from the repository (`python benchmarks/NAME.py`), sharing
`servers.py` (free ports, starting the servers they compare, waiting until they are ready)."""
