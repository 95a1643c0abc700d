"""Studies: the plan of variants, running them, and the summary."""
