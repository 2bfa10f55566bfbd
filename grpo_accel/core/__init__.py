"""What every layer may import: errors, the log line, scoped patches, process counts, RNG state, dtype names, byte
units, reaching the HF model through wrappers, phase memory measurement. Imports nothing else of grpo_accel."""
