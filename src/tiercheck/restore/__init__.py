"""The restore pipeline: choose a version, read it verified, bind it into the caller's state."""
