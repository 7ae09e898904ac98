"""Seeded generator of the tiny dLLM's corpus: (category, prompt, answer) examples in eight families.

The same generator feeds training (``dllm.train``) and the built-in workload, so the request mix a
user collects on is the mix the model learned. Categories mirror the serving mix of the DWISE paper
and differ in how deterministic their answers are:

- ``chat``: templated but variable answers (random opener, topic sentences in random order, random
  closer) — many continuations are plausible, nothing to check;
- ``instruction``, ``code``, ``math``, ``multilingual_math``: one right answer, checkable;
- ``mcq`` / ``hard_mcq``: one right option (4 or 5 choices), the hard kind answering by checking the
  options in order;
- ``long_context``: 2-4 facts hidden among a few hundred tokens of distractor sentences, all queried.

Inside a category the **amount of work** depends on what the prompt *says*, not on how long it is:
a count written as a number or a word ("repeat the word cat seven times"), a range whose size must be
computed ("count down from 47 by 5"), a word whose spelling length is hidden behind one token, the
position of the right option when options are checked in order, an answer format asked for in a few
words. Prompt-size features (words, newlines, tokens) therefore cannot see it, while a model that has
read the prompt can.

Training also mixes in two drills (:data:`DRILLS`) that are never served: copying the prompt's
tokens, and naming the letter of the option that says X.

Text format: every prompt and answer is a sequence of tokens separated by single spaces (prompts may
also contain newlines). Every token is in :func:`vocabulary`: lower-case words, the numbers 0-99 as
whole tokens, single letters and punctuation. A word-level tokenizer with whitespace splitting is
therefore lossless up to whitespace.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from dwise_predict.errors import InputError

CATEGORIES: tuple[str, ...] = (
    "chat",
    "instruction",
    "code",
    "math",
    "multilingual_math",
    "mcq",
    "hard_mcq",
    "long_context",
)


@dataclass
class Example:
    """One request of the corpus.

    category : one of :data:`CATEGORIES`.
    prompt : the user message (before any chat template), space-separated tokens.
    answer : the reference answer, space-separated tokens.
    meta : the knobs that set the difficulty and what :func:`check_answer` needs (``template``,
        ``count``, ``language``, ``correct`` option letter, ``facts`` ...).
    """

    category: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


# --- word pools ---------------------------------------------------------------------------------

NUMBERS = [str(i) for i in range(100)]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
PUNCTUATION = [".", ",", "?", "!", ":", "(", ")", "[", "]", "=", "+", "-", "*", ">", "<"]

# counts 1..12 written as words, per language (the model must read them as amounts)
COUNT_WORDS = {
    "en": ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"],
    "es": ["uno", "dos", "tres", "cuatro", "cinco", "seis", "siete", "ocho", "nueve", "diez", "once", "doce"],
    "fr": ["un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf", "dix", "onze", "douze"],
    "de": ["eins", "zwei", "drei", "vier", "funf", "sechs", "sieben", "acht", "neun", "zehn", "elf", "zwolf"],
}

KINDS = {  # singular kind -> (plural, members)
    "color": ("colors", ["red", "blue", "green", "yellow", "black", "white", "pink", "brown", "orange", "gray"]),
    "animal": ("animals", ["cat", "dog", "horse", "mouse", "bird", "fish", "lion", "tiger", "sheep", "rabbit", "elephant", "frog"]),
    "fruit": ("fruits", ["apple", "pear", "banana", "grape", "lemon", "cherry", "mango", "peach", "plum", "melon"]),
    "tool": ("tools", ["hammer", "saw", "knife", "spoon", "brush", "pencil", "rope", "shovel"]),
}
KIND_MEMBERS = [m for _, ms in KINDS.values() for m in ms]  # every color, animal, fruit and tool
OBJECTS = ["box", "key", "door", "car", "cup", "hat", "book", "lamp", "bag", "clock"]
NAMES = ["tom", "anna", "ben", "lisa", "sam", "maria", "leo", "nina"]
PRINT_WORDS = ["hello", "yes", "no", "done", "ok", "big", "small", "stop"]
FUNC_NAMES = ["foo", "bar", "add", "total", "calc", "run", "step", "solve"]
VAR_NAMES = ["x", "y", "data", "nums", "values", "items"]
COLOR_FACTS = [("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"),
               ("coal", "black"), ("a cherry", "red"), ("an orange", "orange"), ("a mouse", "gray")]

CHAT_TOPICS = {  # topic phrase -> sentences, any subset in any order is a good answer
    "cats": ["cats like to sleep in the sun .", "cats have soft fur .", "cats can see well at night .",
             "cats like to play with string .", "cats are quiet animals .", "cats clean themselves often ."],
    "dogs": ["dogs are loyal friends .", "dogs like to run in the park .", "dogs can learn many tricks .",
             "dogs have a good sense of smell .", "dogs need a walk every day .", "dogs like to play with a ball ."],
    "the sea": ["the sea is very deep .", "the sea is full of fish .", "the sea covers most of the world .",
                "the sea water is salty .", "the sea can be calm or wild .", "people like to swim in the sea ."],
    "the sun": ["the sun is a star .", "the sun gives us light .", "the sun is very hot .",
                "the sun rises in the morning .", "the sun is far away .", "plants need the sun to grow ."],
    "trees": ["trees give us wood .", "trees have green leaves .", "trees can live for many years .",
              "trees make the air clean .", "birds live in trees .", "trees grow from small seeds ."],
    "music": ["music can make people happy .", "music has rhythm and sound .", "people play music on a piano .",
              "music is good for the mind .", "many people like to sing .", "music is old and new at the same time ."],
    "rain": ["rain comes from the clouds .", "rain helps plants grow .", "rain makes the streets wet .",
             "rain is water that falls from the sky .", "people use a hat in the rain .", "rain can be light or heavy ."],
    "books": ["books tell many stories .", "books can teach us new things .", "people read books at night .",
              "books are made of paper .", "a good book is a good friend .", "books can be long or short ."],
}
CHAT_GREETINGS = ["hi", "hello", "hey"]
CHAT_ASKS = ["tell me about", "what do you know about", "can you talk about"]
CHAT_OPENERS = ["sure !", "of course !", "good question !", "happy to help ."]
CHAT_CLOSERS = ["hope this helps .", "ask me more if you like .", "that is all for now ."]

FILLERS = [  # long-context distractors: no numbers, no "secret number" phrase
    "the old man walked slowly to the market .", "the wind was cold that morning .",
    "a small bird sat on the roof .", "the children played near the river .",
    "the town was quiet after the rain .", "a woman sold bread at the corner .",
    "the train arrived late in the evening .", "many people waited at the station .",
    "the garden was full of flowers .", "a dog slept under the table .",
    "the road went up the green hill .", "the teacher read a long story .",
    "the lights of the city were bright .", "a boat moved across the lake .",
    "the farmer worked in the field all day .", "the shop closed early on sunday .",
    "the night was dark and still .", "a cat watched the street from the window .",
    "the students talked about the weather .", "the baker made fresh cakes .",
    "the clouds moved over the mountains .", "the market was busy and loud .",
    "the river was wide and slow .", "an old bridge stood near the village .",
]

# per language: the templates of multilingual math and the way the final answer is stated
LANG = {
    "en": {
        "add": "start at {s} and add {k} , {count} times . what is the result ?",
        "down": "count down from {s} by {k} .",
        "story": "{name} has {a} apples and gets {b} more . how many apples does {name} have now ?",
        "final": "the answer is {x} .",
    },
    "es": {
        "add": "empieza en {s} y suma {k} , {count} veces . cual es el resultado ?",
        "down": "cuenta hacia atras desde {s} de {k} en {k} .",
        "story": "{name} tiene {a} manzanas y recibe {b} mas . cuantas manzanas tiene {name} ahora ?",
        "final": "la respuesta es {x} .",
    },
    "fr": {
        "add": "commence a {s} et ajoute {k} , {count} fois . quel est le resultat ?",
        "down": "compte a rebours depuis {s} par {k} .",
        "story": "{name} a {a} pommes et en recoit {b} de plus . combien de pommes a {name} maintenant ?",
        "final": "la reponse est {x} .",
    },
    "de": {
        "add": "beginne bei {s} und addiere {k} , {count} mal . was ist das ergebnis ?",
        "down": "zahle von {s} abwarts in schritten von {k} .",
        "story": "{name} hat {a} apfel und bekommt {b} dazu . wie viele apfel hat {name} jetzt ?",
        "final": "die antwort ist {x} .",
    },
}

# every template string below is also read by vocabulary(): keep literal words here, slots in {}
T = {
    "chat": "{greet} ! {ask} {topic} {cue}",
    "chat_cue": ["briefly .", "in {count} sentences .", "in detail .", "please ."],
    "repeat": "repeat the word {w} {count} times .",
    "range": "list the numbers from {a} to {b} .",
    "name": "name {count} {kinds} .",
    "spell": "spell the word {w} .",
    "alphabet": "say the letters from {l1} to {l2} .",
    "code_sum": "write a function {f} that returns the sum of {count} numbers .",
    "code_list": "make a list {v} of the numbers from {a} to {b} .",
    "code_loop": "write a loop that prints {w} {count} times .",
    "code_if": "write code that prints {w1} if x is greater than {n} and {w2} otherwise .",
    "code_mul": "write a function {f} that multiplies x by {n} .",
    "code_answers": ["def {f} ( {params} ) : return {expr}", "{v} = [ {values} ]",
                     "for i in range ( {n} ) : print ( {w} )",
                     "if x > {n} : print ( {w1} ) else : print ( {w2} )", "def {f} ( x ) : return x * {n}"],
    "times": "what is {a} times {b} ?",
    "times_answer": "{a} * {b} = {c} .",
    "mcq_member": "question : which of these is a {kind} ?",
    "mcq_largest": "question : which number is the largest ?",
    "mcq_sum": "question : what is {a} plus {b} ?",
    "mcq_color": "question : what color is {thing} ?",
    "mcq_formats": ["answer with the letter .", "answer with the option .", "answer and explain ."],
    "mcq_explain": ["{x} is a {kind} .", "{x} is the largest .", "{a} + {b} = {x} .", "{thing} is {x} ."],
    "hard_prop": "question : which number is {prop} ? check each option in order .",
    "hard_props": ["even", "odd", "greater than {n}", "less than {n}"],
    "hard_not": "question : which of these is not a {kind} ? check each option in order .",
    "hard_check": ["{o} ) {x} is {prop} .", "{o} ) {x} is not {prop} .", "{o} ) {x} is a {kind} .",
                   "{o} ) {x} is not a {kind} ."],
    "hard_two_step": "question : what is {a} plus {b} minus {c} ?",
    "hard_final": "the answer is {o} .",
    "fact": "the secret number of the {c} {obj} is {n} .",
    "query": "question : what are the secret numbers of {items} ?",
    "query_join": ["the {c} {obj}", ",", "and"],
    "fact_answer": "the {c} {obj} is {n} .",
    "drill_copy": "say exactly : {tokens}",
    "drill_lookup": "question : which option is {x} ?",
}


# --- helpers ------------------------------------------------------------------------------------


def _count_token(rng: random.Random, count: int, lang: str = "en") -> str:
    """A count as the prompt says it: a digit token or a word, half and half."""
    return COUNT_WORDS[lang][count - 1] if rng.random() < 0.5 else str(count)


def _options(rng: random.Random, correct: str, distractors: list[str], k: int) -> tuple[list[str], int]:
    """``k`` options holding ``correct`` at a random position; returns (options, correct index)."""
    opts = rng.sample(distractors, k - 1)
    pos = rng.randrange(k)
    opts.insert(pos, correct)
    return opts, pos


def _option_lines(options: list[str]) -> str:
    return "\n".join(f"{LETTERS[i]} ) {o}" for i, o in enumerate(options))


def _join_items(items: list[str]) -> str:
    """``a`` / ``a and b`` / ``a , b and c``."""
    if len(items) == 1:
        return items[0]
    return " , ".join(items[:-1]) + " and " + items[-1]


# --- categories ---------------------------------------------------------------------------------


def _chat(rng: random.Random) -> Example:
    topic = rng.choice(list(CHAT_TOPICS))
    cue_kind = rng.randrange(4)
    if cue_kind == 0:  # briefly
        n_sent, count = 1, None
    elif cue_kind == 1:  # in N sentences
        count = rng.randint(1, 5)
        n_sent = count
    elif cue_kind == 2:  # in detail
        n_sent, count = 5, None
    else:  # no length cue: the length is the model's own choice
        n_sent, count = rng.randint(1, 3), None
    cue = T["chat_cue"][cue_kind].format(count=_count_token(rng, count) if count else "")
    prompt = T["chat"].format(greet=rng.choice(CHAT_GREETINGS), ask=rng.choice(CHAT_ASKS), topic=topic, cue=cue)
    parts = [rng.choice(CHAT_OPENERS), *rng.sample(CHAT_TOPICS[topic], n_sent)]
    if rng.random() < 0.5:
        parts.append(rng.choice(CHAT_CLOSERS))
    return Example("chat", prompt, " ".join(parts), {"template": "chat", "topic": topic, "count": n_sent})


def _instruction(rng: random.Random) -> Example:
    kind = rng.choice(["repeat", "range", "name", "spell", "alphabet"])
    if kind == "repeat":
        w = rng.choice(KIND_MEMBERS)
        count = rng.randint(2, 12)
        prompt = T["repeat"].format(w=w, count=_count_token(rng, count))
        answer = " ".join([w] * count)
    elif kind == "range":
        a = rng.randint(0, 80)
        b = a + rng.randint(1, 15)
        count = b - a + 1
        prompt = T["range"].format(a=a, b=b)
        answer = " ".join(str(i) for i in range(a, b + 1))
    elif kind == "name":
        singular = rng.choice(list(KINDS))
        plural, members = KINDS[singular]
        count = rng.randint(1, 6)
        prompt = T["name"].format(count=_count_token(rng, count), kinds=plural)
        answer = " , ".join(rng.sample(members, count))
        return Example("instruction", prompt, answer,
                       {"template": kind, "count": count, "kind": singular, "members": members})
    elif kind == "spell":
        w = rng.choice(KIND_MEMBERS)
        count = len(w)
        prompt = T["spell"].format(w=w)
        answer = " ".join(w)
    else:  # alphabet
        i = rng.randrange(0, 20)
        j = min(25, i + rng.randint(1, 12))
        count = j - i + 1
        prompt = T["alphabet"].format(l1=LETTERS[i], l2=LETTERS[j])
        answer = " ".join(LETTERS[i : j + 1])
    return Example("instruction", prompt, answer, {"template": kind, "count": count})


def _code(rng: random.Random) -> Example:
    kind = rng.choice(["sum", "list", "loop", "if", "mul"])
    f, v = rng.choice(FUNC_NAMES), rng.choice(VAR_NAMES)
    answers = T["code_answers"]
    if kind == "sum":
        count = rng.randint(2, 7)
        params = LETTERS[:count]
        prompt = T["code_sum"].format(f=f, count=_count_token(rng, count))
        answer = answers[0].format(f=f, params=" , ".join(params), expr=" + ".join(params))
    elif kind == "list":
        a = rng.randint(0, 85)
        b = a + rng.randint(1, 9)
        count = b - a + 1
        prompt = T["code_list"].format(v=v, a=a, b=b)
        answer = answers[1].format(v=v, values=" , ".join(str(i) for i in range(a, b + 1)))
    elif kind == "loop":
        count = rng.randint(1, 12)
        w = rng.choice(PRINT_WORDS)
        prompt = T["code_loop"].format(w=w, count=_count_token(rng, count))
        answer = answers[2].format(n=count, w=w)
    elif kind == "if":
        count = 1
        w1, w2 = rng.sample(PRINT_WORDS, 2)
        n = rng.randint(0, 99)
        prompt = T["code_if"].format(w1=w1, w2=w2, n=n)
        answer = answers[3].format(n=n, w1=w1, w2=w2)
    else:  # mul
        count = 1
        n = rng.randint(2, 99)
        prompt = T["code_mul"].format(f=f, n=n)
        answer = answers[4].format(f=f, n=n)
    return Example("code", prompt, answer, {"template": kind, "count": count})


def _math_in(rng: random.Random, lang: str, category: str) -> Example:
    """Arithmetic in one language; the number of written steps is what the prompt asks for."""
    kinds = ["add", "down", "story"] + (["times"] if lang == "en" else [])
    kind = rng.choice(kinds)
    final = LANG[lang]["final"]
    if kind == "add":
        count = rng.randint(1, 8)
        k = rng.randint(1, 9)
        s = rng.randint(0, 99 - k * count)
        prompt = LANG[lang]["add"].format(s=s, k=k, count=_count_token(rng, count, lang))
        steps = [f"{s + k * i} + {k} = {s + k * (i + 1)} ." for i in range(count)]
        result = s + k * count
        answer = " ".join(steps + [final.format(x=result)])
    elif kind == "down":
        k = rng.randint(2, 9)
        s = rng.randint(k, min(99, 12 * k))  # at most 13 numbers
        seq = list(range(s, -1, -k))
        count = len(seq)
        result = seq[-1]
        prompt = LANG[lang]["down"].format(s=s, k=k)
        answer = " ".join(str(i) for i in seq) + " . " + final.format(x=result)
    elif kind == "story":
        count = 1
        a = rng.randint(1, 60)
        b = rng.randint(1, 99 - a)
        result = a + b
        prompt = LANG[lang]["story"].format(name=rng.choice(NAMES), a=a, b=b)
        answer = f"{a} + {b} = {result} . " + final.format(x=result)
    else:  # times
        count = 1
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        result = a * b
        prompt = T["times"].format(a=a, b=b)
        answer = T["times_answer"].format(a=a, b=b, c=result) + " " + final.format(x=result)
    return Example(category, prompt, answer, {"template": kind, "count": count, "language": lang, "result": result})


def _math(rng: random.Random) -> Example:
    return _math_in(rng, "en", "math")


def _multilingual_math(rng: random.Random) -> Example:
    return _math_in(rng, rng.choice(["es", "fr", "de"]), "multilingual_math")


def _mcq(rng: random.Random) -> Example:
    kind = rng.choice(["member", "largest", "sum", "color"])
    fmt = rng.randrange(3)
    if kind == "member":
        singular = rng.choice(list(KINDS))
        others = [m for k, (_, ms) in KINDS.items() if k != singular for m in ms]
        correct = rng.choice(KINDS[singular][1])
        question = T["mcq_member"].format(kind=singular)
        explain = T["mcq_explain"][0].format(x=correct, kind=singular)
    elif kind == "largest":
        nums = rng.sample(range(100), 4)
        correct = str(max(nums))
        others = [str(n) for n in nums if str(n) != correct]
        question = T["mcq_largest"]
        explain = T["mcq_explain"][1].format(x=correct)
    elif kind == "sum":
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        correct = str(a + b)
        others = [str(a + b + d) for d in (-10, -2, -1, 1, 2, 10) if 0 <= a + b + d < 100]
        question = T["mcq_sum"].format(a=a, b=b)
        explain = T["mcq_explain"][2].format(a=a, b=b, x=correct)
    else:  # color
        thing, correct = rng.choice(COLOR_FACTS)
        others = [c for c in KINDS["color"][1] if c != correct]
        question = T["mcq_color"].format(thing=thing)
        explain = T["mcq_explain"][3].format(thing=thing, x=correct)
    options, pos = _options(rng, correct, others, 4)
    letter = LETTERS[pos]
    prompt = question + "\n" + _option_lines(options) + "\n" + T["mcq_formats"][fmt]
    answer = [letter, f"{letter} ) {correct}", f"{letter} ) {correct} . {explain}"][fmt]
    return Example("mcq", prompt, answer, {"template": kind, "format": fmt, "correct": letter, "count": 1})


def _hard_mcq(rng: random.Random) -> Example:
    """Five options; the answer checks them in order, so its length is the right option's position."""
    kind = rng.choice(["prop", "not", "two_step"])
    if kind in ("prop", "not"):
        if kind == "prop":
            which = rng.randrange(4)
            n = rng.randint(20, 80)
            prop = T["hard_props"][which].format(n=n)
            tests = [lambda x: x % 2 == 0, lambda x: x % 2 == 1, lambda x: x > n, lambda x: x < n][which]
            pool = list(range(100))
            good = [str(x) for x in pool if tests(x)]
            bad = [str(x) for x in pool if not tests(x)]
            question = T["hard_prop"].format(prop=prop)
            yes, no = T["hard_check"][0], T["hard_check"][1]
            fill = {"prop": prop}
        else:
            singular = rng.choice(list(KINDS))
            bad = KINDS[singular][1]
            good = [m for k, (_, ms) in KINDS.items() if k != singular for m in ms]
            question = T["hard_not"].format(kind=singular)
            # checking an option says whether it is a member; the right one is "not a" member
            yes, no = T["hard_check"][3], T["hard_check"][2]
            fill = {"kind": singular}
        correct = rng.choice(good)
        options, pos = _options(rng, correct, bad, 5)
        checks = [(yes if i == pos else no).format(o=LETTERS[i], x=options[i], **fill) for i in range(pos + 1)]
        answer = " ".join(checks + [T["hard_final"].format(o=LETTERS[pos])])
        count = pos + 1
    else:  # two_step
        a, b = rng.randint(1, 50), rng.randint(1, 40)
        c = rng.randint(1, a + b)
        mid, res = a + b, a + b - c
        others = [str(res + d) for d in (-10, -3, -2, -1, 1, 2, 3, 10) if 0 <= res + d < 100]
        options, pos = _options(rng, str(res), others, 5)
        question = T["hard_two_step"].format(a=a, b=b, c=c)
        answer = f"{a} + {b} = {mid} . {mid} - {c} = {res} . " + T["hard_final"].format(o=LETTERS[pos])
        count = 1
    prompt = question + "\n" + _option_lines(options)
    return Example("hard_mcq", prompt, answer, {"template": kind, "correct": LETTERS[pos], "count": count})


