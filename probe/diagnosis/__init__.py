"""Doctor rules as data: each rule is SQL over probe's tables plus a message and next steps.

``rules`` holds the registry (``rule(...)`` declares one). A training process holds only its script's own
rules; the rules probe ships are declared the same way in ``probe.cli.doctor`` and loaded by the client
alone. Nothing here imports torch, DuckDB or the agent: the CLI reads the same declarations to run the doctor.
"""
