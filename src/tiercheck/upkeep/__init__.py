"""Work after the commit: migration to slower tiers, retention, garbage collection and log
compaction, run on the store's background threads and never by the trainer's thread."""
