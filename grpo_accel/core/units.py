"""Byte units, one definition for the planner, the measurements and the messages."""

MIB = 1 << 20
GIB = 1 << 30