def _long_context(rng: random.Random, target_tokens: tuple[int, int] = (120, 300)) -> Example:
    """2-4 facts among distractor sentences; the prompt length is drawn independently of the count."""
    count = rng.randint(2, 4)
    keys = rng.sample([(c, o) for c in KINDS["color"][1] for o in OBJECTS], count)
    facts = [(c, o, rng.randint(0, 99)) for c, o in keys]
    target = rng.randint(*target_tokens)
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < target:
        sentences.append(rng.choice(FILLERS))
    for c, o, n in facts:
        sentences.insert(rng.randrange(len(sentences) + 1), T["fact"].format(c=c, obj=o, n=n))
    order = rng.sample(facts, count)  # asked in another order than told
    items = _join_items([T["query_join"][0].format(c=c, obj=o) for c, o, _ in order])
    prompt = "\n".join(sentences) + "\n" + T["query"].format(items=items)
    answer = " ".join(T["fact_answer"].format(c=c, obj=o, n=n) for c, o, n in order)
    return Example("long_context", prompt, answer,
                   {"template": "needles", "count": count, "facts": [[c, o, n] for c, o, n in order]})


# --- training drills ----------------------------------------------------------------------------
# Not served categories: short exercises mixed into training only. Each isolates one skill that the
# categories need and that a small model is slow to find from them alone: copying prompt tokens in
# order (instruction, code, arithmetic, long context all restate numbers and words from the prompt)
# and finding an option's letter by its content (MCQ). They are cheap (a few dozen tokens).

