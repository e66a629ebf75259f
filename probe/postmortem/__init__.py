"""Post-mortem: what a dying process leaves (``record``), when it is written (``hooks``:
exceptions, fatal signals, exit, periodic snapshots), read back by ``probe list --dead``."""
