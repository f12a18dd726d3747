"""The restore pipeline: choose a version, read it verified, bind it into the caller's state.

:mod:`~tiercheck.restore.service` (``RestoreService``) orchestrates a restore through its
steps: :mod:`~tiercheck.restore.choose` (which version), :mod:`~tiercheck.restore.binding`
(each saved entry to its destination), :mod:`~tiercheck.restore.loading` (fetch, verify,
write in place; :mod:`~tiercheck.restore.devices` for tensors on a GPU),
:mod:`~tiercheck.restore.undo` (all or nothing) and :mod:`~tiercheck.restore.reshard`
(distributed tensors on a new layout); :mod:`~tiercheck.restore.info` holds what a
restore reports (``RestoreInfo``).
"""
