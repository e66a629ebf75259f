"""The table registry (``registry``) and the built-in tables (one module per schema).

``registry.BUILTIN`` names the built-in modules; the registry imports them by name the
first time it is read, so every reader sees them without importing anything for it.
"""
