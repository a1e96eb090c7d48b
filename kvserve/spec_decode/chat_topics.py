"""Synthetic everyday chat prompts for training EAGLE heads without a chat corpus.

Open requests (explain / compare / how-to / write / why / code / travel / food / people / lists)
assembled from templates and word lists written here. The benchmark questions of
``benchmarks/spec_decode_cpu.py`` (``HELD_OUT``) and their topics are kept out, so acceptance
measured on them is held out. EAGLE itself trains on ShareGPT conversations (arXiv:2401.15077);
none ship here.
"""

from __future__ import annotations

import random

#: The chat questions the benchmark measures on: never produced by ``synthetic_chat_prompts``.
HELD_OUT = ("What are three good habits for staying healthy?", "Explain what a hash table is.",
            "Write a short poem about the sea.", "Why is the sky blue?",
            "Give me tips for learning a new language.",
            "What is the difference between a list and a tuple in Python?")
#: Words whose topics are near the held-out questions: no prompt contains them.
_BANNED = ("hash", "sea", "ocean", "sky", "sunset", "new language", "healthy", "tuple", "wave")

_CONCEPTS = [
    "a binary search tree", "photosynthesis", "inflation", "a black hole", "machine learning", "the immune system",
    "a compiler", "DNA", "climate change", "a neural network", "the stock market", "blockchain", "gravity",
    "an API", "a database index", "recursion", "the water cycle", "electricity", "a vaccine", "the internet",
    "encryption", "a linked list", "supply and demand", "plate tectonics", "evolution", "an operating system",
    "cloud computing", "the greenhouse effect", "a mortgage", "compound interest", "a solar panel",
    "quantum computing", "the Pythagorean theorem", "a prime number", "an algorithm", "a web browser", "democracy",
    "the Renaissance", "a credit score", "a hurricane", "an earthquake", "a rainbow", "nuclear energy",
    "wind power", "a spreadsheet", "version control", "Docker", "a stack data structure", "dynamic programming",
    "object-oriented programming", "a regular expression", "a CPU", "a GPU", "a firewall", "meditation",
    "a budget", "the French Revolution", "the theory of relativity", "an electric car", "a recession",
    "artificial intelligence", "a search engine", "unit testing", "a microwave oven", "the human heart",
    "a coral reef", "an ecosystem", "the periodic table", "a semiconductor", "a programming language",
    "a loan", "the placebo effect", "a time zone", "a calorie", "an atom", "the Big Bang", "a volcano",
    "a refrigerator", "a password", "open source software", "a sorting algorithm", "big O notation",
]
_CONCEPT_T = ["Explain what {} is.", "What is {}?", "How does {} work?", "Explain {} in simple terms.",
              "Can you explain {} to a beginner?", "Why is {} important?", "Give me a short overview of {}.",
              "Describe {} in a few sentences.", "What are the main ideas behind {}?",
              "Explain {} to a ten-year-old."]

_PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("RAM", "storage"), ("TCP", "UDP"),
    ("a class", "an object"), ("Python", "JavaScript"), ("a stack", "a queue"), ("speed", "velocity"),
    ("an alligator", "a crocodile"), ("stocks", "bonds"), ("a simile", "a metaphor"), ("mass", "weight"),
    ("HTTP", "HTTPS"), ("a compiler", "an interpreter"), ("baking soda", "baking powder"),
    ("a process", "a thread"), ("SQL", "NoSQL databases"), ("a comet", "an asteroid"),
    ("an array", "a linked list"), ("a debit card", "a credit card"), ("a frog", "a toad"),
    ("renting", "buying a home"), ("a vegan", "a vegetarian diet"), ("an LED", "an incandescent bulb"),
    ("a butterfly", "a moth"), ("Git", "GitHub"), ("a lake", "a pond"), ("machine learning", "deep learning"),
]
_PAIR_T = ["What is the difference between {} and {}?", "How is {} different from {}?", "Compare {} and {}.",
           "Which is better, {} or {}? Explain briefly."]

