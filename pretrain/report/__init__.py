"""The run report: one self-contained HTML page and PNG figures made from a run folder (``page``, ``figures``)."""
