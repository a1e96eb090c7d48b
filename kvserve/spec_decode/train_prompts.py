"""A varied prompt set for self-distilling EAGLE heads: chat, instructions, code, math,
summaries and multi-turn conversations, with the benchmark's held-out chat kept out.

Everything is synthesised here or drawn from the repo (``chat_topics`` for everyday chat, the
shipped accuracy corpus for code and prose: ``train_eagle.chat_prompts``); no download. A
conversation is a list of user turns: one turn is a plain request, two turns a multi-turn
conversation (the second asked after the model's own answer to the first).
"""

from __future__ import annotations

import random

from kvserve.spec_decode.chat_topics import _BANNED, HELD_OUT, all_chat_prompts

_WHO = ["my landlord", "a coworker", "my manager", "a customer", "my teacher", "a new client", "my neighbor",
        "the team", "a friend", "the school principal", "a hiring manager", "my doctor's office"]
_WHAT = ["a late payment", "a broken heater", "a project deadline", "a meeting next week", "a refund request",
         "a job offer", "a schedule change", "a thank-you for their help", "a noisy party", "a missed delivery",
         "a vacation request", "feedback on a presentation"]
_MAIL_T = ["Write a short email to {} about {}.", "Draft a polite message to {} about {}.",
           "Write a friendly note to {} regarding {}."]
_SENTENCES = ["the meeting got moved to tuesday because nobody could come on monday",
              "i think we should buy the cheaper laptop since it does the same things",
              "our team finished the report early and the boss was happy about it",
              "the store was out of milk so i got juice instead",
              "he said the train would be late but it came on time",
              "we need more people to help with the event this weekend",
              "the new app is slow and it crashes when you open the camera",
              "she practiced every day and won the piano competition"]
_EDIT_T = ["Rewrite this sentence to sound more formal: {}", "Fix the grammar and punctuation: {}",
           "Make this sentence shorter: {}", "Rewrite this in a cheerful tone: {}",
           "Turn this into a question: {}", "Explain what this sentence means: {}"]
_GOALS = ["organize a closet", "plan a birthday party", "learn basic photography", "prepare a presentation",
          "set up a home office", "start journaling", "clean a laptop keyboard", "write a book report",
          "host a dinner for six people", "prepare for a long hike", "move to a new apartment",
          "build a simple website", "learn to juggle", "start running in the morning"]
_PLAN_T = ["Give me a step-by-step plan to {}.", "What do I need to {}?", "Make a checklist to {}.",
           "Explain how to {} in five steps."]
_CODE_FN = ["returns the second largest number in a list", "counts the vowels in a string",
            "checks whether two strings are anagrams", "flattens a nested list", "removes duplicates from a list",
            "converts a list of tuples into a dictionary", "returns the n-th prime number",
            "checks if a year is a leap year", "capitalizes every word in a sentence",
            "computes the greatest common divisor of two numbers", "splits a list into chunks of size n",
            "finds all even numbers in a list", "returns the binary representation of an integer",
            "validates an email address with a regular expression", "sums the digits of a number",
            "transposes a matrix given as a list of lists", "merges two sorted lists into one sorted list",
            "counts how often each character appears in a string"]
_CODE_FN_T = ["Write a Python function that {}.", "Write a JavaScript function that {}.",
              "Write a Python function that {} and add a short docstring.",
              "Explain how you would write a function that {}."]
_ITEMS = ["apples", "notebooks", "tickets", "pencils", "cookies", "books", "shirts", "plants"]
_FOLLOW_UPS = ["Can you explain that more simply?", "Give me an example.", "Summarize that in one sentence.",
               "Can you make it shorter?", "Tell me more about the first point.", "What else should I know?",
               "Can you put that in a numbered list?", "Why is that?"]
_KINDS = ("chat", "instruction", "code", "math", "summary", "multi_turn")
#: Default mix of the kinds (fractions of the prompt set).
DEFAULT_MIX = {"chat": 0.38, "instruction": 0.14, "code": 0.16, "math": 0.1, "summary": 0.1, "multi_turn": 0.12}


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 40)
    item = rng.choice(_ITEMS)
    return rng.choice([
        f"What is {a} + {b}? Show your work.", f"What is {a} times {c}?",
        f"Solve for x: {c}x + {a} = {c * b + a}.", f"What is {c}% of {a * 10}?",
        f"A shop sells {item} for ${c} each. How much do {a} {item} cost?",
        f"If I have {a + b} {item} and give away {b}, how many are left?",
        f"A train travels {a * 5} km in {c % 9 + 1} hours. What is its average speed?",
        f"Is {a * 2 + 1} a prime number? Explain.", f"What is the average of {a}, {b} and {c}?",
        f"Convert {a} kilometers to miles.", f"Explain how to compute {a} divided by {c} by hand.",
    ])


def _clean(p: str) -> bool:
    return p not in HELD_OUT and not any(b in p.lower() for b in _BANNED)


def training_conversations(n: int, seed: int = 0, mix: dict | None = None) -> list[list[str]]:
    """``n`` conversations (lists of user turns), kinds in the proportions of ``mix``
    (``DEFAULT_MIX``), shuffled by ``seed``; distinct where the pools allow (math and the
    corpus-based kinds draw again with other numbers / asks when exhausted).

    Raises ValueError for an unknown kind in ``mix``. Every turn is checked to be none of
    ``chat_topics.HELD_OUT`` and free of its topics' words (AssertionError otherwise)."""
    from kvserve.spec_decode.train_eagle import chat_prompts

    mix = dict(DEFAULT_MIX if mix is None else mix)
    bad = set(mix) - set(_KINDS)
    if bad:
        raise ValueError(f"unknown prompt kinds {sorted(bad)}; known: {_KINDS}")
    rng = random.Random(seed)
    tot = sum(mix.values())
    counts = {k: int(n * v / tot) for k, v in mix.items()}
    first = next(iter(mix))
    counts[first] += n - sum(counts.values())
    chat = all_chat_prompts()
    rng.shuffle(chat)
    instr = [t.format(w, x) for t in _MAIL_T for w in _WHO for x in _WHAT]
    instr += [t.format(s) for t in _EDIT_T for s in _SENTENCES] + [t.format(g) for t in _PLAN_T for g in _GOALS]
    instr = [p for p in instr if _clean(p)]
    rng.shuffle(instr)
    code_own = [t.format(f) for t in _CODE_FN_T for f in _CODE_FN]
    corpus = chat_prompts(max(counts.get("code", 0), counts.get("summary", 0)) * 2 + 2, seed)
    code_pool = [p for p in code_own + corpus[0::2] if _clean(p)]
    prose_pool = [p for p in corpus[1::2] if _clean(p)]
    rng.shuffle(code_pool)
    out: list[list[str]] = []
    ci = 0
    for kind, c in counts.items():
        for i in range(c):
            if kind == "chat":
                out.append([chat[ci % len(chat)]])
                ci += 1
            elif kind == "instruction":
                out.append([instr[i % len(instr)]])
            elif kind == "code":
                out.append([code_pool[i % len(code_pool)]])
            elif kind == "summary":
                out.append([prose_pool[i % len(prose_pool)]])
            elif kind == "math":
                p = _math(rng)
                while not _clean(p):
                    p = _math(rng)
                out.append([p])
            else:
                out.append([chat[ci % len(chat)], rng.choice(_FOLLOW_UPS)])
                ci += 1
    rng.shuffle(out)
    for conv in out:
        assert all(_clean(t) for t in conv), f"a held-out question or topic slipped in: {conv}"
    return out