_ACTIVITIES = [
    "saving money", "sleeping better", "writing a resume", "preparing for a job interview", "studying for exams",
    "running a marathon", "playing the guitar", "starting a vegetable garden", "taking better photos",
    "public speaking", "managing stress", "working from home", "keeping houseplants alive", "training a puppy",
    "writing clean code", "debugging a program", "negotiating a salary", "making friends in a new city",
    "reading more books", "staying focused", "organizing a small kitchen", "planning a wedding",
    "traveling on a budget", "swimming", "brewing good coffee", "baking bread", "reducing screen time",
    "being more productive", "writing a cover letter", "starting a small business", "camping",
    "painting with watercolors", "teaching kids to read", "buying a used car", "learning to code",
    "giving feedback to coworkers", "cooking for a family", "chess", "drawing portraits", "writing essays",
]
_ACTIVITY_T = ["Give me tips for {}.", "How can I get better at {}?", "What should a beginner know about {}?",
               "What are three good habits for {}?", "What are common mistakes people make when {}?",
               "Can you give me a step-by-step guide to {}?", "What is the best way to get started with {}?"]

_SUBJECTS = [
    "the moon", "autumn leaves", "a city at night", "a lonely robot", "friendship", "a rainy day", "a cat",
    "the mountains", "coffee", "a forgotten key", "winter", "the first day of school", "a lighthouse", "time",
    "a dragon who is afraid of fire", "a garden in spring", "the stars", "an old library", "a train journey",
    "the desert", "snow", "a lost dog finding its way home", "music", "a thunderstorm", "summer vacation",
    "a small village", "the wind", "a birthday party", "a bicycle", "a mysterious letter", "a busy kitchen",
    "an astronaut", "a grandmother's recipe", "a sunflower",
]
_SUBJECT_T = ["Write a short poem about {}.", "Write a haiku about {}.", "Write a short story about {}.",
              "Write a limerick about {}.", "Write a paragraph describing {}.",
              "Write a few sentences about {} for a children's book.", "Write a song chorus about {}."]

_WHYS = [
    "Why do leaves change color in autumn?", "Why do we dream?", "Why do cats purr?",
    "Why does ice float on water?", "Why do we have seasons?", "Why is exercise good for the brain?",
    "Why do onions make you cry?", "Why do birds migrate?", "Why does bread go stale?",
    "How do airplanes stay in the air?", "Why do we yawn?", "Why does the moon change shape?",
    "Why do we need sleep?", "Why is coffee bitter?", "Why do batteries run out?",
    "Why does metal feel colder than wood?", "Why do computers need memory?", "Why do some people snore?",
    "Why is biodiversity important?", "Why does the Earth have a magnetic field?", "Why do volcanoes erupt?",
    "Why is Python so popular?", "Why do programs crash?", "Why do prices go up over time?",
    "Why do we get hiccups?", "Why is the number zero important?", "Why does hot air rise?",
    "Why do dogs wag their tails?", "Why do we get goosebumps?", "Why are bees important?",
    "Why is reading good for children?", "Why do apples turn brown after you cut them?",
    "Why does the Moon have craters?", "Why do we forget things?", "Why does music make us feel emotions?",
    "How do vaccines protect us?", "How does a car engine work?", "How do plants drink water?",
    "How does the heart pump blood?", "How do magnets work?", "How do fish breathe underwater?",
    "How is glass made?", "How do noise-cancelling headphones work?", "How does GPS know where I am?",
    "How do bees make honey?", "How do credit cards work?", "How does a thermostat work?",
]

_CODE_TASKS = [
    "reverse a string", "read a CSV file", "sort a dictionary by its values", "check if a number is prime",
    "count the words in a text", "merge two dictionaries", "find the largest number in an array",
    "convert a string to a date", "make an HTTP request", "write text to a file", "generate a random password",
    "compute the factorial of a number", "check if a string is a palindrome", "compute Fibonacci numbers",
    "parse JSON", "measure how long a function takes", "handle exceptions", "define a class with a constructor",
    "remove whitespace from a string", "find the most common element in a collection", "download a web page",
    "rename files in a folder", "convert Celsius to Fahrenheit", "calculate the average of some numbers",
]
_CODE_T = ["How do I {} in Python?", "Write a Python function to {}.", "Show me how to {} in JavaScript.",
           "What is the simplest way to {} in Python?"]

