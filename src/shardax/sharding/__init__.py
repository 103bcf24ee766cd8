"""Sharding: paths, placement, state placement modes and logical axis rules."""
