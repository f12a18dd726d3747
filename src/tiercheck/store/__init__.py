"""Opening and reading a store: its configuration and identity, its tiers and their policy,
the manifest log merged into a catalog, verified chunk reads, budgets, leases and the commit
guarantees. Nothing here starts a thread: the rooms that do (runtime, engine, upkeep) build
on it."""
