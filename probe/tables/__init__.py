"""The table registry (``registry``) and the built-in tables (``builtin`` names them all).

The registry never imports the built-ins: whoever serves queries (the agent's routes)
or documents the tables (docs/generate.py) imports ``probe.tables.builtin``.
"""
