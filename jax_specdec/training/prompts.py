"""Prompts whose continuations by the target make a drafter's training data: requests in
the target's chat format and code to complete, each in a training and a held-out split.

Chat requests are instruction templates filled with subjects, wrapped as SmolLM2-Instruct's
chat template writes one user turn (ChatML with its default system turn); every tenth
request (by a hash of its text) is held out. Code prompts are the openings of functions
(their `def` line and what follows, up to a few lines) in the corpus files: those of the
corpus' training files for training, of its validation files for the held-out split.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

__all__ = ["SPLITS", "Prompt", "chat", "chat_requests", "code_openings", "prompts"]

SPLITS = ("train", "held_out")

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_TEMPLATES = (
    "Explain {} in simple terms.",
    "What is {}? Answer in a short paragraph.",
    "Give me three facts about {}.",
    "Write a short poem about {}.",
    "Summarize what people should know about {}.",
    "Why is {} important?",
    "Write a tweet about {}.",
    "List the pros and cons of {}.",
    "How would you teach a child about {}?",
    "Write a short story that involves {}.",
    "What are common misconceptions about {}?",
    "Describe {} to someone who has never heard of it.",
)

_SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution",
    "machine learning", "climate change", "the immune system", "volcanoes", "democracy",
    "the stock market", "recycling", "the moon landing", "honey bees", "earthquakes",
    "the internet", "vaccines", "the Roman Empire", "electric cars", "sleep",
    "meditation", "coffee", "the human brain", "rainbows", "gravity", "chess",
    "the ocean tides", "solar panels", "dinosaurs", "inflation", "friendship",
    "the printing press", "bread baking", "marathon running", "the Great Wall of China",
    "DNA", "cloud computing", "bicycles", "volunteering", "the Amazon rainforest",
    "public libraries", "time zones", "the periodic table", "jazz music", "compound interest",
    "password security", "the speed of light", "migratory birds", "urban gardening",
    "the Olympic Games", "antibiotics", "renewable energy", "ancient Egypt", "robots",
    "learning a new language", "healthy breakfasts", "the Pythagorean theorem",
    "open source software", "thunderstorms", "the Renaissance", "penguins",
)  # fmt: skip

_CODE_TEMPLATES = (
    "Write a Python function that {}.",
    "How do I write Python code that {}? Show an example.",
    "Write a function in JavaScript that {}.",
    "Explain, with a short Python example, how to write code that {}.",
)

_TASKS = (
    "reverses a string", "checks whether a number is prime", "merges two sorted lists",
    "counts the words in a text file", "computes the factorial of n",
    "finds the largest element of a list", "removes duplicates from a list",
    "reads a CSV file and prints each row", "returns the n-th Fibonacci number",
    "checks whether a string is a palindrome", "sorts a list of dictionaries by a key",
    "converts Celsius to Fahrenheit", "flattens a nested list", "validates an email address",
    "computes the mean and median of a list", "finds the common elements of two lists",
    "parses a date string", "counts how often each character occurs",
    "implements binary search", "downloads a web page", "writes a dictionary to JSON",
    "capitalizes every word of a sentence", "generates a random password",
    "checks whether two strings are anagrams", "transposes a matrix",
    "implements a stack class", "computes the greatest common divisor",
    "groups a list of words by their first letter", "finds the second smallest number",
    "retries a function call three times",
)  # fmt: skip


def chat(text: str) -> str:
    """`text` as one user turn in SmolLM2-Instruct's chat template, ready for the
    assistant's answer."""
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _split_of(text: str) -> str:
    return "held_out" if hashlib.sha256(text.encode()).digest()[0] % 10 == 0 else "train"


def chat_requests(split: str) -> list[str]:
    """Every templated request of `split` (unwrapped), in a fixed order."""
    _check_split(split)
    texts = [t.format(s) for t in _TEMPLATES for s in _SUBJECTS]
    texts += [t.format(s) for t in _CODE_TEMPLATES for s in _TASKS]
    return [t for t in texts if _split_of(t) == split]


_DEF = re.compile(r"^[ \t]*(async[ \t]+)?def [A-Za-z_]\w*\(", re.MULTILINE)


def code_openings(sources, lines: int = 4) -> list[str]:
    """The opening of every function in `sources` (file texts): its `def` line and the
    `lines - 1` lines after it, dedented to the def's indentation."""
    if lines < 1:
        raise ValueError(f"lines must be >= 1, got {lines}")
    openings = []
    for text in sources:
        for match in _DEF.finditer(text):
            block = text[match.start() :].split("\n")[:lines]
            indent = len(block[0]) - len(block[0].lstrip())
            openings.append("\n".join(line[indent:] for line in block))
    return openings


class Prompt(NamedTuple):
    """A prompt text and whether its continuation is the target's greedy one (else sampled)."""

    text: str
    greedy: bool


def prompts(split: str, code_sources, *, count: int, code_share: float = 0.5) -> list[Prompt]:
    """`count` prompts of `split`, interleaved: chat requests (wrapped by `chat`) and code
    openings of `code_sources`, about `code_share` of them code. A chat request's first
    use is continued greedily and its repeats (when `count` asks for more requests than
    there are) are sampled; every other code opening is sampled."""
    _check_split(split)
    if not 0.0 <= code_share <= 1.0:
        raise ValueError(f"code_share must lie in [0, 1], got {code_share}")
    code = code_openings(code_sources)
    n_code = min(round(count * code_share), len(code))
    requests = [chat(t) for t in chat_requests(split)]
    n_chat = count - n_code
    if n_chat and not requests:
        raise ValueError(f"no chat requests in split {split!r}")
    code = code[:: max(len(code) // max(n_code, 1), 1)][:n_code]
    chats = [Prompt(requests[i % len(requests)], i < len(requests)) for i in range(n_chat)]
    codes = [Prompt(text, i % 2 == 0) for i, text in enumerate(code)]
    out = []
    for i in range(max(len(codes), len(chats))):
        out += chats[i : i + 1] + codes[i : i + 1]
    return out


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
