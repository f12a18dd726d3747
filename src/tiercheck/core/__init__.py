"""A state as entries: flattening and validation, chunk layout, DTensor helpers, RNG state."""
