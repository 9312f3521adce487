"""The per-node daemon: main loop, HTTP endpoint, process entry point."""
