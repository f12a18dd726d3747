"""Browsing and managing a store's history: versions, diffs, verification, GC, migration."""
