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
The default model writes usable questions about a subject, but not messages in
a persona's voice (tried: it writes letters, or talks about itself), so a
second share (``chat``) asks about everyday subjects in the loose, personal
phrasings people type ("I'm trying to get better at ..."), from hand-written
lists that stay apart from the benchmark's subjects.

A fixed share of every subject pool is held out for evaluation, so held-out
acceptance is measured on subjects the draft never saw. Which subjects are held
out follows from each subject's text alone (a stable hash), not from the seed:
every seed and every stage of a draft trained in several (``--init-from``) holds
out the same ones, so a later stage's held-out subjects were never an earlier
stage's training subjects. The prompts of ``specbench/prompts/*.json`` (the
benchmark sets) are never used.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import random
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

HELD_OUT_SHARE = 0.03  # of every subject pool, never trained on
# how the held-out subjects are chosen (``Pools.held_out_by``): by each subject's text, the
# same whatever the seed; or, in pools kept by earlier versions, the first HELD_OUT_SHARE of
# each pool as the seed shuffled it (another seed then trains on most of them)
BY_SUBJECT = "subject"
BY_ORDER = "order"
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
CHAT_TEMPLATES = (  # everyday requests, phrased the way people type them
    "I'm trying to get better at {t}. Where should I start?",
    "Can you explain {t} in simple words, with an example?",
    "My friend asked me about {t} and I couldn't explain it. Can you help?",
    "Give me a step-by-step plan for {t}.",
    "What should a complete beginner know about {t}?",
    "I have about an hour this weekend. How could I make progress with {t}?",
    "Explain {t} to a ten-year-old.",
    "What do people often get wrong about {t}?",
    "Write a short, funny poem about {t}.",
    "Tell a very short story about {t}.",
    "Suggest three ideas to do with {t}, with one line on each.",
    "I'm a bit stressed about {t}. Any advice?",
    "How long does it usually take to get comfortable with {t}, and what helps most?",
    "Could you give me a quick checklist for {t}?",
    "Is {t} worth the effort? Give me an honest answer.",
    "Write a friendly note to a neighbour about {t}.",
    "Sum up the key things about {t} in a few bullet points.",
    "What is one surprising fact about {t}?",
    "I've never tried {t} before. What mistakes should I avoid?",
    "What's the quickest way to get started with {t}?",
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
CHAT_SUBJECTS = (  # for CHAT_TEMPLATES; apart from EVERYDAY, so streams without chat
    # prompts are those of earlier versions
    # home and cooking
    "descaling a kettle", "unclogging a bathroom sink", "getting rid of fruit flies",
    "ironing a shirt without creases", "removing a coffee stain from a carpet",
    "defrosting a freezer", "choosing a vacuum cleaner", "keeping a small flat tidy",
    "lowering the heating bill in winter", "fixing a wobbly table", "painting a wooden chair",
    "putting up a shelf", "sorting laundry", "storing winter clothes", "cleaning windows",
    "making a simple tomato sauce", "roasting vegetables", "boiling the perfect egg",
    "making homemade pizza dough", "cooking for one person", "meal prepping lunches",
    "making a fruit smoothie", "baking simple oat cookies", "making porridge",
    "seasoning food without much salt", "using up leftover rice", "making a curry from scratch",
    "sharpening kitchen knives", "choosing a frying pan", "freezing bread",
    "making lemonade", "hosting a dinner for six friends", "packing a healthy school lunch",
    "cooking pasta al dente", "making scrambled eggs fluffy", "baking a birthday cake",
    # garden and nature
    "growing strawberries in pots", "watering a lawn in summer", "attracting birds to a garden",
    "pruning a rose bush", "starting seeds indoors", "looking after a cactus",
    "keeping slugs off lettuce", "planting a small apple tree", "building a raised bed",
    "making a bird feeder", "identifying common trees", "watching the stars without a telescope",
    "why some birds fly south", "how rivers shape valleys", "why the ocean is salty",
    "how snowflakes form", "what makes wind blow", "how mushrooms grow",
    "why some animals hibernate", "how owls hunt at night", "how ants find food",
    "what causes fog", "how clouds form", "why stars twinkle", "how lightning forms",
    # pets
    "adopting a rescue dog", "walking a dog that pulls on the lead", "keeping a rabbit indoors",
    "introducing a new cat to the home", "choosing food for an older dog",
    "stopping a cat from scratching the sofa", "setting up a fish tank",
    "caring for a hamster", "travelling with a dog", "trimming a dog's nails",
    # health and fitness
    "starting to run at age forty", "doing push-ups with good form", "stretching at a desk",
    "walking ten thousand steps a day", "getting back to exercise after a break",
    "eating more vegetables", "cutting down on sugar", "drinking less coffee",
    "a short morning yoga routine", "staying active in cold weather", "preparing for a 5k race",
    "building a habit of daily walks", "keeping good posture", "swimming for fitness",
    "taking breaks from a screen", "dealing with a stiff neck", "learning to cycle as an adult",
    # money and work
    "opening a savings account", "paying off a credit card", "saving for a new phone",
    "understanding a payslip", "splitting bills with flatmates", "buying a used car",
    "asking for feedback from a manager", "writing a short CV", "preparing a presentation",
    "managing a busy week", "saying no to extra work politely",
    "working with a difficult colleague",
    "changing careers at thirty-five", "starting a small online shop", "pricing handmade crafts",
    "writing a clear email to a client", "taking notes in meetings",
    "organising a shared calendar",
    "leading a team for the first time", "returning to work after a long break",
    "handling a job rejection", "networking at an event", "setting goals for the year",
    # study and learning
    "learning to read music", "improving handwriting", "memorising vocabulary",
    "taking good notes in class", "writing an essay introduction", "revising for a maths test",
    "learning to draw faces", "reading more books", "learning basic Spanish phrases",
    "understanding fractions", "learning the times tables", "writing a book report",
    "doing a science fair project", "learning to code as a teenager", "understanding decimals",
    "speed reading", "learning to juggle", "solving a Rubik's cube",
    # family and social
    "planning a family picnic", "talking to a teenager about phones",
    "helping a child with homework",
    "choosing a gift for a grandparent", "writing a birthday card message",
    "keeping in touch with old friends", "apologising to a friend", "meeting a partner's parents",
    "hosting a games night", "planning a surprise party", "helping a shy child make friends",
    "sharing chores fairly at home", "welcoming a new neighbour", "organising a school fundraiser",
    "reading bedtime stories to a toddler", "teaching a child to ride a scooter",
    # travel and places
    "packing light for a week away", "travelling by train across Europe",
    "visiting a museum with kids",
    "planning a road trip", "staying safe while hiking", "learning a few words before a trip",
    "choosing a tent", "travelling cheaply", "getting over a fear of flying",
    "exploring a new city in one day", "sending postcards", "camping in the rain",
    # hobbies and creativity
    "starting a vegetable patch", "taking up pottery", "learning to knit socks",
    "writing a first short story", "starting a podcast", "learning watercolour painting",
    "playing the ukulele", "building a model train", "collecting stamps", "bird watching",
    "doing a jigsaw puzzle", "learning magic tricks", "baking bread by hand", "sewing on a button",
    "making candles", "starting a blog", "keeping a nature diary", "learning to dance salsa",
    "taking up chess", "making a family photo album", "writing song lyrics", "fishing in a lake",
    # technology for everyday life
    "setting up a new phone", "freeing up space on a laptop", "making a video call",
    "choosing headphones", "protecting a phone from scams", "sharing photos with family",
    "using a spreadsheet to track spending", "setting up a home printer",
    "speeding up a slow computer",
    "keeping children safe online", "writing a good online review", "using a smart speaker",
    "learning keyboard shortcuts", "making a simple website", "choosing an e-reader",
    "turning off notifications", "recording a voice memo", "scanning old photos",
    # history and curiosities
    "how the pyramids were built", "the first moon landing", "how ancient people told time",
    "the history of the Olympic Games", "how castles were defended", "the invention of paper",
    "how the first cars worked", "why we have leap years", "how money was invented",
    "the history of ice cream",
    "why the dinosaurs died out", "how the alphabet developed", "the story of the first computers",
    "how trains changed travel", "how bridges stay up",
    "how a microwave heats food", "how a camera takes a picture", "why ice floats",
    "how a seed knows which way is up", "why we yawn", "how our eyes see colour",
    "why metal feels cold", "how a plane's wings create lift",
    "why the moon looks bigger near the horizon",
    # story and poem subjects
    "a grandmother's secret recipe", "a robot who wants to be a gardener", "a shy giraffe",
    "a rainy day at the zoo", "a cat who runs a bookshop", "a boy who finds a map in the attic",
    "the last leaf on a tree", "a dog's first day at the beach", "a bakery that opens at midnight",
    "a friendly ghost in a school", "a penguin who wants to fly", "a tiny dragon in a teacup",
    "a moving day", "a snow day off school", "a lost key", "a picnic interrupted by ants",
    "a street musician", "a sunflower in a city", "an astronaut's first morning in space",
    "a fox in the snow", "a summer thunderstorm", "an old piano", "a pair of worn-out boots",
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
    chat: list[str] = field(default_factory=list)  # everyday subjects of chat requests
    # (empty in pools kept by earlier versions, which had none)
    code: list[str] = field(default_factory=list)  # short standard-library functions'
    # sources, for code edits (empty in pools kept by earlier versions)
    held_out_by: str = BY_SUBJECT  # see BY_SUBJECT, BY_ORDER

    def __post_init__(self) -> None:
        if self.held_out_by not in (BY_SUBJECT, BY_ORDER):
            raise ValueError(f"unknown held-out split {self.held_out_by!r}")


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


MIN_CODE_LINES = 4
MAX_CODE_LINES = 24
MAX_CODE_CHARS = 900


def stdlib_functions() -> list[str]:
    """The sources of short standard-library functions (methods too, dedented), for the
    code-edit tasks."""
    import textwrap

    root = Path(sysconfig.get_paths()["stdlib"])
    public = {m for m in sys.stdlib_module_names if not m.startswith("_")}
    out: set[str] = set()
    for path in sorted(root.glob("*.py")):
        if path.stem not in public or path.stem in {"antigravity", "this"}:
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
                continue
            source = ast.get_source_segment(text, node)
            if source is None:
                continue
            source = textwrap.dedent(" " * node.col_offset + source)
            lines = source.count("\n") + 1
            if MIN_CODE_LINES <= lines <= MAX_CODE_LINES and len(source) <= MAX_CODE_CHARS:
                out.add(source)
    return sorted(out)


def load_pools(seed: int) -> Pools:
    topics = debian_descriptions()
    everyday = list(EVERYDAY)
    python, passages = stdlib_docs()
    chat = list(CHAT_SUBJECTS)
    rng = random.Random(seed)
    code = stdlib_functions()
    for pool in (topics, everyday, python, passages, chat, code):  # earlier pools shuffle
        rng.shuffle(pool)  # as before
    log.info("prompt pools: %d topics, %d everyday, %d python names, %d passages, "
             "%d chat subjects, %d functions", len(topics), len(everyday), len(python),
             len(passages), len(chat), len(code))
    return Pools(topics=topics, everyday=everyday, python=python, passages=passages, chat=chat,
                 code=code)


def split(pool: list[str], held_out: bool, by: str = BY_SUBJECT) -> list[str]:
    """The held-out subjects of ``pool`` (``held_out``) or the others, in pool order. By
    subject: those whose mark is at most ``HELD_OUT_SHARE``, and in a pool where none is,
    the one with the lowest mark, so every kind of prompt has held-out subjects (a pool of one
    has none)."""
    if by == BY_ORDER:
        cut = max(1, int(len(pool) * HELD_OUT_SHARE)) if len(pool) > 1 else 0
        return pool[:cut] if held_out else pool[cut:]
    if len(pool) <= 1:
        return [] if held_out else list(pool)
    marks = [held_out_mark(subject) for subject in pool]
    line = max(HELD_OUT_SHARE, min(marks))
    return [s for s, mark in zip(pool, marks, strict=True) if (mark <= line) == held_out]


def held_out_mark(subject: str) -> float:
    """A number in [0, 1) fixed by the subject's text (the same on every machine)."""
    digest = hashlib.sha256(subject.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def prompts(pools: Pools, seed: int, held_out: bool = False, questions: float = 0.0,
            chat: float = 0.0) -> Iterator[Prompt]:
    """An endless, deterministic stream of user messages (train or held-out subjects);
    about ``questions`` of them are asks (the target writes the message) and about
    ``chat`` of them everyday requests (``CHAT_TEMPLATES`` on the chat subjects)."""
    rng = random.Random(seed * 1_000_003 + (1 if held_out else 0))
    parts = {name: split(getattr(pools, name), held_out, pools.held_out_by)
             for name in ("topics", "everyday", "python", "passages", "chat")}
    kinds = [
        (parts["topics"], TOPIC_TEMPLATES, 0.4),
        (parts["everyday"], TOPIC_TEMPLATES, 0.12),
        (parts["python"], PYTHON_TEMPLATES, 0.15),
        (parts["passages"], PASSAGE_TEMPLATES, 0.33),
    ]
    if not 0 <= questions < 1:
        raise ValueError(f"the share of questions must be in [0, 1), not {questions}")
    if not 0 <= chat < 1 or questions + chat >= 1:
        raise ValueError(f"the share of chat requests must be in [0, 1) and leave room for "
                         f"the other kinds with {questions} questions, not {chat}")
    # weights relative to the kinds above (1.0 in all): with neither asks nor chat
    # requests, the kinds and weights of earlier versions
    rest = 1 - questions - chat
    if questions > 0:
        share = questions / rest / 2
        kinds += [(parts["everyday"], ASK_TEMPLATES, share),
                  (parts["topics"], ASK_TEMPLATES, share)]
    if chat > 0:
        kinds.append((parts["chat"], CHAT_TEMPLATES, chat / rest))
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
