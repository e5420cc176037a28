"""Writes Doppler's small fine-tuning dataset: data/finetune/{train,eval}.jsonl.

Chat samples ({"messages": [...]}) asking for the sum of two numbers, answered in one fixed
format, GSM8K's final-answer line:

    user:      What is 17 + 25?
    assistant: 17 + 25 = 42
               #### 42

The questions, numbers and answers are generated here (no outside source): the data is
this script's output, dedicated to the public domain (CC0), like the script. The learned
behaviour to look for after fine-tuning: answers in this two-line format, ending "#### N".
Deterministic (seeded); the held-out pairs never occur in the training set.

Usage: python3 scripts/make_finetune_data.py [--train 400] [--eval 40]
"""
import argparse
import json
import os
import random

PHRASES = [
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "Compute {a} plus {b}.",
    "What do you get when you add {a} to {b}?",
    "Sum {a} and {b}, please.",
    "How much is {a} + {b}?",
]


def sample(rng, a, b):
    q = rng.choice(PHRASES).format(a=a, b=b)
    answer = f"{a} + {b} = {a + b}\n#### {a + b}"
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--eval", type=int, default=40)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "data", "finetune"))
    a = p.parse_args()
    rng = random.Random(20261203)
    pairs = set()
    while len(pairs) < a.train + a.eval:
        pairs.add((rng.randint(2, 99), rng.randint(2, 99)))
    pairs = sorted(pairs)
    rng.shuffle(pairs)
    os.makedirs(a.out, exist_ok=True)
    for name, part in [("train", pairs[: a.train]), ("eval", pairs[a.train :])]:
        with open(os.path.join(a.out, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for x, y in part:
                f.write(json.dumps(sample(rng, x, y)) + "\n")


if __name__ == "__main__":
    main()
