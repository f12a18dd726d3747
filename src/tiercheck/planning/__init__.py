"""Goodput planning: failure models, tier costs, the simulator and the interval planner."""
