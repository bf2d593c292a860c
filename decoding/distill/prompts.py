"""Diverse chat prompts built offline, for the target to answer.

The lesson of the first throwaway draft was that a draft trained on a few
templated topics does not generalise, so the prompts here come from broad text
that every machine already has: the one-line descriptions of Debian's ~60k
packages (``apt-cache dumpavail``, offline once ``apt-get update`` has run) and
the docstrings of the Python standard library (read with ``ast``, nothing is
imported), plus everyday subjects. Each subject is wrapped in one of many
instructions of the kinds chat users send: explanations, how-tos, creative
pieces, advice, and edits of a given passage (rewrite, summarise, list, fix).

Templates alone ask in few ways, and real users ask in many: a share of the
stream (``questions``) is therefore an *ask*, an instruction to the target to
write a question about a subject. The data phase samples the target's answer
and, where a question can be read out of it (``extract_question``), the target
then answers that question greedily; otherwise the ask itself is the prompt.

A fixed share of every subject pool is held out for evaluation, so held-out
acceptance is measured on subjects the draft never saw. The prompts of
``decoding/prompts/*.json`` (the benchmark sets) are never used.
"""

from __future__ import annotations

import ast
import logging
import random
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HELD_OUT_SHARE = 0.03  # of every subject pool, never trained on
MAX_PASSAGE_CHARS = 700
MIN_PASSAGE_CHARS = 160

TOPIC_TEMPLATES = (
    "What is {t}? Explain briefly.",
    "Explain to a beginner what {t} is and why someone would use it.",
    "Give me a short overview of {t}.",
    "How do I get started with {t}? Give a few simple steps.",
    "What are three practical tips for working with {t}?",
    "Write a short poem about {t}.",
    "Tell a very short story in which {t} plays an important part.",
    "Write a cheerful four-line rhyme about {t}.",
    "I am thinking about trying {t}. What should I know first?",
    "What are common mistakes people make with {t}, and how can they avoid them?",
    "List the pros and cons of {t} in a few bullet points.",
    "Suggest five catchy names for a project about {t}.",
    "Describe {t} in one paragraph for a newsletter.",
    "Why might someone care about {t}? Answer in two or three sentences.",
    "Compare {t} with a common alternative and say when each is better.",
    "Write a short, friendly email recommending {t} to a colleague.",
)
ASK_TEMPLATES = (  # the target writes the user's message
    "Write one question a person might ask an AI assistant about {t}. "
    "Reply with only the question.",
    "Write one question a curious beginner might ask about {t}. Reply with only the question.",
    "Write one specific question someone could ask a friend who knows a lot about {t}. "
    "Reply with only the question.",
    "What might someone ask a helpful assistant about {t}? Write only their question.",
)
PYTHON_TEMPLATES = (
    "In Python, what does {t} do? Show a short example.",
    "How do I use Python's {t}?",
    "Explain Python's {t} to someone new to programming.",
    "When should I use {t} in Python, and when should I avoid it?",
    "Write a small Python function that uses {t}, and explain it.",
    "What is a common mistake when using Python's {t}?",
)
PASSAGE_TEMPLATES = (
    "Summarise the following text in two sentences.\n\n{t}",
    "Rewrite this text in a more formal tone.\n\n{t}",
    "Rewrite the following for a reader with no technical background.\n\n{t}",
    "Turn this text into a bulleted list of its key points.\n\n{t}",
    "Fix any grammar or spelling mistakes in this paragraph and return it.\n\n{t}",
    "Rewrite the following text in the past tense.\n\n{t}",
    "Shorten this text to about half its length, keeping the meaning.\n\n{t}",
    "Explain in plain language what this documentation says.\n\n{t}",
    "List every name, option or function that this text mentions.\n\n{t}",
    "Write one question a reader might ask after reading this, and answer it.\n\n{t}",
)
EVERYDAY = (
    "learning to play the guitar", "a morning running routine", "saving money on groceries",
    "planting tomatoes on a balcony", "training a puppy", "cooking rice on the stove",
    "writing a cover letter", "learning a second language", "keeping a journal",
    "packing for a weekend trip", "making cold brew coffee", "cleaning a cast iron pan",
    "public speaking nerves", "a rainy afternoon at home", "choosing a laptop",
    "organising a small bookshelf", "baking banana bread", "caring for a goldfish",
    "the water cycle", "how volcanoes form", "why leaves change colour in autumn",
    "the phases of the moon", "how airplanes stay in the air", "photosynthesis",
    "the history of the printing press", "how batteries store energy", "recycling plastic",
    "the migration of birds", "how the heart pumps blood", "earthquakes",
    "a friendly neighbourhood cat", "an old wooden boat", "a snowy mountain village",
    "a robot learning to paint", "a dragon who is afraid of the dark", "a busy train station",
    "a forgotten garden", "a kite on a windy day", "the first day of spring",
    "moving to a new city", "asking for a raise", "studying for an exam",
    "resolving a disagreement with a friend", "staying focused while working from home",
    "starting a book club", "preparing for a job interview", "teaching a child to swim",
    "planning a birthday party", "reducing screen time", "drinking enough water",
    "the rules of chess", "how a bill becomes a law", "inflation", "supply and demand",
    "the scientific method", "black holes", "the Roman Empire", "the invention of the telephone",
    "how search engines work", "what a database is", "password security", "backing up photos",
    "unit testing", "recursion", "sorting algorithms", "HTTP requests", "regular expressions",
    "version control", "cloud storage", "spreadsheets", "time zones", "prime numbers",
    "fractions", "the Pythagorean theorem", "probability with dice", "percentages",
    "repairing a flat tyre", "making pancakes", "brewing green tea", "painting a bedroom wall",
    "choosing running shoes", "a first camping trip", "hanging a picture frame",
    "growing herbs indoors", "composting kitchen scraps", "storing fresh vegetables",
    "writing a thank-you note", "giving a wedding toast", "negotiating rent",
    "learning to touch type", "memorising a speech", "keeping houseplants alive in winter",
    "stretching after exercise", "taking better phone photos", "organising a closet",
    "making friends in a new town", "dealing with jet lag", "choosing a board game for a party",
    "teaching a parrot to talk", "making a simple vegetable soup",
    "knitting a scarf", "fixing a squeaky door", "making a paper airplane",
    "the life cycle of a butterfly", "how bees make honey", "why the sky is blue",
    "how a refrigerator keeps food cold", "how glaciers move", "why cats purr",
    "how tea is grown", "what causes thunder", "how coral reefs form",
    "the history of chocolate", "how maps are made", "the invention of the bicycle bell",
    "how elevators work", "why bread rises", "how a compass works", "the speed of sound",
    "a lost umbrella", "a talking teapot", "a lonely snowman", "a clockmaker's apprentice",
    "a night market", "a library after closing time", "a sailor's last voyage",
    "email etiquette at work", "running a short meeting", "writing a clear bug report",
    "naming variables", "reading error messages", "spreadsheet formulas",
    "keyboard shortcuts", "choosing a strong password manager", "renaming many files at once",
)


