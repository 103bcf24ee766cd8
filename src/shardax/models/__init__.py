"""Models shardax trains: a transformer LM and its size presets."""
