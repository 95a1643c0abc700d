"""The embedded Wikipedia sample with known faults injected, for measuring ``data_prep clean``.

Every record carries ``fault`` (what was injected) and ``origin`` (the article it came from), so
that after cleaning the kept records say what each step caught:

* ``none``: an article of the sample, once (less the held-out ones);
* ``exact``: a verbatim copy of an article, whitespace and case changed on some;
* ``near-2``, ``near-5``, ``near-10``: a copy with 2, 5 or 10% of its words replaced by other words
  of the sample;
* ``boilerplate``: a page of cookie notices, navigation, "enable JavaScript", copyright lines and
  "lorem ipsum", sometimes around one real sentence;
* ``de``, ``fr``, ``es``: a few sentences of German, French or Spanish (written here);
* ``heldout-exact``, ``heldout-near``: an exact or 2-5% changed copy of a held-out article; the
  held-out articles themselves are written to a separate file (``heldout.jsonl``), the stand-in for
  a downstream test set that cleaning decontaminates against.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HELDOUT_EVERY = 50  # every 50th article is held out (~200)

_FOREIGN = {
    "de": [
        "Die Stadt liegt am Ufer eines breiten Flusses und hat etwa zwanzigtausend Einwohner.",
        "Im Mittelalter war der Ort ein wichtiger Handelsplatz für Salz und Getreide.",
        "Die Kirche wurde im vierzehnten Jahrhundert erbaut und mehrmals erweitert.",
        "Nach dem Krieg wurde das Rathaus nach alten Plänen wieder aufgebaut.",
        "Der Bahnhof verbindet die Gemeinde mit den größeren Städten der Region.",
        "Viele Menschen arbeiten heute in kleinen Betrieben oder in der Landwirtschaft.",
        "Jedes Jahr im Sommer findet auf dem Marktplatz ein großes Fest statt.",
        "Das Museum zeigt Werkzeuge, Kleidung und Bilder aus vergangenen Zeiten.",
        "Die Schule wurde von einem reichen Kaufmann gestiftet und trägt seinen Namen.",
        "Im Winter ist der See oft zugefroren, und die Kinder laufen Schlittschuh.",
        "Der Komponist verbrachte hier seine Jugend und schrieb seine ersten Lieder.",
        "Die Brücke über den Fluss gilt als eines der ältesten Bauwerke des Landes.",
    ],
    "fr": [
        "La ville se trouve au bord d'un grand fleuve et compte environ vingt mille habitants.",
        "Au Moyen Âge, le bourg était un centre important du commerce du sel et du blé.",
        "L'église a été construite au quatorzième siècle puis agrandie à plusieurs reprises.",
        "Après la guerre, la mairie a été reconstruite selon les plans d'origine.",
        "La gare relie la commune aux grandes villes de la région.",
        "Aujourd'hui, beaucoup d'habitants travaillent dans de petites entreprises ou dans l'agriculture.",
        "Chaque été, une grande fête a lieu sur la place du marché.",
        "Le musée présente des outils, des vêtements et des tableaux d'autrefois.",
        "L'école a été fondée par un riche marchand et porte encore son nom.",
        "En hiver, le lac gèle souvent et les enfants y font du patin.",
        "Le compositeur a passé sa jeunesse ici et y a écrit ses premières chansons.",
        "Le pont sur la rivière est l'un des plus anciens ouvrages du pays.",
    ],
    "es": [
        "La ciudad está a orillas de un gran río y tiene unos veinte mil habitantes.",
        "En la Edad Media, el pueblo era un centro importante del comercio de sal y trigo.",
        "La iglesia fue construida en el siglo catorce y ampliada varias veces.",
        "Después de la guerra, el ayuntamiento fue reconstruido según los planos antiguos.",
        "La estación de tren une el municipio con las ciudades más grandes de la región.",
        "Hoy muchas personas trabajan en pequeñas empresas o en la agricultura.",
        "Cada verano se celebra una gran fiesta en la plaza del mercado.",
        "El museo muestra herramientas, ropa y cuadros de otros tiempos.",
        "La escuela fue fundada por un rico comerciante y lleva su nombre.",
        "En invierno el lago se congela a menudo y los niños patinan sobre el hielo.",
        "El compositor pasó aquí su juventud y escribió sus primeras canciones.",
        "El puente sobre el río es una de las construcciones más antiguas del país.",
    ],
}

_BOILERPLATE = [
    "This website uses cookies to ensure you get the best experience on our website.",
    "We use cookies to personalise content and ads. By continuing to browse you agree to our use of cookies.",
    "Accept all cookies",
    "Manage cookie preferences",
    "Cookie Policy",
    "Please enable JavaScript in your browser to view this page.",
    "JavaScript is disabled. Enable JavaScript to continue.",
    "Home | About | Contact | Blog | Shop",
    "Skip to main content",
    "Menu",
    "Search",
    "Log in",
    "Sign up",
    "Privacy Policy",
    "Terms of Use",
    "Terms and Conditions",
    "Copyright © {year} {site}. All rights reserved.",
    "Subscribe to our newsletter for the latest updates.",
    "Share on Facebook",
    "Share on Twitter",
    "Click here to read more",
    "Read more",
    "Back to top",
    "Related posts",
    "Leave a comment",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
    "Posted by admin on {month} {day}, {year}",
    "Tags: news, updates, {site}",
]
_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]


def _near_copy(text: str, fraction: float, pool: list[str], rng: random.Random) -> str:
    words = text.split(" ")
    k = max(1, round(fraction * len(words)))
    for i in rng.sample(range(len(words)), min(k, len(words))):
        words[i] = rng.choice(pool)
    return " ".join(words)


def _exact_copy(text: str, rng: random.Random) -> str:
    """The same text after normalisation: case and whitespace may differ."""
    return rng.choice([text, text.upper(), text.lower(), "  " + text.replace(" ", "  ") + "\n"])


def _boilerplate_page(articles: list[str], rng: random.Random) -> str:
    site = rng.choice(["example", "my-blog", "news24", "shopworld", "citytimes"]) + rng.choice([".com", ".net", ".org"])
    lines = [
        rng.choice(_BOILERPLATE).format(
            year=rng.randint(2005, 2025), site=site, month=rng.choice(_MONTHS), day=rng.randint(1, 28)
        )
        for _ in range(rng.randint(6, 16))
    ]
    if rng.random() < 0.5:  # one real sentence among the boilerplate
        lines.insert(rng.randrange(len(lines)), rng.choice(articles).split(". ")[0] + ".")
    return "\n".join(lines)


def _foreign(lang: str, rng: random.Random) -> str:
    return " ".join(rng.sample(_FOREIGN[lang], rng.randint(3, 6)))


def faulty_corpus(
    seed: int = 0,
    exact: int = 300,
    near: int = 300,
    boilerplate: int = 300,
    foreign: int = 60,
    heldout_copies: int = 100,
) -> tuple[list[dict], list[dict]]:
    """(corpus records, held-out records). Counts are per kind (``near`` per level, ``foreign`` per
    language, ``heldout_copies`` per exact/near); the corpus is shuffled."""
    from data_prep.sample_corpus import wiki_articles

    rng = random.Random(seed)
    articles = wiki_articles()
    heldout = [(t, x) for i, (t, x) in enumerate(articles) if i % HELDOUT_EVERY == 0]
    kept = [(t, x) for i, (t, x) in enumerate(articles) if i % HELDOUT_EVERY != 0]
    texts = [x for _, x in kept]
    pool = sorted({w for x in texts[:2000] for w in x.split() if w.isalpha()})
    records = [{"id": f"wiki/{t}", "text": x, "fault": "none", "origin": t} for t, x in kept]
    for i in rng.sample(range(len(kept)), exact):
        records.append({"id": f"exact/{i}", "text": _exact_copy(texts[i], rng), "fault": "exact", "origin": kept[i][0]})
    for pct in (2, 5, 10):
        for i in rng.sample(range(len(kept)), near):
            records.append(
                {
                    "id": f"near{pct}/{i}",
                    "text": _near_copy(texts[i], pct / 100, pool, rng),
                    "fault": f"near-{pct}",
                    "origin": kept[i][0],
                }
            )
    for j in range(boilerplate):
        records.append(
            {"id": f"boilerplate/{j}", "text": _boilerplate_page(texts, rng), "fault": "boilerplate", "origin": ""}
        )
    for lang in _FOREIGN:
        for j in range(foreign):
            records.append({"id": f"{lang}/{j}", "text": _foreign(lang, rng), "fault": lang, "origin": ""})
    for j, i in enumerate(rng.sample(range(len(heldout)), min(heldout_copies, len(heldout)))):
        records.append(
            {
                "id": f"heldout-exact/{j}",
                "text": _exact_copy(heldout[i][1], rng),
                "fault": "heldout-exact",
                "origin": heldout[i][0],
            }
        )
    for j, i in enumerate(rng.sample(range(len(heldout)), min(heldout_copies, len(heldout)))):
        records.append(
            {
                "id": f"heldout-near/{j}",
                "text": _near_copy(heldout[i][1], rng.uniform(0.02, 0.05), pool, rng),
                "fault": "heldout-near",
                "origin": heldout[i][0],
            }
        )
    rng.shuffle(records)
    return records, [{"id": f"heldout/{t}", "text": x} for t, x in heldout]


def write_faulty_corpus(folder: str | Path, num_files: int = 4, **kwargs) -> tuple[list[Path], Path]:
    """The corpus as ``num_files`` JSON-lines files and ``heldout.jsonl``; returns (corpus files, held-out file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    records, heldout = faulty_corpus(**kwargs)
    paths = []
    for i in range(num_files):
        path = folder / f"corpus-{i:02d}.jsonl"
        path.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[i::num_files]), encoding="utf-8"
        )
        paths.append(path)
    held = folder / "heldout.jsonl"
    held.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in heldout), encoding="utf-8")
    return paths, held