DRILLS: tuple[str, ...] = ("copy", "option_lookup")


DRILL_WORDS = NUMBERS + LETTERS + KIND_MEMBERS + OBJECTS + PRINT_WORDS + NAMES  # what a copy drill copies


def _copy_drill(rng: random.Random) -> Example:
    tokens = [rng.choice(DRILL_WORDS) for _ in range(rng.randint(2, 16))]
    prompt = T["drill_copy"].format(tokens=" ".join(tokens))
    return Example("copy", prompt, " ".join(tokens), {"template": "copy", "count": len(tokens)})


def _option_lookup_drill(rng: random.Random) -> Example:
    pool = NUMBERS if rng.random() < 0.5 else KIND_MEMBERS + OBJECTS
    k = rng.choice([4, 5])
    options = rng.sample(pool, k)
    pos = rng.randrange(k)
    letter, fmt = LETTERS[pos], rng.randrange(2)
    prompt = (T["drill_lookup"].format(x=options[pos]) + "\n" + _option_lines(options) + "\n"
              + T["mcq_formats"][fmt])
    answer = [letter, f"{letter} ) {options[pos]}"][fmt]
    return Example("option_lookup", prompt, answer, {"template": "lookup", "correct": letter, "count": 1})


_GENERATORS: dict[str, Callable[[random.Random], Example]] = {
    "chat": _chat,
    "instruction": _instruction,
    "code": _code,
    "math": _math,
    "multilingual_math": _multilingual_math,
    "mcq": _mcq,
    "hard_mcq": _hard_mcq,
    "long_context": _long_context,
    "copy": _copy_drill,
    "option_lookup": _option_lookup_drill,
}


