from probe.cli import entry

entry()