@dataclass(frozen=True)
class Prompt:
    """One user message, or (``ask``) an instruction to the target to write one."""

    text: str
    ask: bool = False


@dataclass(frozen=True)
class Pools:
    """Subjects by kind; each list is already shuffled with the seed."""

    topics: list[str]  # noun phrases (Debian package descriptions)
    everyday: list[str]  # everyday subjects
    python: list[str]  # names of standard-library modules, classes and functions
    passages: list[str]  # docstring paragraphs


def debian_descriptions() -> list[str]:
    """Package one-liners from the local apt lists; empty when apt is not there."""
    if shutil.which("apt-cache") is None:
        return []
    try:
        text = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True,
                              check=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    seen: set[str] = set()
    out: list[str] = []
    skip = re.compile(r"debug symbols|transitional|development files|header files|"
                      r"\bdummy\b|\(data\)|documentation|library|module for|bindings|"
                      r"metapackage|meta-package", re.I)
    for line in text.splitlines():
        if not line.startswith("Description: "):
            continue
        desc = line[len("Description: "):].strip().rstrip(".")
        key = desc.lower()
        if key in seen or not 12 <= len(desc) <= 80 or skip.search(desc):
            continue
        seen.add(key)
        out.append(desc[0].lower() + desc[1:] if desc[1:2].islower() else desc)
    return sorted(out)


