"""``data_prep clean``: exact and near duplicates, quality and language filters, decontamination
against held-out files, and a report (``run`` runs the stages over ``signature``, ``quality``,
``quality_model``, ``clusters`` and ``sorted_keys``; ``settings`` is the one typed settings block; the
report's table is ``data_prep.cleaned_folder``'s)."""