_PLACES = ["Paris", "Japan", "New York", "a national park", "Iceland", "Rome", "London", "Barcelona", "Canada",
           "Mexico City", "the Swiss Alps", "Egypt"]
_PLACE_T = ["What are some fun things to do in {}?", "What should I know before visiting {}?",
            "Plan a three-day trip to {}."]

_FOODS = ["chicken and rice", "potatoes", "eggs", "lentils", "pasta and tomatoes", "chocolate", "spinach",
          "leftover bread", "bananas", "tofu", "mushrooms", "apples", "chickpeas", "salmon"]
_FOOD_T = ["Suggest a simple recipe with {}.", "What can I cook for dinner with {}?",
           "Give me a healthy breakfast idea with {}."]

_PEOPLE = ["Marie Curie", "Albert Einstein", "Leonardo da Vinci", "Isaac Newton", "Ada Lovelace", "Nelson Mandela",
           "Cleopatra", "Charles Darwin", "Alan Turing", "Mozart", "William Shakespeare", "Galileo Galilei",
           "Frida Kahlo", "Napoleon Bonaparte", "Abraham Lincoln", "Jane Austen"]
_PEOPLE_T = ["Who was {} and why are they famous?", "Tell me three interesting facts about {}."]

_BOOKS = ["Romeo and Juliet", "The Odyssey", "Pride and Prejudice", "Hamlet", "Moby Dick", "The Little Prince",
          "Frankenstein", "Cinderella", "Alice in Wonderland", "Don Quixote", "The Wizard of Oz", "Macbeth"]
_BOOK_T = ["Summarize the plot of {}.", "What are the main themes of {}?"]

_LISTS = ["fruits that are high in vitamin C", "famous scientists and what they discovered",
          "ways to reduce plastic waste", "benefits of reading", "creative uses for a paperclip",
          "animals that live in the desert", "programming languages and what they are used for",
          "inventions that changed the world", "ways to save energy at home", "ideas for a rainy weekend",
          "board games for a family night", "questions to ask in a job interview", "easy houseplants",
          "fun facts about space", "ways to be kind to others", "names for a new coffee shop",
          "gift ideas for a teacher", "things to do when you are bored"]
_LIST_T = ["List five {}.", "Can you give me a list of {}?"]

_GROUPS = [(_CONCEPT_T, _CONCEPTS), (_PAIR_T, _PAIRS), (_ACTIVITY_T, _ACTIVITIES), (_SUBJECT_T, _SUBJECTS),
           (["{}"], _WHYS), (_CODE_T, _CODE_TASKS), (_PLACE_T, _PLACES), (_FOOD_T, _FOODS),
           (_PEOPLE_T, _PEOPLE), (_BOOK_T, _BOOKS), (_LIST_T, _LISTS)]


def all_chat_prompts() -> list[str]:
    """Every template x topic combination (about 1,500 prompts), none near ``HELD_OUT``."""
    out = []
    for templates, topics in _GROUPS:
        for t in templates:
            for x in topics:
                p = t.format(*x) if isinstance(x, tuple) else t.format(x)
                if not any(b in p.lower() for b in _BANNED) and p not in HELD_OUT:
                    out.append(p[0].upper() + p[1:])
    return out


def synthetic_chat_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts drawn uniformly without replacement from ``all_chat_prompts`` by
    ``seed`` (each group in proportion to its size). Raises ValueError if ``n`` exceeds the pool."""
    pool = all_chat_prompts()
    if n > len(pool):
        raise ValueError(f"only {len(pool)} synthetic chat prompts, asked for {n}")
    rng = random.Random(seed)
    return rng.sample(pool, n)
