"""``data_prep clean``: exact and near duplicates, quality and language filters, decontamination
against held-out files, and a report.

- ``run``: the command's entry, which sequences the stages; one module per stage: ``signatures``,
  ``dedup`` (exact and pairs), ``clusters`` (the clusters and the decisions, with ``quality_cut``, the
  quality model's cut), ``filter`` (the kept records and the report); ``work``: what they share
  (the job, the work files' names and reading).
- What the stages compute with: ``document`` (one document's keys, MinHash, language, quality
  scores), ``quality`` (the rules), ``quality_model`` (the learned classifier; ``negatives``, the junk it trains against, made of its positives;
  ``sgd``, its training passes on one core or several), ``fasttext_file``
  (fastText's binary format: written, and checked before fastText's loader reads it),
  ``sorted_keys`` (the sorted key files and the array tasks' units), ``lsh`` (buckets, pairs,
  components, the held-out check); ``reference`` is the in-memory clustering the stages must match.
- ``settings``: the one typed settings block. The report's table is ``data_prep.cleaned_folder``'s.
"""
