"""Where self-distillation prompts come from, and which ones are kept out.

- `read_prompts`: a prompt file, in the evaluation/EAGLE format (`{"turns": [...]}`),
  ShareGPT/OpenAI chat (`{"messages": [...]}` or `{"conversations": [{"from", "value"}]}`),
  `{"prompt": ...}` records, or plain text with one prompt a line.
- `openers`: the topic x task x format grid the target writes its own questions from when no
  prompt file is given; `opener(rng)` draws one.
- `EvalIndex`: prompts that overlap an evaluation set (equal, containing, contained, or sharing a
  12-word n-gram) never enter training data.

A prompt is a list of chat messages ending in a user turn (`--raw`: the text of that turn).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

EVAL_SETS = ("mt_bench", "gsm8k", "humaneval")
NGRAM = 12
MIN_CONTAINED_CHARS = 20   # very short strings are "contained in" almost any prompt
PROMPT_FORMATS = "jsonl with `turns`, `messages`, `conversations` or `prompt` per line, or .txt with one prompt a line"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


class PromptError(ValueError):
    pass


# ----- prompt files -----------------------------------------------------------------------------

def _first_user_turn(messages: list[dict], where: str) -> list[dict]:
    """The conversation up to and including its first user turn (a system turn before it stays)."""
    out = []
    for m in messages:
        role = ROLES.get(str(m.get("role", m.get("from", ""))).lower())
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            raise PromptError(f"{where}: a message needs a role (user/assistant/system or from: human/gpt) "
                              f"and text content; got {json.dumps(m)[:120]}")
        out.append({"role": role, "content": content})
        if role == "user":
            return out
    raise PromptError(f"{where}: the conversation has no user turn")


def read_prompts(path) -> list[list[dict]]:
    """Every prompt of the file, in order, as messages ending in a user turn (empty ones dropped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file")
    text = path.read_text(encoding="utf-8")
    prompts = []
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptError(f"{where}: not valid JSON ({err.msg}); expected {PROMPT_FORMATS}") from None
            if not isinstance(record, dict):
                raise PromptError(f"{where}: expected a JSON object per line ({PROMPT_FORMATS})")
            if isinstance(record.get("turns"), list) and record["turns"]:
                messages = [{"role": "user", "content": str(record["turns"][0])}]
            elif isinstance(record.get("messages") or record.get("conversations"), list):
                messages = _first_user_turn(record.get("messages") or record["conversations"], where)
            elif isinstance(record.get("prompt"), str):
                messages = [{"role": "user", "content": record["prompt"]}]
            else:
                raise PromptError(f"{where}: unknown record format (keys {sorted(record)[:8]}); expected "
                                  f"{PROMPT_FORMATS}")
            if messages[-1]["content"].strip():
                prompts.append(messages)
    elif path.suffix.lower() in (".txt", ".md", ""):
        prompts = [[{"role": "user", "content": ln.strip()}] for ln in text.splitlines() if ln.strip()]
    else:
        raise PromptError(f"--prompts {path}: unknown format {path.suffix!r}; expected {PROMPT_FORMATS}")
    if not prompts:
        raise PromptError(f"--prompts {path} holds no prompt")
    return prompts


# ----- openers: the target writes its own questions from these ---------------------------------

TOPICS = [
    # science and nature
    "photosynthesis", "black holes", "plate tectonics", "the immune system", "climate change", "volcanoes",
    "the water cycle", "DNA and genes", "evolution", "antibiotics", "the solar system", "quantum computing",
    "nuclear energy", "ocean currents", "bees and pollination", "sleep", "the human brain", "vaccines",
    "rainforests", "earthquakes", "the speed of light", "chemical reactions", "electricity", "magnets",
    # history and society
    "the French Revolution", "ancient Rome", "the printing press", "the Industrial Revolution",
    "the Silk Road", "World War II", "the Cold War", "democracy", "the Renaissance", "ancient Egypt",
    "the civil rights movement", "the history of money", "colonialism", "the moon landing",
    "the invention of the internet", "human rights", "urbanization", "immigration",
    # economy and work
    "inflation", "the stock market", "personal budgeting", "starting a small business", "remote work",
    "job interviews", "negotiating a salary", "marketing a product", "customer service", "taxes",
    "retirement savings", "supply and demand", "cryptocurrency", "team leadership", "writing a resume",
    # everyday life
    "healthy eating", "running a marathon", "learning a new language", "time management", "public speaking",
    "gardening", "cooking pasta", "baking bread", "traveling to Japan", "moving to a new city", "raising a puppy",
    "cleaning a kitchen", "saving energy at home", "making friends as an adult", "dealing with stress",
    "planning a wedding", "buying a used car", "studying for exams", "parenting teenagers", "meditation",
    # arts and culture
    "jazz music", "impressionist painting", "film noir", "Shakespeare's plays", "poetry", "photography",
    "video games", "architecture", "fashion trends", "street art", "classical music", "science fiction novels",
    # technology and programming
    "Python lists and dictionaries", "recursion", "sorting algorithms", "binary search", "hash tables",
    "linked lists", "SQL joins", "REST APIs", "git branching", "unit testing", "regular expressions",
    "object-oriented design", "memory management", "concurrency and threads", "web security",
    "machine learning", "neural networks", "databases", "cloud computing", "Linux command line",
    "JavaScript promises", "data cleaning with pandas", "string manipulation", "dynamic programming",
    "graph algorithms", "file handling", "error handling", "APIs in JavaScript", "C pointers",
    # mathematics
    "fractions", "percentages", "probability", "prime numbers", "linear equations", "geometry of circles",
    "statistics", "compound interest", "ratios and rates", "area and perimeter", "derivatives", "integrals",
    "matrices", "logarithms", "number sequences", "unit conversion", "averages", "simple interest",
]

TASKS = [
    "Explain", "Explain to a ten-year-old", "Explain step by step", "Describe", "Summarize what is known about",
    "Compare two views on", "What are the pros and cons of", "What are common misconceptions about",
    "Give me practical tips on", "Write a short story involving", "Write a poem about", "Write a blog post about",
    "Write a persuasive essay on", "Write an email to a colleague about", "Write a dialogue about",
    "Create a quiz about", "Create a study plan for", "Make a checklist for", "Brainstorm ideas related to",
    "Give an analogy for", "Answer a beginner's question about", "Pose and solve a word problem about",
    "Write a Python function related to", "Write code that demonstrates", "Debug a common mistake with",
    "Design a small project about", "Review this argument about", "Rewrite this paragraph about",
    "Translate into simple English a text about", "List surprising facts about", "Tell me the history of",
    "What would happen if there were no", "How do experts approach", "Help me decide about",
    "Critique a popular claim about", "Outline a lecture on", "Give a worked example of",
]

FORMATS = [
    "", "", "", "", " in three sentences", " as a bulleted list", " step by step", " with an example",
    " in a table", " in under 100 words", " for a beginner", " for an expert", " with code", " as a numbered list",
    " in a friendly tone", " in a formal tone", " with a short summary at the end",
]

FREE_OPENERS = [
    "Why do", "How can I", "What is the difference between", "Can you help me", "Is it true that",
    "Should I", "I need advice on", "My friend says", "Imagine", "Fix this code:", "Given a list of integers,",
    "A store sells", "If a train travels", "Solve for x:", "What does this code do?", "Write a SQL query",
    "Calculate", "John has", "Prove that", "Given a string s,", "Write a function in JavaScript",
]


def opener(rng: random.Random) -> str:
    """One user-turn opener: a task on a topic in a format (9 of 10 draws), else a free opener."""
    if rng.random() < 0.1:
        return rng.choice(FREE_OPENERS)
    return f"{rng.choice(TASKS)} {rng.choice(TOPICS)}{rng.choice(FORMATS)}"


# ----- evaluation prompts stay out ------------------------------------------------------------

def normalize(text: str) -> str:
    """Lower case with all whitespace runs collapsed to one space."""
    return " ".join(text.lower().split())


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


class EvalIndex:
    """Normalised eval prompts and their word n-grams, for fast lookups."""

    def __init__(self, prompts: list[str], n: int = NGRAM) -> None:
        self.prompts, self.n = list(prompts), n
        self.normalized = [normalize(p) for p in self.prompts]
        self.grams = set()
        for p in self.prompts:
            self.grams |= ngrams(words(p), self.n)

    def overlap(self, text: str) -> str | None:
        """Why ``text`` overlaps an eval prompt, or None when it does not."""
        q = normalize(text)
        if not q:
            return None
        for i, e in enumerate(self.normalized):
            if q == e:
                return f"equals eval prompt {i}"
            if e in q:
                return f"contains eval prompt {i}"
            if len(q) >= MIN_CONTAINED_CHARS and q in e:
                return f"is contained in eval prompt {i}"
        shared = ngrams(words(text), self.n) & self.grams
        if shared:
            return f"shares a {self.n}-word n-gram with an eval prompt: {' '.join(next(iter(shared)))!r}"
        return None


def load_eval_prompts(eval_dir) -> list[str]:
    """Every turn of every eval question (turns[0] and any follow-ups)."""
    prompts = []
    for name in EVAL_SETS:
        path = Path(eval_dir) / name / "question.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"evaluation prompts not found: {path}")
        with path.open(encoding="utf-8") as f:
            prompts.extend(t for line in f if line.strip() for t in json.loads(line)["turns"])
    return prompts


def default_eval_dir() -> Path | None:
    """$SPD_EVAL_DIR, else ../shared/eval_data beside this checkout or the working folder, if present."""
    if os.environ.get("SPD_EVAL_DIR"):
        return Path(os.environ["SPD_EVAL_DIR"])
    for base in (Path(__file__).resolve().parents[3], Path.cwd()):
        candidate = base.parent / "shared" / "eval_data"
        if candidate.is_dir():
            return candidate
    return None
