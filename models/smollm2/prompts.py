"""The SmolLM2 draft recipe's `prompts` step: instruction prompts built from packages only (no model or dataset
hub): the English questions of `chatterbot-corpus`, tasks over the Python 3.11 documentation's reST sources
(`python3.11-doc`), and everyday requests over common nouns of WordNet 3.0 (`wordnet-base`), the benchmark's
held-out prompts left out.
"""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

SYSTEM_PACKAGES = {"python3.11-doc": "deb", "wordnet-base": "deb"}
TASKS_DOC = ["Summarize the following paragraph in one or two sentences.\n\n{p}",
             "Explain the following text in simple words.\n\n{p}",
             "What is the main idea of this paragraph?\n\n{p}"]
TASKS_TERM = ["What is {t} in Python?", "Explain {t} in Python with a short example.",
              "Define the term \"{t}\"."]
TASKS_CODE = ["What does this Python code do?\n\n{c}", "Explain this code line by line.\n\n{c}"]
TASKS_SENT = ["Rewrite this sentence in simpler words: \"{s}\"", "Make this sentence more formal: \"{s}\""]
# everyday chat over common English nouns (WordNet 3.0, by lexicographer file); {a} is "a"/"an" + the noun
TASKS_ANY = ["Tell me three interesting facts about {x}.", "Explain {x} in simple terms.",
             "Write a short paragraph about {x}.", "Write a four-line poem about {x}.",
             "What are the pros and cons of {x}?", "Give a one-sentence definition of {x}.",
             "How would you explain {x} to a child?", "Write a tweet about {x}.",
             "Write a very short story that involves {a}.", "Why is {x} important?"]
TASKS_BY_KIND = {
    "food": ["What can I cook with {x}?", "Is {x} good for you? Answer briefly.", "Suggest a dish that uses {x}.",
             "How should {x} be stored?"],
    "animal": ["Where does {a} live and what does it eat?", "Write a short children's story about {a}.",
               "What makes {a} a good or bad pet?"],
    "artifact": ["What is {a} used for?", "How does {a} work?", "Write a short product description for {a}.",
                 "How do I clean {a}?"],
    "person": ["What does {a} do at work?", "Write a job advertisement for {a}.", "What skills does {a} need?"],
    "act": ["How do people get better at {x}?", "Give me advice about {x}.", "What is the history of {x}?"],
    "location": ["Describe {a} in a few sentences.", "What would I find in {a}?"],
    "plant": ["How do I take care of {a}?", "Where does {a} grow best?"],
    "feeling": ["How can someone deal with {x}?", "Write a short message to a friend who feels {x}."],
    "state": ["How can someone deal with {x}?", "What causes {x}?"],
    "phenomenon": ["What causes {x}?", "Explain {x} to a high-school student."],
    "substance": ["What is {x} made of?", "Where is {x} used in everyday life?"],
    "object": ["Describe {x} to someone who cannot see.", "What would happen without {x}?"],
    "possession": ["How can I save money on {x}?", "Explain {x} in one paragraph."],
}
LEX_KINDS = {4: "act", 5: "animal", 6: "artifact", 9: "cognition", 10: "communication", 12: "feeling", 13: "food",
             15: "location", 17: "object", 18: "person", 19: "phenomenon", 20: "plant", 21: "possession",
             26: "state", 27: "substance"}
TASKS_PAIR = ["Compare {x} and {y}.", "What is the difference between {x} and {y}?",
              "Write an email to a colleague about {x} and {y}."]
CODE_TASKS = ["reverse a string", "count the vowels in a sentence", "check whether a word is a palindrome",
              "compute the factorial of a number", "return the n-th Fibonacci number", "remove duplicates from a list",
              "sort a list of words by length", "find the second largest number in a list",
              "count how often each word occurs in a text", "check whether a number is prime",
              "convert Celsius to Fahrenheit", "merge two sorted lists", "flatten a nested list",
              "read a text file and print its lines", "sum the digits of an integer", "find common items of two lists",
              "capitalize every word in a sentence", "compute the average of a list of numbers",
              "check whether two words are anagrams", "split a list into chunks of size n"]
TASKS_CODE_GEN = ["Write a Python function to {t}.", "Show me how to {t} in Python.", "How can I {t} in Python?"]
ITEMS = ["notebooks", "apples", "tickets", "pencils", "shirts", "cups of coffee", "books", "plants"]


def _download(work: Path) -> tuple[Path, Path, Path]:
    """The three source packages, downloaded once into work/src (pip and apt, the user's own settings)."""
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    wheels = list(src.glob("chatterbot_corpus-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "chatterbot-corpus==1.3.3",
                        "-d", str(src)], check=True)
        wheels = list(src.glob("chatterbot_corpus-*.whl"))
    docs = src / "pydoc"
    if not docs.exists():
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=src, check=True)
        [deb] = src.glob("python3.11-doc_*.deb")
        subprocess.run(["dpkg", "-x", str(deb), str(docs)], check=True)
    wordnet = src / "wordnet"
    if not wordnet.exists():
        subprocess.run(["apt-get", "download", "wordnet-base"], cwd=src, check=True)
        [deb] = src.glob("wordnet-base_*.deb")
        subprocess.run(["dpkg", "-x", str(deb), str(wordnet)], check=True)
    return wheels[0], docs, wordnet


