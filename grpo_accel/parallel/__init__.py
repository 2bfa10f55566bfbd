"""Splitting the work across tokens and ranks: padding-free packing (packing.py), Ulysses sequence parallelism
(sequence_parallel.py) and its shard tiles (ulysses_tiles.py)."""
