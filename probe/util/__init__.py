"""Small helpers every room may use: the ring buffer, frame locals, /proc, the error log."""
