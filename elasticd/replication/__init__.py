"""Checkpoint replication between daemons: replica placement (Gemini), the authenticated TCP
transport that moves snapshots, and the sink interface where received snapshots land.

The daemon side never imports torch: snapshots travel as a header plus raw bytes."""
