"""Doctor rules as data: each rule is SQL over probe's tables plus a message and next steps.

``rules`` holds the registry (``rule(...)`` declares one, exactly as a user would for
their own) and names the modules that declare the rules probe ships, loaded on first
read. Nothing here imports torch, DuckDB or the agent: the CLI reads the same declarations to run the doctor.
"""
