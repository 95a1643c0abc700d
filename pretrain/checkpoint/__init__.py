"""Checkpoint folders: the store (tags, COMPLETE, latest, lock), the resume state, resharding and export."""
