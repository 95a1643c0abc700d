"""``data_prep clean``: exact and near duplicates, quality and language filters, decontamination
against held-out files, and a report (``run`` assembles ``signature``, ``quality``, ``clusters``,
``report``; ``settings`` is the one typed settings block)."""
