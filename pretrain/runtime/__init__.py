"""Distribution and hardware: the DeepSpeed engine, precision and peaks, the launcher wrapper."""