def stdlib_docs() -> tuple[list[str], list[str]]:
    """(qualified names with a docstring, docstring paragraphs) from the stdlib sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names: set[str] = set()
    passages: set[str] = set()
    public = {m for m in sys.stdlib_module_names if not m.startswith("_")}
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/__init__.py")):
        module = path.stem if path.name != "__init__.py" else path.parent.name
        if module not in public or module in {"antigravity", "this"}:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in [tree, *ast.walk(tree)]:
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            if isinstance(node, ast.Module):
                names.add(f"{module} module")
            elif not node.name.startswith("_"):
                names.add(f"{module}.{node.name}")
            for para in re.split(r"\n\s*\n", doc):
                flat = " ".join(para.split())
                if MIN_PASSAGE_CHARS <= len(flat) <= MAX_PASSAGE_CHARS and ">>>" not in flat:
                    passages.add(flat)
    return sorted(names), sorted(passages)


def load_pools(seed: int) -> Pools:
    topics = debian_descriptions()
    everyday = list(EVERYDAY)
    python, passages = stdlib_docs()
    rng = random.Random(seed)
    for pool in (topics, everyday, python, passages):
        rng.shuffle(pool)
    log.info("prompt pools: %d topics, %d everyday, %d python names, %d passages",
             len(topics), len(everyday), len(python), len(passages))
    return Pools(topics=topics, everyday=everyday, python=python, passages=passages)


def split(pool: list[str], held_out: bool) -> list[str]:
    cut = max(1, int(len(pool) * HELD_OUT_SHARE)) if len(pool) > 1 else 0
    return pool[:cut] if held_out else pool[cut:]


def prompts(pools: Pools, seed: int, held_out: bool = False, questions: float = 0.0
            ) -> Iterator[Prompt]:
    """An endless, deterministic stream of user messages (train or held-out subjects);
    about ``questions`` of them are asks (the target writes the message)."""
    rng = random.Random(seed * 1_000_003 + (1 if held_out else 0))
    kinds = [
        (split(pools.topics, held_out), TOPIC_TEMPLATES, 0.4),
        (split(pools.everyday, held_out), TOPIC_TEMPLATES, 0.12),
        (split(pools.python, held_out), PYTHON_TEMPLATES, 0.15),
        (split(pools.passages, held_out), PASSAGE_TEMPLATES, 0.33),
    ]
    if not 0 <= questions < 1:
        raise ValueError(f"the share of questions must be in [0, 1), not {questions}")
    if questions > 0:  # without asks, the kinds and weights of earlier versions
        share = questions / (1 - questions) / 2  # of the other kinds' total weight (1.0)
        kinds += [(split(pools.everyday, held_out), ASK_TEMPLATES, share),
                  (split(pools.topics, held_out), ASK_TEMPLATES, share)]
    kinds = [k for k in kinds if k[0]]
    if not kinds:
        raise RuntimeError("no prompt sources found (no apt lists and no stdlib sources)")
    cursors = [0] * len(kinds)
    weights = [k[2] for k in kinds]
    while True:
        i = rng.choices(range(len(kinds)), weights=weights)[0]
        pool, templates, _ = kinds[i]
        subject = pool[cursors[i] % len(pool)]
        cursors[i] += 1
        yield Prompt(rng.choice(templates).format(t=subject), ask=templates is ASK_TEMPLATES)


_QUOTED = re.compile(r'"([^"\n]+)"|\u201c([^\u201d\n]+)\u201d')
_LABEL = re.compile(r"^(?:question|q|a|user|request)\s*:\s*", re.I)
MIN_QUESTION_CHARS = 12
MAX_QUESTION_CHARS = 300


def extract_question(answer: str) -> str | None:
    """The question in the target's reply to an ask: the first quoted question, else the
    whole reply when it is one line that ends with '?'; None when neither is there."""
    for match in _QUOTED.finditer(answer):
        quoted = (match.group(1) or match.group(2)).strip()
        if quoted.endswith("?") and MIN_QUESTION_CHARS <= len(quoted) <= MAX_QUESTION_CHARS:
            return quoted
    line = _LABEL.sub("", answer.strip()).strip().strip('"').strip()
    if ("\n" not in line and line.endswith("?")
            and MIN_QUESTION_CHARS <= len(line) <= MAX_QUESTION_CHARS):
        return line
    return None
