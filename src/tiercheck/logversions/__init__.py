"""Log versions: the update log a guarded optimizer writes, the log-or-full planner, replay."""
