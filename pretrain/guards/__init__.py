"""The run's guards: every input checked before a process group starts (``preflight``), bad data read
mid-run (``bad_input``), hangs (``watchdog``), loss spikes rolled back (``spike_guard``) and per-layer
health (``health``). They sit above the checkpoint code that the checks and the rollback read."""
