"""The restore pipeline: choose a version, read it verified, bind it into the caller's state.

:mod:`~tiercheck.restore.service` (``RestoreService``) orchestrates a restore;
:mod:`~tiercheck.restore.steps` holds its steps (choose, bind, fetch, load, undo).
"""