def generate_examples(category: str, n: int, seed: int) -> list[Example]:
    """``n`` examples of one category (or training drill, see :data:`DRILLS`), the same for the same
    ``(category, n, seed)``.

    The first ``m`` examples of ``generate_examples(c, n, s)`` equal ``generate_examples(c, m, s)``.

    Raises
    ------
    InputError
        Unknown category or negative ``n``.
    """
    if category not in _GENERATORS:
        raise InputError(f"unknown category {category!r}: choose one of {', '.join(CATEGORIES)}"
                         f" (training drills: {', '.join(DRILLS)})")
    if n < 0:
        raise InputError(f"number of examples must be >= 0, got {n}")
    # a string seed hashes with SHA-512 inside random.Random: stable across processes and versions
    rng = random.Random(f"{category}:{seed}")
    return [_GENERATORS[category](rng) for _ in range(n)]


# --- answer checking ----------------------------------------------------------------------------

_FINAL = re.compile(r"(?:the answer is|la respuesta es|la reponse est|die antwort ist) (\S+)")


def _norm(text: str) -> str:
    return " ".join(text.split())


def check_answer(example: Example, output_text: str) -> bool | None:
    """Whether a model's output answers ``example`` correctly; ``None`` where nothing is checkable (chat).

    Exact (whitespace-normalised) match for answers with one right form; the final stated number or
    letter for arithmetic and multiple choice; count, membership and distinctness for "name N
    things"; every queried fact for long context.
    """
    out = _norm(output_text)
    meta = example.meta
    cat = example.category
    if cat == "chat":
        return None
    if cat in ("math", "multilingual_math") and meta["template"] != "down":
        found = _FINAL.findall(out)
        return bool(found) and found[-1] == str(meta["result"])
    if cat == "mcq":
        return out.split(" ")[0] == meta["correct"]
    if cat == "hard_mcq":
        found = _FINAL.findall(out)
        return bool(found) and found[-1] == meta["correct"]
    if cat == "long_context":
        return all(T["fact_answer"].format(c=c, obj=o, n=n) in out for c, o, n in meta["facts"])
    if cat == "instruction" and meta["template"] == "name":
        items = [t.strip() for t in out.split(",")]
        return (len(items) == meta["count"] and len(set(items)) == len(items)
                and all(t in meta["members"] for t in items))
    return out == _norm(example.answer)


