"""For tier authors: the conformance suite and fault-injection wrappers."""
