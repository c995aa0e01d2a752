"""Word lists and sentence templates the workload generators draw from (written for this project,
no downloaded data). Every function takes a `random.Random`, so a seed fixes every text."""

from __future__ import annotations

import random

FIRST_NAMES = (
    "Isabella Klaus Maria Abigail Tom Jane Carlos Ayesha Wolfgang Mei Yuriko Rajiv Hailey Sam "
    "Francisco Latoya Giorgio Adam Eddy John Carmen Arthur Ryan Jennifer Tamara Hiro Nadia Omar "
    "Lena Pablo Greta Kofi Ines Viktor Aiko Bruno Clara Dmitri Elif Farah Gustav Hana Ivan Jonas"
).split()
LAST_NAMES = (
    "Rodriguez Mueller Lopez Chen Moreno Lin Yamamoto Kumar Johnson Taylor Smith Bianchi Novak "
    "Okafor Silva Berg Petrov Haddad Kowalski Andersen Moreau Tanaka Rossi Nguyen Fischer Costa"
).split()
OCCUPATIONS = (
    "baker painter pharmacist student shopkeeper musician librarian carpenter nurse teacher "
    "fisher tailor gardener mechanic journalist chef farmer barista architect poet"
).split()
TRAITS = (
    "friendly curious stubborn generous anxious cheerful patient ambitious shy talkative careful "
    "creative honest impatient thoughtful playful proud gentle restless practical"
).split()
PLACES = (
    "the cafe|the park|the library|the town square|the pharmacy|the college|the bakery|the market|"
    "the river bank|the old bridge|the community garden|the bus stop|the pub|the music hall|the dock"
).split("|")
ACTIVITIES = (
    "repairing a fence|reading the newspaper|painting a mural|arguing about the election|"
    "planning a party|buying bread|watering plants|practising the violin|writing a letter|"
    "fixing a bicycle|talking about the weather|closing the shop early|drinking tea|"
    "looking for a lost cat|carrying boxes|sketching the river|counting coins|sweeping the floor"
).split("|")
TOPICS = (
    "the Valentine's Day party|the mayoral election|the new bakery|the broken bridge|the winter "
    "festival|rising rent|the lost cat|the library's opening hours|a concert on Friday|the storm "
    "last night|the farmers' market|a new student in town|the price of coffee|the school play"
).split("|")
FEELINGS = "excited worried curious annoyed hopeful tired proud surprised nervous grateful".split()
HOBBIES = (
    "gardening|chess|baking sourdough|birdwatching|jazz records|long walks|poetry|cycling|"
    "old films|woodworking|photography|cooking for friends|local history|crossword puzzles"
).split("|")
OPINIONS = (
    "the town needs more green space|small shops matter more than big ones|everyone should vote|"
    "the festival is too expensive|neighbours should help each other|the bus should run later|"
    "art belongs in public places|the river must be protected|young people need more jobs here"
).split("|")
FILLER = (
    "really quite perhaps certainly usually often soon again together honestly later today "
    "tonight tomorrow nearby somehow probably maybe clearly"
).split()


def full_name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def clock(rng: random.Random, day: int) -> str:
    return f"[Day {day}, {rng.randrange(7, 22):02d}:{rng.randrange(0, 60, 5):02d}]"


def persona_sentences(rng: random.Random, name: str, town: str) -> list[str]:
    """An endless supply of sentences about one person; callers take as many as they need."""
    first = name.split()[0]
    sentences = [
        f"{name} is a {rng.randrange(19, 75)}-year-old {rng.choice(OCCUPATIONS)} living in {town}.",
        f"{first} is {rng.choice(TRAITS)}, {rng.choice(TRAITS)} and {rng.choice(TRAITS)}.",
    ]
    templates = (
        lambda: f"{first} enjoys {rng.choice(HOBBIES)} and spends free evenings at {rng.choice(PLACES)}.",
        lambda: f"{first} believes that {rng.choice(OPINIONS)}.",
        lambda: f"{first} is {rng.choice(FEELINGS)} about {rng.choice(TOPICS)}.",
        lambda: f"{first} knows {full_name(rng)}, who works as a {rng.choice(OCCUPATIONS)}.",
        lambda: f"Every morning {first} goes to {rng.choice(PLACES)} before work.",
        lambda: f"{first} is {rng.choice(FILLER)} {rng.choice(TRAITS)} with strangers.",
    )
    while True:
        if sentences:
            yield sentences.pop(0)
        else:
            yield rng.choice(templates)()


def take_words(sentences, num_words: int) -> str:
    """Whole sentences until about `num_words` words."""
    out: list[str] = []
    count = 0
    for sentence in sentences:
        out.append(sentence)
        count += len(sentence.split())
        if count >= num_words:
            return " ".join(out)
    return " ".join(out)


def memory_line(rng: random.Random, names: list[str]) -> str:
    templates = (
        lambda: f"Saw {rng.choice(names)} {rng.choice(ACTIVITIES)} at {rng.choice(PLACES)}.",
        lambda: f"Talked with {rng.choice(names)} about {rng.choice(TOPICS)}.",
        lambda: f"Felt {rng.choice(FEELINGS)} about {rng.choice(TOPICS)}.",
        lambda: f"Heard that {rng.choice(names)} thinks {rng.choice(OPINIONS)}.",
        lambda: f"Was {rng.choice(ACTIVITIES)} at {rng.choice(PLACES)}.",
    )
    return rng.choice(templates)()


def utterance(rng: random.Random, num_words: int, names: list[str]) -> str:
    """Something an agent says, about `num_words` words."""
    templates = (
        lambda: f"I was {rng.choice(ACTIVITIES)} at {rng.choice(PLACES)} and I am {rng.choice(FEELINGS)} about {rng.choice(TOPICS)}.",
        lambda: f"Has anyone seen {rng.choice(names)}? We should talk about {rng.choice(TOPICS)}.",
        lambda: f"I think {rng.choice(OPINIONS)}, {rng.choice(FILLER)}.",
        lambda: f"Let us meet at {rng.choice(PLACES)} {rng.choice(FILLER)} to discuss {rng.choice(TOPICS)}.",
        lambda: f"{rng.choice(names)} told me about {rng.choice(TOPICS)}; I am {rng.choice(FEELINGS)}.",
    )
    return take_words((rng.choice(templates)() for _ in range(1000)), num_words)


def lognormal_int(rng: random.Random, median: float, low: int, high: int, sigma: float = 0.45) -> int:
    """A right-skewed length with the given median, clipped to [low, high]."""
    return max(low, min(high, round(median * rng.lognormvariate(0.0, sigma))))
