"""Checkpoint folders: tags, COMPLETE, latest, lock, save and load (``checkpointing``), the resume state, resharding and export."""
