"""The save pipeline and everything that keeps the tiers consistent after it."""
