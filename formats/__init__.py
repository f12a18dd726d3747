"""Format v1: chunk ids, blob codecs, manifest and log-record schemas. See SPEC.md."""
