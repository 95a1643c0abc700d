"""Single-device model code: the MLM model, masking, optimisers and schedules, FLOPs."""
