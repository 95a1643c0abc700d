"""The run configuration: the typed schema (``schema``) and the YAML loader with dotted overrides (``loader``)."""
