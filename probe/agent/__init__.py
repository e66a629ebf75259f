"""The agent inside the training process: start/stop (``lifecycle``), the HTTP server and
its routes, the registry entry (``state``), audit log, hang watchdog, autostart and the
inject bootstrap."""
