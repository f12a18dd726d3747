"""The save pipeline and the commit protocol: staging, hashing, encoding, placing a version's
shards on its synchronous tiers, and the two-phase commit across ranks."""