# --- vocabulary ---------------------------------------------------------------------------------


def _template_words(obj) -> list[str]:
    """Literal tokens of template strings (slots like ``{count}`` left out), recursively."""
    if isinstance(obj, str):
        return [t for t in obj.split() if not (t.startswith("{") and t.endswith("}"))]
    if isinstance(obj, dict):
        return [w for v in obj.values() for w in _template_words(v)]
    if isinstance(obj, (list, tuple)):
        return [w for v in obj for w in _template_words(v)]
    return []


def vocabulary() -> list[str]:
    """Every token any example can contain, in a fixed order (numbers, letters, punctuation, words).

    Built from the same pools and templates the generators use, so it cannot fall out of step.
    """
    words = _template_words(
        [T, LANG, COUNT_WORDS, [(p, ms) for p, ms in KINDS.values()], list(KINDS), OBJECTS, NAMES,
         PRINT_WORDS, FUNC_NAMES, VAR_NAMES, [list(x) for x in COLOR_FACTS], CHAT_TOPICS, list(CHAT_TOPICS),
         CHAT_GREETINGS, CHAT_ASKS, CHAT_OPENERS, CHAT_CLOSERS, FILLERS]
    )
    head = NUMBERS + LETTERS + PUNCTUATION
    seen = set(head)
    rest = sorted({w for w in words if w not in seen})
    return head + rest
