"""Cluster membership: node records, failure detection, events."""