def chatterbot_questions(wheel: Path) -> list[str]:
    """The first turn of every English conversation (a question or a remark a user would type)."""
    import yaml

    out = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if "/english/" in name and name.endswith(".yml"):
                data = yaml.safe_load(z.read(name).decode("utf-8"))
                for conv in data.get("conversations") or []:
                    if conv and isinstance(conv[0], str) and 3 <= len(conv[0].split()) <= 30:
                        out.append(conv[0].strip())
    return out


def _clean(text: str) -> str:
    text = re.sub(r":[a-z:]+:`~?([^`<]+?)(?: <[^>]+>)?`", r"\1", text)    # :role:`target` -> target
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"`([^`<]+?)(?: <[^>]+>)?`_?", r"\1", text)
    return " ".join(text.split())


def doc_prompts(docs: Path, rng: random.Random) -> list[str]:
    """Tasks over the Python documentation: glossary terms, prose paragraphs, code examples, sentences."""
    root = next(docs.rglob("_sources"))
    terms, paras, codes, sents = [], [], [], []
    gloss = root / "glossary.rst.txt"
    if gloss.exists():
        terms = [m.group(1).strip() for m in re.finditer(r"^   ([^\s].{1,40})\n      \S", gloss.read_text("utf-8"), re.M)]
    for f in sorted(root.rglob("*.rst.txt")):
        text = f.read_text("utf-8", errors="replace")
        for block in re.split(r"\n\s*\n", text):
            lines = block.split("\n")
            if block.startswith(">>> ") and 2 <= len(lines) <= 12:
                codes.append(block.strip())
            elif all(l and not l.startswith((" ", ".", "=", "-", "*", "#", "+", "|", ">")) for l in lines):
                p = _clean(block)
                n = len(p.split())
                if 25 <= n <= 90 and p[-1] in ".!?" and "`" not in p and "::" not in p:
                    paras.append(p)
                    sents += [s for s in re.split(r"(?<=[.!?]) ", p) if 10 <= len(s.split()) <= 30]
    out = [rng.choice(TASKS_TERM).format(t=t) for t in terms]
    out += [rng.choice(TASKS_DOC).format(p=p) for p in rng.sample(paras, min(1200, len(paras)))]
    out += [rng.choice(TASKS_CODE).format(c=c) for c in rng.sample(codes, min(500, len(codes)))]
    out += [rng.choice(TASKS_SENT).format(s=s) for s in rng.sample(sents, min(500, len(sents)))]
    return out


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def general_prompts(wordnet: Path, rng: random.Random, per_kind: int = 220) -> list[str]:
    """Everyday chat requests: templates over common nouns of WordNet 3.0 (a sense tagged at least 3 times in its
    semantic concordance, cntlist.rev; once for food, animals and plants), pairs of them, small coding tasks and
    word problems. None is one of the held-out benchmark prompts (checked in build_prompts)."""
    by_kind: dict[str, set] = {}
    lines = next(wordnet.rglob("cntlist.rev")).read_text("utf-8").splitlines()
    for line in lines:
        key, _, count = line.split()
        lemma, sense = key.split("%")
        ss, lex = sense.split(":")[:2]
        kind = LEX_KINDS.get(int(lex))
        word = lemma.replace("_", " ")
        if (ss == "1" and kind and word.replace(" ", "").isalpha() and word == word.lower()
                and int(count) >= (1 if kind in ("food", "animal", "plant") else 3)):
            by_kind.setdefault(kind, set()).add(word)
    out = []
    for kind in sorted(by_kind):
        words = sorted(by_kind[kind])
        for x in rng.sample(words, min(per_kind, len(words))):
            tasks = TASKS_ANY + TASKS_BY_KIND.get(kind, []) * 2      # kind-specific requests twice as often
            out.append(rng.choice(tasks).format(x=x, a=_article(x)))
        for _ in range(per_kind // 6):
            x, y = rng.sample(words, 2)
            out.append(rng.choice(TASKS_PAIR).format(x=x, y=y))
    out += [t.format(t=c) for c in CODE_TASKS for t in TASKS_CODE_GEN]
    for _ in range(150):
        n, k, p = rng.randint(2, 12), rng.randint(3, 40), rng.randint(2, 30)
        item = rng.choice(ITEMS)
        out.append(rng.choice([f"One of the {item} costs {p} dollars. How much do {k} of them cost?",
                               f"I have {k} {item} and give away {min(n, k)}. How many are left? Explain.",
                               f"If {n} people share {k * n} {item} equally, how many does each get?"]))
    return out


def build_prompts(args) -> None:
    # the benchmark's prompts stay out of the training text (a data file: the recipe imports no benchmark code)
    held_out = Path(__file__).resolve().parents[2] / "bench" / "data" / "chat_prompts.json"
    HELD_OUT = json.loads(held_out.read_text(encoding="utf-8"))

    work = Path(args.work)
    wheel, docs, wordnet = _download(work)
    rng = random.Random(0)
    prompts = chatterbot_questions(wheel) + doc_prompts(docs, rng) + general_prompts(wordnet, rng)
    held = {p.lower() for p in HELD_OUT}
    seen, out = set(), []
    for p in prompts:
        if p.lower() not in held and p not in seen:
            seen.add(p)
            out.append(p)
    rng.shuffle(out)
    with open(work / "prompts.jsonl", "w", encoding="utf-8") as f:
        for i, p in enumerate(out):
            f.write(json.dumps({"id": i, "prompt": p}) + "\n")
    print(f"{len(out)} prompts -> {work / 'prompts.jsonl'}")
