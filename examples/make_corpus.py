"""Writes examples/data/corpus.txt: a few hundred KB of generated English prose.

The text is produced here, from a small hand-written grammar and word lists, with a
fixed seed, so it is reproducible, free of any licence and needs no download. It is
meant for a character-level language-model demo: varied enough to be worth learning,
regular enough that a small model makes visible progress in a few hundred steps.

    python examples/make_corpus.py            # ~300 KB
    python examples/make_corpus.py --kb 600
"""

from __future__ import annotations

import argparse
import pathlib
import random

NAMES = ["Anna", "Tomas", "Elena", "Marcus", "Ida", "Rowan", "Clara", "Hugo", "Maren",
         "Felix", "Lydia", "Oskar", "Nora", "Julian", "Vera", "Simon", "Agnes", "Peter"]
TITLES = ["the miller", "the old captain", "the schoolmistress", "the baker's son",
          "the widow Hale", "the young clerk", "the ferryman", "the doctor",
          "the blacksmith", "the shepherd", "the innkeeper", "the lighthouse keeper"]
PLACES = ["the harbour", "the mill by the river", "the high meadow", "the market square",
          "the old chapel", "the lighthouse", "the orchard", "the northern road",
          "the village green", "the library", "the station", "the bridge", "the forest edge",
          "the quiet lane behind the church", "the garden wall", "the fishing boats"]
TIMES = ["At dawn", "In the evening", "Late that night", "On the following morning",
         "Before the rain came", "When the bells had stopped", "By noon",
         "In the grey hour before supper", "That winter", "Early in the spring",
         "After the harvest", "On market day"]
ADJ = ["quiet", "cold", "bright", "narrow", "ancient", "heavy", "gentle", "restless",
       "pale", "warm", "crooked", "silent", "broad", "weathered", "hollow", "golden",
       "dark", "patient", "careful", "tired", "sudden", "faint", "green", "steady"]
NOUNS = ["letter", "lantern", "key", "basket of apples", "map", "coat", "wooden box",
         "bell", "window", "path", "boat", "song", "promise", "clock", "door", "bridge",
         "field", "stone", "candle", "book", "fire", "wind", "river", "road", "cart"]
VERBS_T = ["carried", "found", "opened", "watched", "mended", "remembered", "lost",
           "followed", "painted", "counted", "hid", "described", "repaired", "studied",
           "sold", "borrowed", "closed", "cleaned", "measured", "kept"]
VERBS_I = ["waited", "listened", "laughed", "hesitated", "walked on", "sat down",
           "slept", "returned", "wondered", "smiled", "stood still", "turned away"]
FEELINGS = ["hope", "unease", "relief", "curiosity", "sorrow", "patience", "delight",
            "doubt", "gratitude", "longing"]
SAYINGS = [
    "A river does not hurry, and yet it reaches the sea.",
    "What is mended with care will outlast what is bought in haste.",
    "The longest road is the one we refuse to begin.",
    "Bread shared is sweeter than bread hoarded.",
    "Every lantern was once an unlit wick.",
    "The wind forgets nothing it has carried.",
    "A quiet house hears the most.",
    "Count the sheep before you sell the wool.",
]
SPEECH = [
    "We should have left before the light was gone",
    "I have seen this {noun} before, I am sure of it",
    "Nobody in {place} will believe us",
    "Tell me again what you heard on the {adj} road",
    "It is only the {noun}, nothing more",
    "If the river rises we must move the {noun}",
    "I kept my promise, even when it was hard",
    "Leave the {noun} where it is and come inside",
    "There are more stars tonight than I can count",
    "The {noun} was never ours to keep",
]


def person(r):
    return r.choice(NAMES) if r.random() < 0.6 else r.choice(TITLES)


def cap(s):
    return s[0].upper() + s[1:]


def sentence(r):
    k = r.randrange(11)
    a, b = person(r), person(r)
    noun, noun2 = r.choice(NOUNS), r.choice(NOUNS)
    adj, adj2 = r.choice(ADJ), r.choice(ADJ)
    place = r.choice(PLACES)
    if k == 0:
        return f"{r.choice(TIMES)}, {a} {r.choice(VERBS_T)} the {adj} {noun} near {place}."
    if k == 1:
        return f"{cap(a)} {r.choice(VERBS_I)}, and for a while nobody spoke."
    if k == 2:
        line = r.choice(SPEECH).format(noun=noun, place=place, adj=adj)
        return f"\"{line},\" said {a}."
    if k == 3:
        return (f"The {noun} was {adj} and {adj2}, and {a} felt a {r.choice(ADJ)} "
                f"{r.choice(FEELINGS)} that {b} could not share.")
    if k == 4:
        return (f"{cap(b)} had {r.choice(VERBS_T)} the {noun2} years ago, when {place} "
                f"was still {adj}.")
    if k == 5:
        return f"As the old people of {place} used to say: {r.choice(SAYINGS)}"
    if k == 6:
        n = r.randrange(2, 12)
        return (f"There were {n} {noun}s in the cart, or perhaps {n + r.randrange(1, 4)}, "
                f"for {a} had never been good at counting.")
    if k == 7:
        return (f"{cap(a)} asked {b} whether the {noun} would be ready by "
                f"{r.choice(['Sunday', 'the first frost', 'the end of the month', 'morning'])}.")
    if k == 8:
        return (f"Beyond {place} the {r.choice(['hills', 'fields', 'roofs', 'waves'])} "
                f"lay {adj} under a {adj2} sky.")
    if k == 9:
        return (f"Nobody knew who had left the {noun} by the {r.choice(NOUNS)}, but "
                f"{a} suspected {b}.")
    return f"{cap(a)} {r.choice(VERBS_T)} the {noun} and {r.choice(VERBS_I)}."


def paragraph(r):
    return " ".join(sentence(r) for _ in range(r.randint(3, 7)))


def corpus(kb: int, seed: int = 1907) -> str:
    r = random.Random(seed)
    out, size, chapter = [], 0, 0
    while size < kb * 1024:
        if chapter == 0 or r.random() < 0.04:
            chapter += 1
            head = f"CHAPTER {chapter}. THE {r.choice(ADJ).upper()} {r.choice(NOUNS).upper()}"
            out.append(head)
            size += len(head) + 2
        p = paragraph(r)
        out.append(p)
        size += len(p) + 2
    return "\n\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kb", type=int, default=300)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "data" / "corpus.txt"))
    args = ap.parse_args()
    text = corpus(args.kb)
    pathlib.Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {len(text)} characters to {args.out}")


if __name__ == "__main__":
    main()
