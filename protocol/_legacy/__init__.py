"""TEMPORARY: today's hand-written codec (dataclass messages + type-hint checkers), kept only so
benchmarks/protocol_codec.py can time it against the msgspec codec in the same run. Deleted
once the comparison is recorded."""
