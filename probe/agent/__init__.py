"""The agent inside the training process: one ``Session`` that start/stop make and undo (``lifecycle``), the
HTTP server and its routes (``server``, ``routes``, ``action_routes``), snapshots and their pacing
(``snapshot``), the listeners, the hang watchdog, autostart and the inject bootstrap."""
