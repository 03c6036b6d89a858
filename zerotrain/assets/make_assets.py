"""Regenerate the embedded datasets (deterministic; written by hand, no external text).

    python -m zerotrain.assets.make_assets

- corpus.txt: simple English prose, one short paragraph per line, for the causal-LM demo.
- sentiment.jsonl: {"text", "label"} rows with string labels "positive"/"negative", for seq-cls.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

NAMES = ["Anna", "Ben", "Clara", "David", "Ella", "Finn", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Leo",
         "Maya", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tara", "Victor"]
ANIMALS = ["cat", "dog", "fox", "horse", "bird", "rabbit", "goat", "owl", "duck", "mouse"]
PLACES = ["the garden", "the old mill", "the market", "the river", "the library", "the hill", "the harbour",
          "the forest", "the village square", "the bakery", "the school", "the station"]
TIMES = ["In the morning", "At noon", "In the evening", "Late at night", "On Sunday", "After the rain",
         "Before breakfast", "During the winter", "In the spring", "One summer day"]
ADJ = ["small", "quiet", "bright", "old", "happy", "tired", "clever", "brave", "gentle", "curious"]
OBJECTS = ["a red apple", "a wooden box", "a long letter", "a blue kite", "a loaf of bread", "an old map",
           "a silver key", "a basket of eggs", "a warm coat", "a book of songs"]
VERBS_T = ["found", "carried", "painted", "lost", "gave away", "bought", "opened", "hid", "mended", "sold"]
VERBS_I = ["walked to", "ran to", "rested near", "waited at", "sang near", "slept near", "looked around"]
WEATHER = ["The sky was grey and the wind was cold.", "The sun was warm and the air was still.",
           "Rain fell softly on the roofs.", "Snow covered the fields and the roads.",
           "A light fog rolled in from the sea."]
FEELINGS = ["glad", "worried", "surprised", "calm", "proud", "sleepy", "excited"]
COUNTS = ["two", "three", "four", "five", "six", "seven"]


def _sentence(r: random.Random) -> str:
    n, m = r.choice(NAMES), r.choice(NAMES)
    kind = r.randrange(8)
    if kind == 0:
        return f"{r.choice(TIMES)}, {n} {r.choice(VERBS_I)} {r.choice(PLACES)}."
    if kind == 1:
        return f"{n} {r.choice(VERBS_T)} {r.choice(OBJECTS)} at {r.choice(PLACES)}."
    if kind == 2:
        return f"The {r.choice(ADJ)} {r.choice(ANIMALS)} followed {n} to {r.choice(PLACES)}."
    if kind == 3:
        return r.choice(WEATHER)
    if kind == 4:
        return f"{n} told {m} about {r.choice(OBJECTS)}, and {m} was {r.choice(FEELINGS)}."
    if kind == 5:
        c = r.choice(COUNTS)
        return f"There were {c} {r.choice(ANIMALS)}s near {r.choice(PLACES)}, and {n} counted {c} of them."
    if kind == 6:
        return f"\"Where is {r.choice(OBJECTS)}?\" asked {n}. \"Near {r.choice(PLACES)},\" said {m}."
    return f"{n} was {r.choice(FEELINGS)} because the {r.choice(ANIMALS)} was {r.choice(ADJ)}."


def corpus(n_paragraphs: int = 1100, seed: int = 1) -> str:
    r = random.Random(seed)
    lines = [" ".join(_sentence(r) for _ in range(r.randint(2, 6))) for _ in range(n_paragraphs)]
    return "\n".join(lines) + "\n"


POS = ["wonderful", "delightful", "excellent", "charming", "lovely", "brilliant", "great", "moving", "funny"]
NEG = ["terrible", "boring", "awful", "dull", "clumsy", "painful", "weak", "tiresome", "disappointing"]
THINGS = ["the film", "the book", "the play", "the meal", "the concert", "the story", "the game", "the show"]
PARTS = ["the acting", "the music", "the ending", "the service", "the writing", "the pacing", "the sound"]


def sentiment(n: int = 1200, seed: int = 2) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        positive = r.random() < 0.5
        words = POS if positive else NEG
        t = r.randrange(3)
        if t == 0:
            text = f"{r.choice(THINGS).capitalize()} was {r.choice(words)}."
        elif t == 1:
            text = f"I thought {r.choice(THINGS)} was {r.choice(words)} and {r.choice(PARTS)} was {r.choice(words)}."
        else:
            text = f"{r.choice(NAMES)} said that {r.choice(PARTS)} in {r.choice(THINGS)} felt {r.choice(words)}."
        rows.append({"text": text, "label": "positive" if positive else "negative"})
    return rows


def main() -> None:
    (HERE / "corpus.txt").write_text(corpus())
    (HERE / "sentiment.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sentiment()))


if __name__ == "__main__":
    main()
