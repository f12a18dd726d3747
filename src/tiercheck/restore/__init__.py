"""The restore pipeline: choose a version, read it verified, bind it into the caller's state.

:mod:`~tiercheck.restore.restoring` (``RestoreService``) orchestrates a restore;
:mod:`~tiercheck.restore.service` holds its steps (choose, bind, fetch, load, undo).
"""
